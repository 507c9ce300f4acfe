"""Token-level alignment analysis of trust-region direction criteria (PDM paper, arXiv 2607.10848).

* `alignment` — pure per-token bookkeeping: keep decisions of the ratio and predictive criteria (their names:
  `pdm_jax.rl.trust_region.DIRECTION_CRITERIA`, plus the ``full`` oracle and ``param_jvp``), realized ΔD, unsafe-keep /
  corrective / sign-agreement rates, estimator fidelity against the full-vocabulary derivative;
* `param_direction` — Ḋᵖ_t = ⟨∇_θ D_t, Δθ⟩, every token's first-order
  divergence change under a parameter update, one ``jax.jvp`` per batch;
* `callback` — `AlignmentCallback`, a `pdm_jax.callbacks.TrainerCallback` that records them around every real optimizer
  step (and an isolated mode);
* `run` — many short seeds in one process; `report` — markdown + figures;
* ``python -m pdm_jax.analysis run --out=DIR --seeds=20``.
"""

from pdm_jax.analysis.alignment import (ALL_CRITERIA, ORACLE, alignment_counts, alignment_rates, fidelity_analysis,
                                        fidelity_counts, mean_ci95, select_tokens, token_analysis)
from pdm_jax.analysis.callback import AlignmentCallback
from pdm_jax.analysis.param_direction import (PARAM_CRITERION, param_directional_change, param_jvp_topk_kl,
                                              parameter_update)

__all__ = ["ALL_CRITERIA", "AlignmentCallback", "ORACLE", "PARAM_CRITERION", "alignment_counts", "alignment_rates",
           "fidelity_analysis", "fidelity_counts", "mean_ci95", "param_directional_change", "param_jvp_topk_kl",
           "parameter_update", "select_tokens", "token_analysis"]
