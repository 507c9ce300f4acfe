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
            from tensorboardX import SummaryWriter

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


def plot_curves(records: Iterable[dict], out_png: str,
                keys=("reward", "eval_accuracy", "frac_masked", "mean_topk_kl")) -> None:
    """Draws RL curves (reward, accuracy, masked fraction, top-K KL against step) with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
