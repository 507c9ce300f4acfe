"""Run the token-level analysis over many seeds in ONE process and save per-seed results.

Each seed is a short run of the tiny task (`configs/tiny.py` with `DEFAULT_ARG`'s overrides: a warm start, then tens
of GRPO steps with a real off-policy gap) with an `AlignmentCallback`, in-process sampler, and a persistent
compilation cache shared across seeds. ``<out>/seeds/seed_XXX.npz`` holds the recorded tokens and ``seed_XXX.json``
the per-step statistics, fidelity counts, summary and timing; `pdm_jax.analysis.report` turns them into the report."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from typing import Callable, Optional, Sequence

import numpy as np

log = logging.getLogger("pdm_jax.analysis")

#: Overrides of configs/tiny.py for the default analysis: delta 0.005, as with fp8 rollouts and lr 1e-4 few tokens
#: leave the default 0.05 region within one rollout batch, and the analysis needs tokens outside.
DEFAULT_ARG = ",".join([
    "delta=0.005",
    "sft.steps=150", "sft.batch_size=64", "sft.warmup_steps=20",
    "steps=12", "rl.prompts_per_step=16", "rl.group_size=8",
    "rl.num_minibatches=4", "rl.num_iterations=2", "staleness=1",
    "quantization=fp8",
    "eval.num_prompts=32", "eval.samples_per_prompt=2", "eval.greedy=False", "eval.every_steps=1000",
    "checkpoint.every_steps=1000", "log.tensorboard=False", "log.progress=False",
    "sampler.mode=in_process",
    "model.num_hidden_layers=3", "sft.target_token_accuracy=0.0",  # the tiny model the analyses were made with
])


#: Overrides of configs/tiny_stress.py (the stress testbed's levers kept): the first 6 RL steps (96 optimizer steps, as
#: the tiny analysis) and 64 evaluation prompts. Meant with ``--warmstart`` (the comparison's shared warm start).
STRESS_ARG = ",".join([
    "steps=6",
    "eval.num_prompts=64", "eval.samples_per_prompt=4", "eval.greedy=False", "eval.every_steps=1000",
    "checkpoint.every_steps=1000", "log.tensorboard=False", "log.progress=False",
    "sampler.mode=in_process",
])

#: Overrides of configs/tiny_bpe.py (V = 1,024, K = 20): rollouts at their own temperature tau_s = 1.6, where the two
#: direction tests disagree on 5-6% of tokens (reports/bpe_pilot); 96 optimizer steps per seed. Meant with
#: ``--warmstart``.
BPE_ARG = ",".join([
    "steps=12", "rl.prompts_per_step=16", "rl.group_size=8", "rl.num_minibatches=4", "rl.num_iterations=2",
    "eval.num_prompts=32", "eval.samples_per_prompt=2", "eval.greedy=False", "eval.every_steps=1000",
    "checkpoint.every_steps=1000", "log.tensorboard=False", "log.progress=False",
    "sampler.mode=in_process", "sampler.temperature=1.6",
])

#: Overrides of configs/tiny_between.py: BPE_ARG's schedule, rollouts from a copy perturbed by ``sampler.weight_noise``
#: 0.45 (reports/between_pilot). Meant with ``--warmstart``.
BETWEEN_ARG = ",".join([item for item in BPE_ARG.split(",") if not item.startswith("sampler.temperature=")]
                       + ["sampler.weight_noise=0.45"])

#: Overrides of configs/tiny_between.py on the PDM / DPPO comparison's lever (`launch/sweeps/between_testbed.py`):
#: the first 9 RL steps of its aggregated_tail run at delta 0.05 (rollouts up to 8 versions stale, tau_s = 1.15, lr
#: 3e-4). Meant with ``--warmstart`` (the comparison's shared warm start).
BETWEEN_COMPARISON_ARG = ",".join([
    "steps=9", "rl.max_staleness=8", "rl.num_iterations=4", "rl.learning_rate=3e-4", "sampler.temperature=1.15",
    "delta=0.05", "mask=pdm", "estimator=aggregated_tail",
    "eval.num_prompts=32", "eval.samples_per_prompt=2", "eval.greedy=False", "eval.every_steps=1000",
    "checkpoint.every_steps=1000", "log.tensorboard=False", "log.progress=False", "sampler.mode=in_process",
])

#: Named analysis settings: ``--setting=NAME`` -> (config file, argument string).
SETTINGS = {"tiny": ("configs/tiny.py", DEFAULT_ARG), "stress": ("configs/tiny_stress.py", STRESS_ARG),
            "bpe": ("configs/tiny_bpe.py", BPE_ARG), "between": ("configs/tiny_between.py", BETWEEN_ARG),
            "between_comparison": ("configs/tiny_between.py", BETWEEN_COMPARISON_ARG)}

#: Files of a warm-start workdir not copied into a seed's workdir (the sweep runner's list).
_WARMSTART_SKIP = ("summary.json", "curves.png", "train.log", "tensorboard", "sweep_run.json")


def enable_compile_cache(path: str) -> None:
    """Turns on JAX's persistent compilation cache at `path` (`pdm_jax.profiling.enable_compile_cache`: every entry
    cached, however fast to compile; a file lock shared with the seeds' other processes)."""
    from pdm_jax.profiling import enable_compile_cache as enable  # lazy: this module also reads seeds without JAX

    enable(os.path.abspath(path))


def run_seed(spec, workdir: str, *, isolated_tokens: int = 8, isolated_step: float = 1e-2, full_mu: bool = True,
             param_direction: bool = True, keep_workdir: bool = False, warmstart: Optional[str] = None) -> dict:
    """One run with an `AlignmentCallback`; returns ``{"records", "steps", "fidelity", "summary", "seconds"}``.

    Args:
      spec: the run's `pdm_jax.run_spec.RunSpec` (its ``seed`` selects the seed).
      workdir: a fresh run directory (removed first, and after the run unless `keep_workdir`).
      isolated_tokens, isolated_step, full_mu, param_direction: see `AlignmentCallback`.
      warmstart: a finished warm-start workdir of the same config (``rl.steps=0``) copied in first, so only the RL
        phase varies with the seed; ValueError if it holds no ``summary.json``."""
    # lazy: JAX, the model and the training loop are only needed to run new seeds, not to read saved ones
    from pdm_jax.analysis.callback import AlignmentCallback
    from pdm_jax.train import run as run_training

    shutil.rmtree(workdir, ignore_errors=True)
    if warmstart:
        if not os.path.exists(os.path.join(warmstart, "summary.json")):
            raise ValueError(f"warmstart={warmstart!r}: not a finished warm-start workdir (no summary.json)")
        shutil.copytree(warmstart, workdir, ignore=shutil.ignore_patterns(*_WARMSTART_SKIP))
    cb = AlignmentCallback(full_mu=full_mu, isolated_tokens=isolated_tokens, isolated_step=isolated_step,
                           seed=int(spec.seed), param_direction=param_direction)
    t0 = time.time()
    summary = run_training(spec, workdir, callbacks=[cb])
    seconds = time.time() - t0
    if not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return dict(records=cb.token_records(), steps=cb.steps, fidelity=cb.fidelity, summary=summary, seconds=seconds)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def save_seed(out_dir: str, seed: int, result: dict, settings: dict) -> str:
    """Writes ``seed_XXX.npz`` (token records) and ``seed_XXX.json``; returns the json path."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"seed_{seed:03d}")
    np.savez_compressed(base + ".npz", **result["records"])
    with open(base + ".json", "w") as f:
        json.dump(_jsonable(dict(seed=seed, steps=result["steps"], fidelity=result["fidelity"],
                                 summary=result["summary"], seconds=result["seconds"], settings=settings)), f)
    return base + ".json"


def load_seeds(out_dir: str) -> list:
    """Every saved seed of `out_dir` (sorted), ``{"seed", "records", "steps", "fidelity", ...}``; arrays are read whole
    (the zip's CRC-32 checks them), nothing pickled is loaded.

    Raises:
      ValueError: a seed's ``.json`` or ``.npz`` is missing, unreadable or corrupted (naming the file)."""
    out = []
    if not os.path.isdir(out_dir):
        return out
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith("seed_") and name.endswith(".json")):
            continue
        path = os.path.join(out_dir, name)
        npz = os.path.join(out_dir, name[:-5] + ".npz")
        try:
            with open(path) as f:
                meta = json.load(f)
            with np.load(npz, allow_pickle=False) as z:
                meta["records"] = {k: z[k] for k in z.files}
        except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:  # BadZipFile: "Bad CRC-32 for file ..."
            raise ValueError(f"saved seed {path} / {os.path.basename(npz)}: unreadable or corrupted "
                             f"({type(e).__name__}: {e})") from e
        out.append(meta)
    return out


def _git_commit() -> str:
    """HEAD of the checkout the package runs from ("" when not a git checkout); '+dirty' if files differ."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def _warmstart_note(warmstart: Optional[str]) -> Optional[dict]:
    """What the report says about a shared warm start: its path, accuracy, command and code version."""
    if not warmstart:
        return None
    note = dict(path=os.path.abspath(warmstart))
    for name, keys in (("summary.json", ("warmstart_accuracy", "warmstart_greedy_accuracy")),
                       ("sweep_run.json", ("command", "code_version"))):
        try:
            with open(os.path.join(warmstart, name)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        note.update({k: meta[k] for k in keys if k in meta})
    return note


def run_seeds(seeds: Sequence[int], out_dir: str, spec_of: Callable, *, config_spec: str = "configs/tiny.py",
              arg: str = DEFAULT_ARG,
              overrides: Optional[str] = None, workdir_root: Optional[str] = None, isolated_tokens: int = 8,
              isolated_step: float = 1e-2, full_mu: bool = True, param_direction: bool = True,
              compile_cache: Optional[str] = None, skip_done: bool = True, warmstart: Optional[str] = None,
              log_fn=print) -> list:
    """Runs `run_seed` per seed (skipping saved ones with `skip_done`) on ``spec_of(seed)`` (the `RunSpec` of
    ``<config_spec>`` with ``arg``, ``overrides`` and ``seed=<seed>``, built by the command line; the strings are
    saved with each seed), one shared `warmstart`; returns the json paths."""
    if compile_cache:
        enable_compile_cache(compile_cache)
    seeds_dir = os.path.join(out_dir, "seeds")
    workdir_root = workdir_root or tempfile.mkdtemp(prefix="pdm_jax_analysis_")
    paths = []
    settings = dict(config=config_spec, arg=arg, overrides=overrides or "", isolated_tokens=isolated_tokens,
                    isolated_step=isolated_step, full_mu=full_mu, param_direction=param_direction,
                    git_commit=_git_commit(), warmstart=_warmstart_note(warmstart))
    t_all = time.time()
    for i, seed in enumerate(seeds):
        path = os.path.join(seeds_dir, f"seed_{seed:03d}.json")
        if skip_done and os.path.exists(path):
            log_fn(f"seed {seed}: saved already, skipped")
            paths.append(path)
            continue
        result = run_seed(spec_of(seed), os.path.join(workdir_root, f"seed_{seed:03d}"),
                          isolated_tokens=isolated_tokens, isolated_step=isolated_step, full_mu=full_mu,
                          param_direction=param_direction, warmstart=warmstart)
        paths.append(save_seed(seeds_dir, seed, result, settings))
        n = len(result["records"].get("delta_d", []))
        log_fn(f"seed {seed} ({i + 1}/{len(seeds)}): {result['seconds']:.0f}s, {n} tokens outside the region "
               f"(A != 0), warm start {result['summary'].get('warmstart_accuracy')}, "
               f"final {result['summary'].get('final_accuracy')}; total {time.time() - t_all:.0f}s")
    shutil.rmtree(workdir_root, ignore_errors=True)
    return paths
