"""Metric sinks of the training loop: JSON lines, TensorBoard (tensorboardX), curves (matplotlib), and optionally
Weights & Biases (`pdm_jax.wandb_log`)."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from typing import Iterable, Mapping

import numpy as np

from pdm_jax import evaluation, workdir as wd
from pdm_jax.rewards import function_record

log = logging.getLogger(__name__)


def _to_float(v):
    try:
        f = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return f


class _TensorBoardScalars:
    """TensorBoard scalars written synchronously: tensorboardX's event-file writer and protos, without its writer
    thread (`tensorboardX.SummaryWriter` queues events for a thread that dies on ENOSPC, after which the queue's
    next put blocks forever). Each `add` writes and flushes its events, so a full disk raises right there."""

    def __init__(self, logdir: str):
        from tensorboardX.event_file_writer import EventsWriter  # only when log.tensorboard is on
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        self._event, self._scalar = Event, scalar
        os.makedirs(logdir, exist_ok=True)
        self._writer = EventsWriter(os.path.join(logdir, "events"))
        self._writer.flush()

    def add(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        now = time.time()
        for k, v in scalars.items():
            summary = self._scalar(f"{phase}/{k}", v)
            self._writer.write_event(self._event(wall_time=now, step=int(step), summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Appends one JSON object per step to ``DIR/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Non-finite values are written as JSON null (and skipped in TensorBoard), never
    as NaN literals. On resume, RL and eval lines of steps >= the resume step are dropped first
    so that the file has each step once; ``fresh`` (a run starting over: no checkpoint survived) drops
    every line a run that left no checkpoint wrote; ``restore`` (the checkpoint's copy of its step's ``rl``
    record, without the step's timings) is written back, marked ``restored_from_checkpoint``, when a crash
    after the checkpoint left that record missing or torn. A write that fails (ENOSPC...) raises
    `pdm_jax.workdir.RunWriteError` naming the file, at once (both sinks write synchronously).

    Bucket workdir (``gs://...``, `pdm_jax.workdir.is_remote`): objects cannot be appended to, so
    the file and the TensorBoard events are written in a local staging directory exactly as
    locally (``path`` is the staged metrics.jsonl) and every `write` uploads each of them whole
    (one single-object upload each: the bucket's copy is always a complete file, at most
    the record being written behind). The existing metrics.jsonl is downloaded first on resume.
    Cost: one upload of the whole file per record (O(records^2) bytes over a run).

    ``wandb``: a `pdm_jax.wandb_log.WandbSink` (``log.wandb``) that gets every record's finite scalars after the
    two files (its failures are warnings: `WandbSink` never raises), and the run's end (`log_run_end`); None: none.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, resume_from_step: int | None = None,
                 fresh: bool = False, restore: Mapping | None = None, wandb=None):
        self._wandb = wandb
        self._remote = wd.run_path(workdir) if wd.is_remote(workdir) else None
        self._staging = tempfile.mkdtemp(prefix="pdm_jax_metrics_") if self._remote else None
        local_dir = self._staging or workdir
        self.path = os.path.join(local_dir, "metrics.jsonl")
        if self._remote:
            remote_file = wd.join(self._remote, "metrics.jsonl")
            if wd.exists(remote_file):
                with open(self.path, "wb") as f:
                    f.write(wd.read_bytes(remote_file))
        self._guarded(local_dir, lambda: os.makedirs(local_dir, exist_ok=True))
        if (fresh or resume_from_step is not None) and os.path.exists(self.path):
            kept = [] if fresh else [r for r in read_metrics(self.path)
                                     if r.get("step", -1) < resume_from_step or r.get("phase") not in ("rl", "eval")]
            if restore is not None and not fresh and not any(
                    r.get("phase") == "rl" and r.get("step") == restore.get("step") for r in kept):
                kept.append(dict(restore, phase="rl", restored_from_checkpoint=1.0))
            self._guarded(self.path, lambda: wd.write_bytes(self.path, "".join(
                json.dumps(r) + "\n" for r in kept).encode()))
        self._file = self._guarded(self.path, lambda: open(self.path, "a"))
        self._tb = None
        if tensorboard:
            tb_dir = os.path.join(local_dir, "tensorboard")
            self._tb = self._guarded(tb_dir, lambda: _TensorBoardScalars(tb_dir))
        self._upload()

    @staticmethod
    def _guarded(path: str, fn):
        """``fn()``, an OSError raised as `pdm_jax.workdir.RunWriteError` naming `path` and the error (ENOSPC...)."""
        with wd.naming_write_errors(path):
            return fn()

    def _upload(self) -> None:
        """Bucket workdir: uploads the staged metrics.jsonl and TensorBoard event files whole."""
        if not self._remote:
            return
        self._file.flush()
        wd.upload_file(self.path, wd.join(self._remote, "metrics.jsonl"))
        if self._tb is not None:
            tb_dir = os.path.join(self._staging, "tensorboard")
            for name in sorted(os.listdir(tb_dir)):
                wd.upload_file(os.path.join(tb_dir, name), wd.join(self._remote, "tensorboard", name))

    def write(self, step: int, phase: str, metrics: Mapping[str, object]) -> dict:
        """Writes one record {step, phase, **metrics}; returns the record written."""
        rec = {"step": int(step), "phase": phase}
        for k, v in metrics.items():
            f = _to_float(v)
            rec[k] = None if f is None or not math.isfinite(f) else f
        line = json.dumps(rec) + "\n"
        self._guarded(self.path, lambda: (self._file.write(line), self._file.flush()))
        scalars = {k: v for k, v in rec.items() if k not in ("step", "phase") and v is not None}
        if self._tb is not None:
            self._guarded(os.path.join(os.path.dirname(self.path), "tensorboard"),
                          lambda: self._tb.add(phase, step, scalars))
        self._upload()
        if self._wandb is not None:
            self._wandb.log(phase, step, scalars)
        return rec

    def log_run_end(self, summary: Mapping, curves_png: str | None = None) -> None:
        """Hands the run's summary and curves.png to the W&B sink (a no-op without one)."""
        if self._wandb is not None:
            self._wandb.log_run_end(summary, curves_png)

    def close(self):
        """Flushes and closes the sinks (bucket workdir: uploads them a last time, removes the staging directory).

        Every sink is closed even when one fails; then the first failure is raised as `pdm_jax.workdir.RunWriteError`
        naming its file (a full disk, a file made read-only).
        """
        tb_dir = os.path.join(os.path.dirname(self.path), "tensorboard")
        steps = [(self.path, self._upload), (self.path, self._file.close)]
        if self._tb is not None:
            steps.append((tb_dir, self._tb.close))
        if self._wandb is not None:  # never raises: a W&B failure is a WandbLoggingWarning
            self._wandb.close()
        first = None
        for path, step in steps:
            try:
                self._guarded(path, step)
            except wd.RunWriteError as e:
                first = first or e
        if first is not None:
            if self._remote:
                shutil.rmtree(self._staging, ignore_errors=True)
            raise first
        if self._remote:
            if self._tb is not None:  # the events the close flushed
                tb_dir = os.path.join(self._staging, "tensorboard")
                for name in sorted(os.listdir(tb_dir)):
                    wd.upload_file(os.path.join(tb_dir, name), wd.join(self._remote, "tensorboard", name))
            shutil.rmtree(self._staging, ignore_errors=True)


def read_summary(path: str) -> dict | None:
    """The ``summary.json`` of a finished run, or None when it is missing or unreadable (torn: it is then written
    again from the metrics file, which holds everything it says; a warning names the file)."""
    if not wd.exists(path):
        return None
    try:
        if not wd.is_remote(path) and not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read
            raise ValueError("not a regular file")
        summary = json.loads(wd.read_bytes(path))
    except (ValueError, RecursionError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep, a directory
        log.warning("%s is unreadable (%s); it is written again from the metrics", path, type(e).__name__
                    if isinstance(e, RecursionError) else e)
        return None
    return summary if isinstance(summary, dict) else None


def read_metrics(path: str) -> list[dict]:
    """Reads a metrics.jsonl file into a list of dicts, skipping a line that is not a JSON object.

    A torn last line (a crash in the middle of a write) is skipped quietly; any other such line (a damaged file:
    bytes that are not UTF-8 or not JSON) is skipped with a warning naming the file and its line numbers.
    """
    out, bad, last = [], [], 0
    with open(path, encoding="utf-8", errors="replace") as f:  # a damaged byte: a line that does not parse
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            last = number
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(number)
                continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                bad.append(number)
    damaged = [n for n in bad if n != last]
    if damaged:
        log.warning("%s: %d damaged line(s) skipped (not a JSON object), line(s) %s", path, len(damaged),
                    ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else ""))
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def sampler_weights_format(sampler) -> str:
    """The rollout weights' format as logs and ``summary.json`` name it: ``sampler.quantization`` for the native
    sampler; for ``sampler.backend = "vllm"`` the vLLM server's own (it loads the exported bf16 checkpoint and
    applies its own quantization flags: ``sampler.quantization`` does not apply). ``sampler``: the run's
    `pdm_jax.rollouts.spec.SamplerSpec`."""
    if sampler.backend == "vllm":
        return "vllm-managed"
    return sampler.quantization


def run_summary(records: Iterable[dict], *, spec, meta: Mapping, last_eval: Mapping, wall_seconds: float) -> dict:
    """The dict written to ``WORKDIR/summary.json`` at the end of a run.

    Args:
      records: the run's metrics.jsonl records (`read_metrics`; each step once, resumes included).
      spec: the run's `pdm_jax.run_spec.RunSpec` (reads ``sft``, ``eval``, ``sampler`` and the written config's
        ``trust_region`` section, ``record.tree``).
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
    sampler_weight_noise        relative std of the sampler copy's fixed perturbation (``sampler.weight_noise``;
                                0 = none)
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
        sft_steps=spec.sft.steps,
        wall_seconds=float(wall_seconds),
        eval_prompts=spec.eval.num_prompts,
        eval_samples_per_prompt=spec.eval.samples_per_prompt,
        trust_region=dict(spec.record.tree["trust_region"]),
        sampler_quantization=sampler_weights_format(spec.sampler),
        sampler_weight_noise=spec.sampler.weight_noise,
        checkpoint_fallbacks=len(meta.get("checkpoint_fallbacks", [])),
    )


def _trailing_mean(values, window: int) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start), ``[N]`` f64; window >= 1."""
    ys = np.asarray(values, np.float64)
    c = np.concatenate([[0.0], np.cumsum(ys)])
    idx = np.arange(1, ys.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def curves_title(trust_region) -> str:
    """The run's trust region in words for the curves' title: mask, divergence, δ (by sign of Â) and estimator.

    `trust_region` is the run's `pdm_jax.rl.trust_region.TrustRegionConfig` (``RunSpec.trust_region``); e.g.
    ``"mask pdm (top-K KL, δ = 0.05, estimator bucket_exact)"``, ``"mask pdm (top-K KL, δ = 0.05,
    direction param_jvp)"``, ``"mask ppo (ε = 0.2/0.28)"``, ``"mask none"``.
    """
    t = trust_region
    if t.mask == "none":
        return "mask none"
    if t.mask == "ppo":
        return f"mask ppo (ε = {t.clip_eps_low:g}/{t.clip_eps_high:g})"
    div = "top-K KL" if t.divergence == "topk_kl" else t.divergence
    if t.delta_low is None and t.delta_high is None:
        delta = f"δ = {t.delta:g}"
    else:
        lo = t.delta if t.delta_low is None else t.delta_low
        hi = t.delta if t.delta_high is None else t.delta_high
        delta = f"δ = {lo:g} (Â < 0) / {hi:g} (Â > 0)"
    est = f", estimator {t.estimator}" if t.mask == "pdm" else ""
    if t.direction != "per_token":  # param_jvp: the estimator is unused
        est = f", direction {t.direction}"
    return f"mask {t.mask} ({div}, {delta}{est})"


def _delta_lines(spec) -> list:
    """[(radius, label)] of the trust region on the divergence panel; [] for masks without a radius."""
    if spec is None or spec.trust_region.mask not in ("dppo", "pdm"):
        return []
    t = spec.trust_region
    lo = t.delta if t.delta_low is None else t.delta_low
    hi = t.delta if t.delta_high is None else t.delta_high
    return [(lo, f"δ = {lo:g}")] if lo == hi else [(lo, f"δ (Â < 0) = {lo:g}"), (hi, f"δ (Â > 0) = {hi:g}")]


def curves_figure(records: Iterable[dict], spec=None):
    """The ``curves.png`` figure of a run: a matplotlib Figure with four panels against RL step.

    Panels: (1) mean reward per RL step, raw (faint) and a trailing mean;
    (2) held-out accuracy, avg@k (k = ``eval.samples_per_prompt``) beside
    greedy (τ = 0), step 0 = the warm start; (3) fraction of valid completion
    tokens the mask drops; (4) the mask's divergence (mean top-K KL, and
    ``mean_divergence`` when the mask uses another one), log scale, with the
    radius δ as a dashed line (dppo/pdm). The title names the run's mask, δ and
    estimator (`curves_title`).

    Args:
      records: metrics.jsonl records (`read_metrics`); only ``phase`` rl/eval are used.
      spec: the run's `pdm_jax.run_spec.RunSpec` (reads ``eval.samples_per_prompt`` and ``trust_region``), or None
        (no δ line, k unnamed, no title).

    Returns:
      The Figure (the caller saves and closes it).
    """
    import matplotlib  # heavy (~1 s); only when curves are drawn (Agg backend set first)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy (~1 s); only when a figure is drawn (Agg backend set first)

    recs = [r for r in records if r.get("phase") in ("rl", "eval")]

    def series(key, phase):
        pts = sorted((r["step"], r[key]) for r in recs if r.get("phase") == phase and r.get(key) is not None)
        return (list(zip(*pts)) if pts else ([], []))

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    ax = axes[0]
    xs, ys = series("reward", "rl")
    if xs:
        window = max(1, min(20, len(xs) // 8))
        ax.plot(xs, ys, color="C0", alpha=0.3, lw=1, label="per step")
        ax.plot(xs, _trailing_mean(ys, window), color="C0", lw=2, label=f"mean of last {window}")
        ax.legend(fontsize=7)
    ax.set_title("mean reward (training rollouts)")
    ax = axes[1]
    k = spec.eval.samples_per_prompt if spec is not None else None
    for key, label, style in (("eval_accuracy", f"avg@{k}" if k else "avg@k", "o-"),
                              ("eval_greedy_accuracy", "greedy (τ = 0)", "s--")):
        xs, ys = series(key, "eval")
        if xs:
            ax.plot(xs, ys, style, lw=1.2, ms=4, label=label)
    if ax.lines:
        ax.legend(fontsize=7)
    ax.set_title("held-out accuracy")
    ax = axes[2]
    xs, ys = series("frac_masked", "rl")
    if xs:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, lw=1)
    ax.set_title("fraction of tokens masked")
    ax = axes[3]
    div = spec.trust_region.divergence if spec is not None else "topk_kl"
    curves = [("mean_topk_kl", "mean top-K KL(μ‖π)")]
    if div != "topk_kl":
        curves.append(("mean_divergence", f"mean {div}"))
    for key, label in curves:
        xs, ys = series(key, "rl")
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, lw=1, label=label)
    lines = _delta_lines(spec)
    for i, (radius, label) in enumerate(lines):
        ax.axhline(radius, color="C3", ls="--" if i == 0 else ":", lw=1.2,
                   label=label + ("" if div == "topk_kl" else f" ({div})"))
    values = [y for ln in ax.lines for y in ln.get_ydata() if y is not None]
    if values and min(values) > 0:
        ax.set_yscale("log")
    if ax.lines:
        ax.legend(fontsize=7)
    ax.set_title("divergence from the behaviour policy")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    if spec is not None:
        fig.suptitle(curves_title(spec.trust_region), fontsize=10)
    fig.tight_layout()
    return fig


def plot_curves(records: Iterable[dict], out_png: str, spec=None) -> None:
    """Writes `curves_figure` (reward, accuracy avg@k and greedy, masked fraction, divergence with δ) to `out_png`.

    Args:
      records: metrics.jsonl records; spec: the run's `pdm_jax.run_spec.RunSpec` (or None: no δ line or title).
      out_png: a local path or a URL (``gs://...``: one single-object upload).
    """
    fig = curves_figure(records, spec)
    import matplotlib.pyplot as plt  # heavy (~1 s); after curves_figure has selected the Agg backend

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    wd.write_bytes(out_png, buf.getvalue())  # whole or not at all; a full disk: RunWriteError naming the file


def rl_step_record(step_metrics: list, rows: Mapping, *, learning_rate: float, version: int, gen_seconds: float,
                   sampler_restarts: int, sampler_stalls: int) -> dict:
    """The ``rl`` record of one RL step (docs/metrics.md): the optimizer steps' metrics averaged, then the rollouts'.

    Args:
      step_metrics: one dict of scalar metrics per optimizer step of the RL step (their keys all alike).
      rows: the step's rows, all N of them: ``rewards`` [N] float, completion ``length`` [N] int (tokens),
        ``weights_version`` [N] int, and with ``reward.functions`` the per-function values
        (`pdm_jax.rewards.function_record`).
      learning_rate: the learning rate of the step's last optimizer step.
      version: the weights version the step produced (its rollouts' lag is ``version - 1 - weights_version``).
      gen_seconds: seconds the sampler took to generate the rows.
      sampler_restarts, sampler_stalls: the run's counts so far.
    """
    rec = {k: float(np.mean([float(m[k]) for m in step_metrics])) for k in step_metrics[0]}
    rewards = rows["rewards"]
    rec.update(function_record(rows),  # reward.functions: reward/NAME, reward_unscored
               reward=float(rewards.mean()),
               accuracy=float((rewards >= evaluation.CORRECT_SCORE).mean()),
               response_length=float(rows["length"].mean()),
               frac_masked_first_minibatch=float(step_metrics[0]["frac_masked"]),
               learning_rate=float(learning_rate),
               sampler_tokens_per_second=int(rows["length"].sum()) / max(gen_seconds, 1e-9),
               staleness=float(np.mean(version - 1 - rows["weights_version"])),
               sampler_restarts=float(sampler_restarts),
               sampler_stalls=float(sampler_stalls))
    return rec
