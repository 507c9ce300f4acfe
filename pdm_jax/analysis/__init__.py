"""Token-level alignment analysis of trust-region direction criteria (PDM paper, arXiv 2607.10848).

* `alignment` — pure per-token bookkeeping: keep decisions of the ratio and
  predictive criteria (their names: `pdm_jax.trust_region.DIRECTION_CRITERIA`,
  plus the ``full`` oracle), realized ΔD, unsafe-keep / corrective /
  sign-agreement rates, estimator fidelity against the full-vocabulary derivative;
* `callback` — `AlignmentCallback`, a `pdm_jax.trainer.TrainerCallback` that
  records them around every real optimizer step (and an isolated mode);
* `run` — many short seeds in one process; `report` — markdown + figures;
* ``python -m pdm_jax.analysis run --out=DIR --seeds=20``.
"""

from pdm_jax.analysis.alignment import (ORACLE, alignment_counts, alignment_rates, fidelity_analysis, fidelity_counts,
                                        mean_ci95, select_tokens, token_analysis)

__all__ = ["ORACLE", "alignment_counts", "alignment_rates", "fidelity_analysis", "fidelity_counts", "mean_ci95",
           "select_tokens", "token_analysis"]
