"""Metric sinks of the training loop: JSON lines, TensorBoard (tensorboardX), curves (matplotlib)."""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, Mapping

import numpy as np


def _to_float(v):
    try:
        f = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return f


class MetricsWriter:
    """Appends one JSON object per step to ``DIR/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Non-finite values are written as JSON null (and skipped in TensorBoard), never
    as NaN literals. On resume, RL and eval lines of steps >= the resume step are dropped first
    so that the file has each step once.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, resume_from_step: int | None = None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        os.makedirs(workdir, exist_ok=True)
        if resume_from_step is not None and os.path.exists(self.path):
            kept = [r for r in read_metrics(self.path)
                    if r.get("step", -1) < resume_from_step or r.get("phase") not in ("rl", "eval")]
            with open(self.path, "w") as f:
                for r in kept:
                    f.write(json.dumps(r) + "\n")
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # only when log.tensorboard is on

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, phase: str, metrics: Mapping[str, object]) -> dict:
        """Writes one record {step, phase, **metrics}; returns the record written."""
        rec = {"step": int(step), "phase": phase}
        for k, v in metrics.items():
            f = _to_float(v)
            rec[k] = None if f is None or not math.isfinite(f) else f
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "phase") and v is not None:
                    self._tb.add_scalar(f"{phase}/{k}", v, step)
        return rec

    def close(self):
        """Flushes and closes the sinks."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    """Reads a metrics.jsonl file into a list of dicts (skipping a torn last line)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def run_summary(records: Iterable[dict], *, config, meta: Mapping, last_eval: Mapping, wall_seconds: float) -> dict:
    """The dict written to ``WORKDIR/summary.json`` at the end of a run.

    Args:
      records: the run's metrics.jsonl records (`read_metrics`; each step once, resumes included).
      config: the run's ConfigDict.
      meta: the final checkpoint meta (``warmstart``, ``rl_step``, ``checkpoint_fallbacks``).
      last_eval: the final evaluation (``eval_accuracy``, ``eval_greedy_accuracy``, ``eval_reward``).
      wall_seconds: wall time of the run, resumes included (s).

    Fields (accuracies are fractions in [0, 1]; None when not measured):

    =========================== ==============================================================
    warmstart_accuracy          avg@k held-out accuracy of the warm start (RL step 0)
    warmstart_greedy_accuracy   greedy (τ = 0) held-out accuracy of the warm start
    final_accuracy              avg@k accuracy of the last evaluation
    final_greedy_accuracy       greedy accuracy of the last evaluation
    evaluations                 every evaluation, by RL step: [{rl_step, eval_accuracy,
                                eval_greedy_accuracy, eval_reward}] (rl_step 0 = warm start)
    frac_masked_mean            mean over the run's RL steps of ``frac_masked``: the fraction
                                of valid completion tokens the mask drops from the loss
                                (non-finite ones included); each step's value is the mean
                                over its optimizer steps
    frac_outside_mean           the same for ``frac_outside``: valid tokens whose divergence
                                is outside the trust region (masked or not)
    frac_masked_last            ``frac_masked`` of the last RL step
    frac_outside_last           ``frac_outside`` of the last RL step
    steps                       RL steps done
    sft_steps                   warm-start (SFT) steps
    wall_seconds                wall time of the run, resumes included (s)
    eval_prompts                held-out prompts per evaluation (``eval.num_prompts``)
    eval_samples_per_prompt     k of avg@k (``eval.samples_per_prompt``)
    trust_region                the ``trust_region`` config section
    sampler_quantization        the sampler's weight format (``sampler.quantization``)
    checkpoint_fallbacks        resumes that fell back past a refused checkpoint (count; the
                                details are in the checkpoints' meta, pdm_jax.checkpointing)
    =========================== ==============================================================
    """
    records = list(records)
    rl = sorted((r for r in records if r.get("phase") == "rl"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("phase") == "eval"), key=lambda r: r["step"])
    warm = meta.get("warmstart") or {}
    last = rl[-1] if rl else {}
    return dict(
        warmstart_accuracy=warm.get("eval_accuracy"),
        warmstart_greedy_accuracy=warm.get("eval_greedy_accuracy"),
        final_accuracy=last_eval.get("eval_accuracy"),
        final_greedy_accuracy=last_eval.get("eval_greedy_accuracy"),
        evaluations=[dict(rl_step=int(r["step"]), **{k: r.get(k) for k in
                                                     ("eval_accuracy", "eval_greedy_accuracy", "eval_reward")})
                     for r in evals],
        frac_masked_mean=_mean(r.get("frac_masked") for r in rl),
        frac_outside_mean=_mean(r.get("frac_outside") for r in rl),
        frac_masked_last=last.get("frac_masked"),
        frac_outside_last=last.get("frac_outside"),
        steps=int(meta["rl_step"]),
        sft_steps=int(config.sft.steps),
        wall_seconds=float(wall_seconds),
        eval_prompts=int(config.eval.num_prompts),
        eval_samples_per_prompt=int(config.eval.samples_per_prompt),
        trust_region=dict(config.trust_region.to_dict()),
        sampler_quantization=config.sampler.quantization,
        checkpoint_fallbacks=len(meta.get("checkpoint_fallbacks", [])),
    )


def plot_curves(records: Iterable[dict], out_png: str,
                keys=("reward", "eval_accuracy", "frac_masked", "mean_topk_kl")) -> None:
    """Draws RL curves (reward, accuracy, masked fraction, top-K KL against step) with matplotlib."""
    import matplotlib  # heavy (~1 s); only when curves are drawn (Agg backend set first)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy (~1 s); only when a figure is drawn (Agg backend set first)

    recs = [r for r in records if r.get("phase") in ("rl", "eval")]
    titles = {"reward": "mean reward", "eval_accuracy": "held-out accuracy (avg@k)",
              "frac_masked": "fraction of tokens masked", "mean_topk_kl": "mean top-K KL(mu||pi)"}
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2))
    for ax, key in zip(np.atleast_1d(axes), keys):
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, lw=1)
        ax.set_title(titles.get(key, key))
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
