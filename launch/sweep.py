#!/usr/bin/env python
"""Sweep runner: expand a sweep definition, run it (locally or on a TPU pod), aggregate a table.

A sweep definition is a Python file with ``get_sweep(arg=None) -> dict``
(big_vision style; ``launch/sweeps/tiny_delta_estimator.py`` is the example)::

    dict(
      config="configs/tiny.py",          # the config file every run uses
      fixed="sft.steps=300,steps=60",    # argument string shared by every run
      axes=[                             # the grid: product of the axes, last axis fastest
        ("delta", [0.05, 0.15]),
        ("criterion", ["ratio", "pdm_aggregated_tail", "pdm_bucket_exact"]),
        ("seed", [0, 1, 2]),
      ],
      flags={"sampler.mode": "in_process"},  # optional --config.<field>=<value> flags
      collapse_margin=0.1,               # optional; see `collapse_events`
      share_warmstart_by=("seed",),      # optional; see `run_local` (() = one warm start for all runs)
      keep=lambda point: True,           # optional; grid points for which it is False are left out
      paired_baseline=("criterion", "ratio"),  # optional; per-seed differences against this arm in the table
      paired_change=("delta", 0.05),     # optional; each arm's per-seed change from this value of another axis
      step_means=dict(metrics=["mean_topk_kl"], steps=[1, 2, 4, 8]),  # optional; `step_means` table
    )

Axis values become ``key=value`` items of the config argument string
(``configs/tiny.py:<fixed>,delta=0.05,mask=dppo,seed=0``), read by
``pdm_jax.config.apply_arg``; the ``criterion`` axis is a shorthand that
expands to the mask and estimator (`CRITERIA`).

Usage::

    python launch/sweep.py --sweep=launch/sweeps/tiny_delta_estimator.py --out=runs/sweep      # run + table
    python launch/sweep.py --sweep=... --out=... --print_only                                   # local commands
    python launch/sweep.py --sweep=... --out=gs://b/sweep --print_only --pod --tpu_name=pdm-v4  # pod commands
    python launch/sweep.py --sweep=... --out=runs/sweep --aggregate_only                        # table only

Runs are sequential and resumable: a run whose workdir holds ``summary.json``
is skipped, an interrupted one is resumed by the trainer from its workdir.
A sweep longer than one machine's life goes on across machines with
``--records=DIR`` (a committed directory): each finished run's summary and
metrics are saved there (`save_record`, tens of kB per run) and restored, not
rerun, on the next machine (`restore_records`); ``--only`` runs a subset of the
grid from the whole sweep's warm start.
Child processes share a persistent XLA compilation cache (``--compile_cache``),
so runs with the same shapes compile once.

The table (``<out>/sweep_runs.csv``, ``<out>/sweep_table.md``) has one row per
run and one row per grid point without the seed axis (mean and 95% t-interval
over seeds) with: warm-start and final held-out accuracy, their difference,
the reward-curve area (mean training reward over RL steps, i.e. the area under
the reward curve divided by the number of steps), the mean masked and outside
fractions, and collapse events (`collapse_events`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from typing import Iterable, Optional

import numpy as np

from pdm_jax.rl import trust_region as tr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _criterion_items(criterion: str) -> str:
    """``key=value`` config-argument items selecting a `pdm_jax.rl.trust_region.DIRECTION_CRITERIA` name."""
    return ",".join(f"{k}={v}" for k, v in tr.criterion_settings(criterion).items())


#: The ``criterion`` axis -> config-argument items: the trust-region direction criteria (``ratio`` = DPPO;
#: ``pdm_<estimator>`` = PDM with that estimator; `pdm_jax.rl.trust_region.criterion_settings`), then the masks
#: without a divergence direction test: ``ppo`` (ratio clip 1 ± 0.2), ``ppo_clip_higher`` (GRPO with DAPO's
#: clip-higher, r in [0.8, 1.28]; arXiv 2503.14476 eq. 10) and ``none`` (truncated IS, no mask); and
#: ``pdm_param_jvp``: PDM with the parameter-space direction Ḋᵖ along the unmasked update (issue 16).
CRITERIA = {
    **{(c if c == "ratio" else f"pdm_{c}"): _criterion_items(c) for c in tr.DIRECTION_CRITERIA},
    "ppo": "mask=ppo",
    "ppo_clip_higher": "mask=ppo,trust_region.clip_eps_low=0.2,trust_region.clip_eps_high=0.28",
    "none": "mask=none",
    "pdm_param_jvp": "mask=pdm,direction=param_jvp",
}

#: Columns of the per-run table, in order.
RUN_COLUMNS = ("name", "warmstart_accuracy", "final_accuracy", "accuracy_gain", "final_greedy_accuracy",
               "reward_area", "reward_rise", "mean_frac_masked", "mean_frac_outside", "mean_frac_direction_disagree",
               "mean_topk_kl", "collapse_events", "collapsed", "eval_points", "steps", "wall_seconds")
#: Metrics summarised over seeds in the grouped table (``collapsed`` is 0/1 per run: its mean is the collapse rate).
GROUP_METRICS = ("final_accuracy", "accuracy_gain", "reward_area", "reward_rise", "mean_frac_masked",
                 "mean_frac_outside", "mean_frac_direction_disagree", "mean_topk_kl", "collapse_events", "collapsed")
#: ``reward_rise``: the mean training reward of a run's last this many RL steps minus that of its first (half the
#: steps each for runs shorter than twice this).
REWARD_WINDOW = 20
#: Metrics of the paired (same seed) differences against a baseline arm.
PAIRED_METRICS = ("final_accuracy", "accuracy_gain", "reward_area")
#: The paired table's power column: two-sided paired t-test at this level, this power.
POWER_ALPHA, POWER_TARGET = 0.05, 0.8
#: `seeds_for_power` searches up to this many seeds (beyond: it returns this + 1, printed as "> cap").
POWER_MAX_SEEDS = 10_000


# ----------------------------------------------------------------------------- definitions
def load_sweep(path: str, arg: Optional[str] = None) -> dict:
    """Loads a sweep definition file and returns its validated dict.

    Raises:
      ValueError: the file has no ``get_sweep``, or a field is missing/malformed
        (names the field), or a ``criterion`` value is not in `CRITERIA`.
      FileNotFoundError: no such file.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"sweep definition {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("_sweep_def", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "get_sweep"):
        raise ValueError(f"sweep definition {path!r} has no get_sweep(arg) function")
    sweep = mod.get_sweep(arg) if arg is not None else mod.get_sweep()
    return validate_sweep(sweep)


def validate_sweep(sweep: dict) -> dict:
    """Checks the fields of a sweep dict (see module docstring); returns it with defaults filled in."""
    if not isinstance(sweep, dict):
        raise ValueError(f"a sweep definition must be a dict, got {type(sweep).__name__}")
    if not isinstance(sweep.get("config"), str) or not sweep["config"]:
        raise ValueError(f"sweep.config must be a config file path, got {sweep.get('config')!r}")
    axes = sweep.get("axes")
    if not isinstance(axes, (list, tuple)) or not axes:
        raise ValueError(f"sweep.axes must be a non-empty list of (key, values), got {axes!r}")
    values: dict = {}  # axis -> its values
    for item in axes:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], (list, tuple)) and len(item[1]) > 0):
            raise ValueError(f"sweep.axes item {item!r} must be (key, non-empty list of values)")
        if item[0] in values:
            raise ValueError(f"sweep.axes: axis {item[0]!r} appears twice")
        values[item[0]] = list(item[1])
        for v in item[1]:
            if any(c in str(v) for c in ",=/" + os.sep):  # '/': the run name is a directory name
                raise ValueError(f"sweep.axes {item[0]!r}: value {v!r} may not contain ',', '=' or '/'")
            if item[0] == "criterion" and v not in CRITERIA:
                raise ValueError(f"sweep.axes criterion: {v!r} is not one of {sorted(CRITERIA)}")
    out = dict(sweep)
    out.setdefault("fixed", "")
    out.setdefault("flags", {})
    out.setdefault("collapse_margin", 0.1)
    out.setdefault("share_warmstart_by", None)
    out.setdefault("keep", None)
    for field in ("paired_baseline", "paired_change"):
        out.setdefault(field, None)
        pb = out[field]
        if pb is None:
            continue
        if not (isinstance(pb, (list, tuple)) and len(pb) == 2 and isinstance(pb[0], str) and pb[0] in values
                and pb[0] != "seed"):
            raise ValueError(f"sweep.{field} must be None or (axis, value) with an axis of {sorted(values)} other "
                             f"than the seed, got {pb!r}")
        if pb[1] not in values[pb[0]]:
            raise ValueError(f"sweep.{field} {pb!r}: {pb[1]!r} is not one of the {pb[0]} axis's values "
                             f"{values[pb[0]]}")
    if (out["paired_change"] is not None and out["paired_baseline"] is not None
            and out["paired_change"][0] == out["paired_baseline"][0]):
        raise ValueError(f"sweep.paired_change must name another axis than paired_baseline's "
                         f"{out['paired_baseline'][0]!r}, got {out['paired_change']!r}")
    out.setdefault("step_means", None)
    sm = out["step_means"]
    if sm is not None and not (
            isinstance(sm, dict) and set(sm) == {"metrics", "steps"}
            and isinstance(sm["metrics"], (list, tuple)) and sm["metrics"]
            and all(isinstance(m, str) and m for m in sm["metrics"])
            and isinstance(sm["steps"], (list, tuple)) and sm["steps"]
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in sm["steps"])):
        raise ValueError("sweep.step_means must be None or dict(metrics=[metric names], steps=[RL steps >= 1]), "
                         f"got {sm!r}")
    if out["keep"] is not None and not callable(out["keep"]):
        raise ValueError(f"sweep.keep must be None or a function point -> bool, got {out['keep']!r}")
    if out["share_warmstart_by"] is not None:
        bad = [k for k in out["share_warmstart_by"] if k not in values]
        if bad:
            raise ValueError(f"sweep.share_warmstart_by names {bad}, which are not axes {sorted(values)}")
    if not isinstance(out["flags"], dict):
        raise ValueError(f"sweep.flags must be a dict of --config.<field> overrides, got {out['flags']!r}")
    return out


def _fmt(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def expand(sweep: dict) -> list[dict]:
    """The grid points of a sweep, in order (last axis fastest), without the points its ``keep`` refuses.

    Returns a list of dicts ``{name, point, arg, config_arg, flags}``: ``point``
    maps axis key -> value, ``arg`` is the argument string after the config
    path (fixed items first, then the axes; ``criterion`` expanded via
    `CRITERIA`), ``config_arg`` = ``"<config>:<arg>"``, ``name`` a filesystem-safe
    run name like ``delta=0.05_criterion=ratio_seed=0``.
    """
    sweep = validate_sweep(sweep)
    keys = [k for k, _ in sweep["axes"]]
    runs = []
    for values in itertools.product(*[v for _, v in sweep["axes"]]):
        point = dict(zip(keys, values))
        if sweep["keep"] is not None and not sweep["keep"](dict(point)):
            continue
        items = [s for s in sweep["fixed"].split(",") if s.strip()]
        for k, v in point.items():
            items.append(CRITERIA[v] if k == "criterion" else f"{k}={_fmt(v)}")
        arg = ",".join(items)
        name = "_".join(f"{k}={_fmt(v)}" for k, v in point.items())
        runs.append(dict(name=name, point=point, arg=arg, config_arg=f"{sweep['config']}:{arg}",
                         flags=dict(sweep["flags"])))
    return runs


def train_command(run: dict, workdir: str, python: str = "python") -> list[str]:
    """argv of ``python -m pdm_jax.train`` for one grid point."""
    cmd = [python, "-m", "pdm_jax.train", f"--config={run['config_arg']}", f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in run["flags"].items()]
    return cmd


#: A pod run's workdir on its hosts when the sweep's --out is local (not resumable once its VMs are gone).
POD_LOCAL_WORKDIR = "/tmp/pdm_run"


def pod_command(run: dict, index: int, out: str, *, tpu_name: str, project: str, zone: str, accelerator: str
                ) -> list[str]:
    """argv of ``launch/tpu_pod.sh`` running grid point number `index` on its own TPU VM pod ``<tpu_name>-<index>``.

    With a bucket `out` (``gs://...``) the run's workdir is ``<out>/<run name>`` in the bucket: every host writes
    its checkpoint shards there, so rerunning the command after a preemption resumes it, and the sweep's
    ``--aggregate_only`` reads a local copy of the bucket. Otherwise the workdir is local to the hosts
    (`POD_LOCAL_WORKDIR`) and worker 0's copy goes to ``--results=<out>/<run name>`` when the run ends.

    A sweep's ``sampler.mode`` flag (``in_process`` in the local sweeps: no sampler subprocess to start) is left out:
    on a pod the sampler runs colocated (``launch/tpu_pod.sh``'s ``--config.sampler.mode=colocated``), the one mode
    a bucket workdir allows."""
    if out.startswith("gs://") and not out[len("gs://"):].strip("/"):
        raise ValueError(f"--out={out!r}: a bucket --out needs a bucket name, gs://BUCKET[/PREFIX]")
    run_dir = f"{out.rstrip('/')}/{run['name']}"
    where = [f"--workdir={run_dir}"] if out.startswith("gs://") else [f"--workdir={POD_LOCAL_WORKDIR}",
                                                                       f"--results={run_dir}"]
    cmd = ["launch/tpu_pod.sh", f"--name={tpu_name}-{index:03d}",
           f"--project={project}", f"--zone={zone}", f"--accelerator={accelerator}",
           f"--config={run['config_arg']}", *where]
    cmd += [f"--flag=--config.{k}={v}" for k, v in run["flags"].items() if k not in POD_DROPPED_FLAGS]
    return cmd


#: A sweep's ``--config.<field>`` flags that `pod_command` leaves out (the pod's own setting stands).
POD_DROPPED_FLAGS = ("sampler.mode",)


# ----------------------------------------------------------------------------- running
def _warmstart_groups(runs: list[dict], keys: tuple) -> dict:
    groups: dict = {}
    for run in runs:
        groups.setdefault(tuple((k, run["point"].get(k)) for k in keys), []).append(run)
    return groups


def code_version(code_dir: str) -> str:
    """`git rev-parse --short HEAD` (+'+dirty') of `code_dir`, else the first line of `<code_dir>/COMMIT`, else ""."""
    try:
        head = subprocess.run(["git", "-C", code_dir, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", code_dir, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    marker = os.path.join(code_dir, "COMMIT")
    if os.path.exists(marker):
        with open(marker) as f:
            return f.readline().strip()
    return ""


def machine() -> str:
    """This host in a line: CPU model (``/proc/cpuinfo``, else `platform.processor`), core count, a digest of the
    CPU flags and the OS.

    Recorded with each run (``sweep_run.json``): XLA:CPU compiles for the host's instruction set, so runs of one
    seed made on two kinds of machine can differ in the last bits and then in their trajectory.
    """
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(ln.split(":", 1) for ln in f if ":" in ln)
        info = {k.strip(): v.strip() for k, v in info.items()}
        model = info.get("model name", model)
        if info.get("flags"):  # virtual machines often report a generic model name: the flags tell them apart
            flags = ", CPU flags " + hashlib.sha1(" ".join(sorted(info["flags"].split())).encode()).hexdigest()[:8]
    except (OSError, ValueError):
        pass
    return f"{model}, {os.cpu_count()} cores{flags}, {platform.system()} {platform.release()}"


def _run_one(cmd: list[str], workdir: str, env: dict, timeout_s: Optional[float], code_dir: str,
             warmstart_sha256: Optional[str] = None) -> int:
    line = dict(command=cmd, code_dir=code_dir, code_version=code_version(code_dir),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), machine=machine())
    if warmstart_sha256:  # the shared warm start the run resumes from, by content (`warmstart_digest`)
        line["warmstart_sha256"] = warmstart_sha256
    with open(os.path.join(workdir, "sweep_run.json"), "a") as f:
        f.write(json.dumps(line) + "\n")
    with open(os.path.join(workdir, "train.log"), "a") as f:
        try:
            return subprocess.run(cmd, cwd=code_dir, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return -9


def _prepare_warmstarts(runs: list[dict], grid: list[dict], keys: tuple, out: str, records: Optional[str],
                        run_one, python: str, log) -> dict:
    """Builds (or restores from `records`) the warm start of each group of `grid` that has a run in `runs`.

    Returns ``{run name: warm-start workdir}`` for every run of `grid`. See `run_local`.
    """
    names = {r["name"] for r in runs}
    warm_dirs = {}
    for key, members in _warmstart_groups(grid, keys).items():
        tag = "_".join(f"{k}={_fmt(v)}" for k, v in key) or "all"
        wd = os.path.join(out, "_warmstart", tag)
        for r in members:
            warm_dirs[r["name"]] = wd
        if not names.intersection(r["name"] for r in members):
            continue
        if os.path.exists(os.path.join(wd, "summary.json")):
            if records and not os.path.exists(_warmstart_archive(records, tag)):
                save_warmstart(wd, records, tag)
            continue
        if records and restore_warmstart(wd, records, tag):
            log(f"[warm start {tag}] restored from {records}")
            continue
        os.makedirs(wd, exist_ok=True)
        warm_run = dict(members[0], config_arg=members[0]["config_arg"] + ",rl.steps=0")
        cmd = train_command(warm_run, wd, python=python)
        log(f"[warm start {tag}] {shlex.join(cmd)}")
        t0 = time.time()
        rc = run_one(cmd, wd)
        log(f"    -> rc={rc} in {time.time() - t0:.0f}s")
        if records and rc == 0:
            save_warmstart(wd, records, tag)
    return warm_dirs


def run_local(runs: Iterable[dict], out: str, *, python: str = sys.executable, compile_cache: Optional[str] = None,
              timeout_s: Optional[float] = None, share_warmstart_by: Optional[tuple] = None,
              code_dir: str = REPO, grid: Optional[list[dict]] = None, records: Optional[str] = None,
              log=print) -> list[dict]:
    """Runs the grid points one after another (``python -m pdm_jax.train``), skipping finished ones.

    Each run's stdout/stderr go to ``<out>/<name>/train.log`` and its command
    and code version (`code_version`) to ``<out>/<name>/sweep_run.json``. The
    runs execute in `code_dir` (also prepended to PYTHONPATH): pass a pinned
    copy of the code (e.g. ``git archive``) to keep a long sweep on one
    version while the checkout moves on. Returns one dict
    per run ``{name, returncode, seconds, skipped}``; a failed run is reported
    and the sweep continues.

    share_warmstart_by: axis keys that determine the warm start (e.g.
      ``("seed",)``). Runs that agree on them share ONE supervised warm start:
      it is run once as ``rl.steps=0`` into ``<out>/_warmstart/<key>``
      (the trainer checkpoints right after the warm start and its evaluation),
      and each run starts from a copy of that workdir, which the trainer resumes
      at RL step 0 with the run's own config. This relies on the trainer's
      exact resume (same metrics as an uninterrupted run, issue 5), and is only
      valid when the other axes change nothing before the RL phase (trust
      region, RL settings). ``()``: one warm start shared by every run (the
      seed then varies only the RL phase). None: every run does its own warm start.
    grid: the whole sweep's runs when `runs` is a subset of it (``--only``): the warm-start groups and the point
      each group's warm start is run with (its first) come from `grid`, so a subset starts from the same warm
      start as the whole sweep. Default: `runs`.
    records: a directory of run records (`save_record`): a warm start archived there is restored instead of
      rebuilt, and one built here is archived there (`save_warmstart`); then the runs recorded there are
      restored (`restore_records`, which checks they share this sweep's warm start) and skipped, and each run
      finished here (or found finished) is recorded there.
    """
    out = os.path.abspath(out)  # the runs execute in code_dir
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    if compile_cache:
        os.makedirs(compile_cache, exist_ok=True)
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(compile_cache))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    code_dir = os.path.abspath(code_dir)
    if code_dir != REPO:
        env["PYTHONPATH"] = code_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    runs = list(runs)
    warm_dirs = {} if share_warmstart_by is None else _prepare_warmstarts(
        runs, runs if grid is None else list(grid), tuple(share_warmstart_by), out, records,
        lambda cmd, wd: _run_one(cmd, wd, env, timeout_s, code_dir), python, log)
    if records:
        restore_records(runs, out, records, warm_dirs, log=log)
    results, digests = [], {}
    for i, run in enumerate(runs):
        wd = os.path.join(out, run["name"])
        if os.path.exists(os.path.join(wd, "summary.json")):
            if records:
                save_record(wd, records)
            log(f"[{i + 1}/{len(runs)}] {run['name']}: done already, skipped")
            results.append(dict(name=run["name"], returncode=0, seconds=0.0, skipped=True))
            continue
        warm = warm_dirs.get(run["name"])
        if warm is not None and not os.path.exists(wd):
            if not os.path.exists(os.path.join(warm, "summary.json")):
                log(f"[{i + 1}/{len(runs)}] {run['name']}: its warm start {warm} failed; skipped")
                results.append(dict(name=run["name"], returncode=1, seconds=0.0, skipped=True))
                continue
            shutil.copytree(warm, wd, ignore=shutil.ignore_patterns("summary.json", "curves.png", "train.log",
                                                                    "tensorboard", "sweep_run.json"))
        os.makedirs(wd, exist_ok=True)
        cmd = train_command(run, wd, python=python)
        log(f"[{i + 1}/{len(runs)}] {run['name']}: {shlex.join(cmd)}")
        t0 = time.time()
        if warm is not None and warm not in digests:
            digests[warm] = warmstart_digest(warm)
        rc = _run_one(cmd, wd, env, timeout_s, code_dir, digests.get(warm))
        dt = time.time() - t0
        log(f"    -> rc={rc} in {dt:.0f}s")
        if records and rc == 0:
            save_record(wd, records)
        results.append(dict(name=run["name"], returncode=rc, seconds=dt, skipped=False))
    return results


# ----------------------------------------------------------------------------- run records
#: The files of a finished run's workdir that its record keeps: everything the tables and curves read.
RECORD_FILES = ("summary.json", "metrics.jsonl", "sweep_run.json")


def _write_atomically(dest: str, write) -> None:
    """Calls ``write(tmp_path)`` and moves the file onto `dest` only once it is complete (no half-written file)."""
    tmp = f"{dest}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_records_dir(records: str) -> None:
    """Raises ValueError if `records` exists and is not a directory (a mistyped ``--records``)."""
    if os.path.exists(records) and not os.path.isdir(records):
        raise ValueError(f"--records {records!r} is a file, not a directory of run records")


def _read_record(path: str) -> dict:
    """The ``{file name: text}`` of a record; ValueError naming `path` if it is not one (`save_record`).

    Read to gzip's trailer (its CRC-32 checks every byte: a flipped byte is refused, not read as other figures) and
    at most `MAX_RECORD_BYTES` inflated (a gzip bomb is refused before it fills memory)."""
    try:
        with gzip.open(path, "rb") as gz:
            reader, chunks = _CappedReader(gz, MAX_RECORD_BYTES, f"run record {path}"), []
            for block in iter(lambda: reader.read(1 << 20), b""):  # to gzip's trailer: its CRC-32 checks every byte
                chunks.append(block)
        files = json.loads(b"".join(chunks).decode("utf-8"))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, RecursionError, ValueError) as e:
        if str(e).startswith(f"run record {path}:"):  # inflates beyond MAX_RECORD_BYTES
            raise
        raise ValueError(f"run record {path}: not a gzip-compressed JSON record ({type(e).__name__}: {e})") from e
    if not isinstance(files, dict) or "summary.json" not in files or set(files) - set(RECORD_FILES):
        raise ValueError(f"run record {path}: expected a JSON object of {RECORD_FILES} texts with a summary.json, "
                         f"got {sorted(files) if isinstance(files, dict) else type(files).__name__}")
    bad = {k: type(v).__name__ for k, v in files.items() if not isinstance(v, str)}
    if bad:
        raise ValueError(f"run record {path}: every file must be a text, got {bad}")
    try:
        summary = json.loads(files["summary.json"])
    except json.JSONDecodeError as e:
        raise ValueError(f"run record {path}: its summary.json is not JSON ({e})") from e
    if not isinstance(summary, dict):
        raise ValueError(f"run record {path}: its summary.json is a {type(summary).__name__}, not an object")
    return files


def save_record(workdir: str, records: str) -> Optional[str]:
    """Writes a finished run's `RECORD_FILES` to ``<records>/<run name>.json.gz``; its path, None if unfinished.

    A record is a gzip-compressed JSON object ``{file name: text}`` of a few tens of kB, small enough to commit:
    a sweep longer than one machine's session (whose run directories, with their checkpoints, are not kept) goes
    on from the committed records with ``--records`` (`restore_records`). Checkpoints and logs are not kept.
    The bytes depend only on the files (no time stamp); an unchanged record is not rewritten.

    Raises:
      ValueError: `records` is a file, or a record of this run exists with other contents (a run made again, or
        from another warm start, never replaces a committed record silently: delete the record to replace it).
    """
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        return None
    check_records_dir(records)
    files = {}
    for name in RECORD_FILES:
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                files[name] = f.read()
    os.makedirs(records, exist_ok=True)
    dest = os.path.join(records, os.path.basename(os.path.normpath(workdir)) + ".json.gz")
    if os.path.exists(dest):
        old = _read_record(dest)
        if old == files:
            return dest
        differ = sorted(k for k in set(old) | set(files) if old.get(k) != files.get(k))
        raise ValueError(f"run record {dest} exists and differs from the run in {workdir} in {differ}: not "
                         f"replaced (delete the record to replace it)")

    def write(tmp):
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
            gz.write(json.dumps(files, sort_keys=True).encode("utf-8"))

    _write_atomically(dest, write)
    return dest


#: What a warm start's archive leaves out: logs, curves and the sampler's weight copies (``weights/``, which the
#: trainer writes again when a run resumes from the checkpoint).
_WARMSTART_SKIP = ("curves.png", "train.log", "tensorboard", "weights")
#: The first member of a warm-start archive: ``{"format", "files": {relative path: {"size", "sha256"}}}`` of every
#: other file in it (`save_warmstart`), checked member by member when it is restored (`restore_warmstart`).
WARMSTART_MANIFEST = ".warmstart_manifest.json"
_MANIFEST_FORMAT = "pdm_jax.warmstart/1"
#: A record inflates to at most this many bytes (records are tens to hundreds of kB; a gzip bomb is refused).
MAX_RECORD_BYTES = 64 << 20
#: A warm-start archive inflates to at most this many bytes plus `WARMSTART_INFLATION` times its own size
#: (checkpoints hold float weights, which gzip barely shrinks; a gzip bomb inflates a thousandfold).
MAX_WARMSTART_BASE_BYTES = 64 << 20
WARMSTART_INFLATION = 16


def _warmstart_archive(records: str, tag: str) -> str:
    return os.path.join(records, "_warmstart", tag + ".tar.gz")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _warmstart_files(workdir: str) -> dict:
    """``{relative path: {"size", "sha256"}}`` of the files of `workdir` a warm-start archive keeps (`save_warmstart`:
    the latest checkpoint only, no `_WARMSTART_SKIP`), in sorted order.

    Raises:
      ValueError: `workdir` holds a link or special file among them (names it).
    """
    ckpt = os.path.join(workdir, "checkpoints")
    entries = os.listdir(ckpt) if os.path.isdir(ckpt) and not os.path.islink(ckpt) else []
    steps = sorted(int(n) for n in entries if n.isascii() and n.isdigit())
    latest = str(steps[-1]) if steps else None
    skip = {os.path.join("checkpoints", n) for n in entries if n != latest and os.path.isdir(os.path.join(ckpt, n))}
    out = {}

    def walk(rel: str) -> None:
        for name in sorted(os.listdir(os.path.join(workdir, rel))):
            sub = os.path.join(rel, name) if rel else name
            if (not rel and name in _WARMSTART_SKIP) or sub in skip:
                continue
            st = os.lstat(os.path.join(workdir, sub))
            if stat.S_ISDIR(st.st_mode):
                walk(sub)
            elif stat.S_ISREG(st.st_mode):
                out[sub] = dict(size=st.st_size, sha256=_sha256_file(os.path.join(workdir, sub)))
            else:
                raise ValueError(f"warm start {workdir}: {sub} is a link or special file; not archived")

    walk("")
    return out


def warmstart_digest(workdir: str) -> str:
    """The identity of a warm start by content: the sha256 of the sorted ``relative path, sha256`` pairs of the files
    its archive keeps (`_warmstart_files`). The same for the directory a warm start was run in and for the one
    `restore_warmstart` unpacks from its archive; two warm starts of equal accuracy but other weights differ.

    Raises:
      ValueError: as `_warmstart_files`.
    """
    files = _warmstart_files(workdir)
    return hashlib.sha256("".join(f"{rel}\0{v['sha256']}\n" for rel, v in files.items()).encode()).hexdigest()


def save_warmstart(workdir: str, records: str, tag: str) -> str:
    """Archives a finished warm start as ``<records>/_warmstart/<tag>.tar.gz``; returns its path.

    Keeps the trainer's latest checkpoint only (the step the runs resume from), the tokenizer, the model and the
    run's own files; leaves out `_WARMSTART_SKIP`. The runs of a sweep carried across machines must start from one
    warm start: a second machine's supervised phase need not give the same weights (XLA:CPU compiles for the
    host's instruction set), so the archive is committed beside the run records and restored
    (`restore_warmstart`) instead of rebuilt. A few MB for the tiny configs. Written atomically. Its first
    member, `WARMSTART_MANIFEST`, holds the size and sha256 of every other file, which `restore_warmstart` checks.

    Raises:
      ValueError: `workdir` has no summary.json (an unfinished warm start) or holds a link or special file.
    """
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        raise ValueError(f"warm start {workdir}: no summary.json, so it is not finished; not archived")
    files = _warmstart_files(workdir)
    dest = _warmstart_archive(records, tag)
    check_records_dir(records)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    manifest = json.dumps(dict(format=_MANIFEST_FORMAT, files=files), sort_keys=True).encode()
    dirs = sorted({os.path.dirname(rel) for rel in files} - {""})
    dirs = sorted({os.sep.join(d.split(os.sep)[:i + 1]) for d in dirs for i in range(len(d.split(os.sep)))})

    def info_of(name: str, size: int = 0, is_dir: bool = False) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
        info.type, info.mode = (tarfile.DIRTYPE, 0o755) if is_dir else (tarfile.REGTYPE, 0o644)
        return info

    def write(tmp):
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(info_of(WARMSTART_MANIFEST, len(manifest)), io.BytesIO(manifest))
            for d in dirs:
                tar.addfile(info_of(d, is_dir=True))
            for rel, meta in files.items():
                with open(os.path.join(workdir, rel), "rb") as f:
                    tar.addfile(info_of(rel, meta["size"]), f)

    _write_atomically(dest, write)
    return dest


class _CappedReader:
    """A binary reader over `raw` that raises ValueError naming `what` once more than `cap` bytes were read."""

    def __init__(self, raw, cap: int, what: str):
        self.raw, self.cap, self.what, self.n = raw, int(cap), what, 0

    def read(self, size: int = -1) -> bytes:
        room = self.cap + 1 - self.n  # one byte past the cap tells an over-long stream from one of exactly `cap`
        data = self.raw.read(room if size is None or size < 0 else min(size, room))
        self.n += len(data)
        if self.n > self.cap:
            raise ValueError(f"{self.what}: inflates to more than {self.cap} bytes (a gzip bomb?); refused")
        return data


def _member_name(name: str, src: str) -> str:
    """Archive member `name` as a relative path (``.`` and empty parts dropped: ``./a`` is ``a``); ValueError naming
    `src` for an absolute path, a ``..`` part or a backslash (a path that could leave the directory)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or "\\" in name or "\0" in name:
        raise ValueError(f"warm-start archive {src}: member {name!r} leaves its directory; refused")
    return "/".join(parts)


def _unpack_verified(src: str, dest: str) -> None:
    """Unpacks the warm-start archive `src` into the empty directory `dest`, checking every byte (module docs of
    `restore_warmstart`). Raises ValueError naming `src`."""
    cap = MAX_WARMSTART_BASE_BYTES + WARMSTART_INFLATION * os.path.getsize(src)
    manifest, got = None, {}
    try:
        with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            reader = _CappedReader(gz, cap, f"warm-start archive {src}")
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for i, member in enumerate(tar):
                    if not (member.isfile() or member.isdir()):
                        raise ValueError(f"warm-start archive {src}: {member.name} is a link or special file; refused")
                    name = _member_name(member.name, src)
                    if member.isfile() and not name:
                        raise ValueError(f"warm-start archive {src}: member {member.name!r} names no file; refused")
                    if name in got or name == WARMSTART_MANIFEST and i:
                        raise ValueError(f"warm-start archive {src}: member {member.name!r} appears twice; refused")
                    if member.isdir():
                        os.makedirs(os.path.join(dest, *name.split("/")) if name else dest, exist_ok=True)
                        continue
                    f = tar.extractfile(member)
                    if name == WARMSTART_MANIFEST:
                        manifest = json.loads(f.read(MAX_RECORD_BYTES + 1).decode("utf-8"))
                        continue
                    path = os.path.join(dest, *name.split("/"))
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    h = hashlib.sha256()
                    with open(path, "xb") as out:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            h.update(block)
                            out.write(block)
                    got[name] = dict(size=member.size, sha256=h.hexdigest())
            while reader.read(1 << 20):  # to gzip's trailer: its CRC-32 and length check every byte read
                pass
    except ValueError as e:
        if str(e).startswith(f"warm-start archive {src}:"):
            raise
        raise ValueError(f"warm-start archive {src}: cannot be unpacked ({type(e).__name__}: {e})") from e
    except (OSError, EOFError, zlib.error, tarfile.TarError, UnicodeDecodeError) as e:
        raise ValueError(f"warm-start archive {src}: cannot be unpacked ({type(e).__name__}: {e})") from e
    if manifest is None:  # an archive written before manifests: gzip's CRC above is its check
        return
    want = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(want, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        raise ValueError(f"warm-start archive {src}: its {WARMSTART_MANIFEST} is not a {_MANIFEST_FORMAT} manifest")
    bad = sorted(set(want) ^ set(got)) + sorted(n for n in set(want) & set(got) if want[n] != got[n])
    if bad:
        raise ValueError(f"warm-start archive {src}: {len(bad)} member(s) differ from its manifest (missing, extra "
                         f"or another sha256), e.g. {bad[:3]}; refused")


def restore_warmstart(workdir: str, records: str, tag: str) -> bool:
    """Unpacks ``<records>/_warmstart/<tag>.tar.gz`` (`save_warmstart`) as `workdir`; False if there is none.

    Every byte is checked before the warm start is used: each member's sha256 and size against the archive's
    `WARMSTART_MANIFEST`, and the whole stream against gzip's CRC-32 trailer (which `tarfile` alone never reads).
    The archive is unpacked beside `workdir` and moved into place only once complete and verified, so a failure
    leaves nothing behind, neither a corrupted file nor a half warm start that a later call would take for a
    finished one. Members that are links, devices or paths leaving the directory are refused, and the archive
    inflates to at most ``MAX_WARMSTART_BASE_BYTES + WARMSTART_INFLATION x`` its size (a gzip bomb is refused).

    Raises:
      ValueError: naming the archive: it cannot be read or unpacked, a member is corrupted (its sha256 or gzip's
        CRC differs), a link or outside path, it inflates beyond the bound, or it holds no summary.json.
    """
    src = _warmstart_archive(records, tag)
    if not os.path.exists(src):
        return False
    parent = os.path.dirname(os.path.abspath(workdir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".restoring_", dir=parent)
    try:
        _unpack_verified(src, tmp)
        if not os.path.exists(os.path.join(tmp, "summary.json")):
            raise ValueError(f"warm-start archive {src}: holds no summary.json")
        if os.path.isdir(workdir) and not os.listdir(workdir):
            os.rmdir(workdir)
        os.rename(tmp, workdir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return True


def _record_warmstarts(files: dict) -> set:
    """The ``warmstart_sha256`` values (`warmstart_digest`) a record's ``sweep_run.json`` lines name."""
    out = set()
    for line in files.get("sweep_run.json", "").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("warmstart_sha256"):
            out.add(str(entry["warmstart_sha256"]))
    return out


def restore_records(runs: Iterable[dict], out: str, records: str, warmstart: Optional[dict] = None,
                    log=print) -> list[str]:
    """Unpacks ``<records>/<name>.json.gz`` into ``<out>/<name>/`` for each run without a ``summary.json`` there.

    The sweep then skips those runs and the tables read them like runs of this machine (a record's files replace
    an interrupted run's; `RECORD_FILES` the record lacks are removed). warmstart:
    ``{run name: warm-start workdir}`` (`run_local`): a record must come from that warm start, since its paired
    differences would otherwise mix two warm starts. It is identified by content: the ``warmstart_sha256``
    (`warmstart_digest`) its ``sweep_run.json`` names must be the warm start's. A record that names none (written
    by a sweep that did not record it) is checked by its ``warmstart_accuracy`` alone, and the log counts those.
    Logs how many records there are and how many were restored; returns the names restored.

    Raises:
      ValueError: `records` is a file; a record is not a JSON object of `RECORD_FILES` texts holding a
        ``summary.json`` object (`save_record`), is corrupted or inflates beyond `MAX_RECORD_BYTES` (names the
        file); it names another warm start's digest, or, naming none, its warm-start accuracy differs.
    """
    check_records_dir(records)
    runs = list(runs)
    restored, found, by_accuracy, digests = [], 0, 0, {}
    for run in runs:
        path = os.path.join(records, run["name"] + ".json.gz")
        wd = os.path.join(out, run["name"])
        if not os.path.exists(path):
            continue
        found += 1
        if os.path.exists(os.path.join(wd, "summary.json")):
            continue
        files = _read_record(path)
        warm = (warmstart or {}).get(run["name"])
        if warm is not None and os.path.exists(os.path.join(warm, "summary.json")):
            named = _record_warmstarts(files)
            if named:
                if warm not in digests:
                    digests[warm] = warmstart_digest(warm)
                if named != {digests[warm]}:
                    raise ValueError(f"run record {path}: made from the warm start with sha256 "
                                     f"{', '.join(sorted(named))}, but this sweep's warm start {warm} has "
                                     f"{digests[warm]}: the record comes from another warm start and cannot be "
                                     f"paired")
            else:
                by_accuracy += 1
                with open(os.path.join(warm, "summary.json")) as f:
                    want = json.load(f).get("warmstart_accuracy")
                got = json.loads(files["summary.json"]).get("warmstart_accuracy")
                if want is not None and got != want:
                    raise ValueError(f"run record {path}: warmstart_accuracy {got!r}, but this sweep's warm start "
                                     f"{warm} has {want!r}: the record comes from another warm start and cannot be "
                                     f"paired")
        os.makedirs(wd, exist_ok=True)
        for name in RECORD_FILES:
            target = os.path.join(wd, name)
            if name not in files:
                if os.path.exists(target):
                    os.remove(target)
                continue
            if name != "summary.json":  # summary.json last: it marks the run finished
                with open(target, "w", encoding="utf-8") as f:
                    f.write(files[name])
        with open(os.path.join(wd, "summary.json"), "w", encoding="utf-8") as f:
            f.write(files["summary.json"])
        restored.append(run["name"])
    note = (f" ({by_accuracy} name no warm-start digest: checked by their warm-start accuracy only)"
            if by_accuracy else "")
    log(f"run records in {records}: {found} of the {len(runs)} runs, {len(restored)} restored{note}")
    return restored


# ----------------------------------------------------------------------------- aggregation
_JSONL_CACHE: Optional[dict] = None  # path -> ((mtime_ns, size), records); a dict only inside `_reading_once`


@contextlib.contextmanager
def _reading_once():
    """Inside it, `_read_jsonl` parses each file once while its mtime and size stay the same (`summarize_run`,
    `step_means` and `plot_sweep` each read every run's ``metrics.jsonl``); the parsed records are dropped on exit,
    so a sweep process does not keep them (about 1 MB per 200-step run)."""
    global _JSONL_CACHE
    outer, _JSONL_CACHE = _JSONL_CACHE, ({} if _JSONL_CACHE is None else _JSONL_CACHE)
    try:
        yield
    finally:
        _JSONL_CACHE = outer


def _read_jsonl(path: str) -> list[dict]:
    """The JSON records of a ``.jsonl`` file, one per non-empty line (lines that do not parse, e.g. a line cut
    off by a kill, are skipped); [] if the file does not exist. A new list each call; the records are shared
    inside `_reading_once`, so callers must not modify them."""
    if not os.path.exists(path):
        return []
    if _JSONL_CACHE is None:
        return _parse_jsonl(path)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _JSONL_CACHE.get(path)
    if hit is None or hit[0] != stamp:
        hit = _JSONL_CACHE[path] = (stamp, _parse_jsonl(path))
    return list(hit[1])


def _parse_jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def collapse_events(eval_accuracies: list[float], warmstart: Optional[float], margin: float) -> int:
    """Number of held-out evaluations during RL whose accuracy is below ``warmstart - margin``.

    Counts each evaluation point (the final one included) separately; 0 when
    the warm-start accuracy is unknown.
    """
    if warmstart is None:
        return 0
    return int(sum(1 for a in eval_accuracies if a is not None and a < warmstart - margin))


def summarize_run(workdir: str, collapse_margin: float = 0.1) -> Optional[dict]:
    """Reads ``summary.json`` and ``metrics.jsonl`` of one run into a table row (None if unfinished).

    Fields: see `RUN_COLUMNS`. ``reward_area`` is the mean of the per-step training reward over the RL steps;
    ``reward_rise`` the mean over the last `REWARD_WINDOW` RL steps minus the mean over the first (half the steps
    each if fewer than twice the window; NaN below 2 steps); ``mean_frac_masked``/``mean_frac_outside``/
    ``mean_frac_direction_disagree``/``mean_topk_kl`` are means over RL steps (the disagreement: the share of
    valid tokens whose ratio and predictive direction tests differ, whichever mask the run applies); accuracies
    are the trainer's avg@k held-out accuracies.
    """
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        s = json.load(f)
    recs = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    rl = [r for r in recs if r.get("phase") == "rl"]
    ev = [r for r in recs if r.get("phase") == "eval" and r.get("step", 0) > 0]

    def mean_of(key):
        vals = [r[key] for r in rl if r.get(key) is not None]
        return float(sum(vals) / len(vals)) if vals else float("nan")

    rewards = [float(r["reward"]) for r in rl if r.get("reward") is not None]
    w = min(REWARD_WINDOW, len(rewards) // 2)
    # NaN, as reward_area, if any step's reward is not finite
    finite = len(_finite(rewards)) == len(rewards)
    rise = (sum(rewards[-w:]) - sum(rewards[:w])) / w if w and finite else float("nan")
    warm = s.get("warmstart_accuracy")
    final = s.get("final_accuracy")
    events = collapse_events([r.get("eval_accuracy") for r in ev], warm, collapse_margin)
    return dict(
        name=os.path.basename(os.path.normpath(workdir)),
        warmstart_accuracy=warm, final_accuracy=final,
        accuracy_gain=(final - warm) if (final is not None and warm is not None) else None,
        final_greedy_accuracy=s.get("final_greedy_accuracy"),
        reward_area=mean_of("reward"), reward_rise=float(rise), mean_frac_masked=mean_of("frac_masked"),
        mean_frac_outside=mean_of("frac_outside"), mean_frac_direction_disagree=mean_of("frac_direction_disagree"),
        mean_topk_kl=mean_of("mean_topk_kl"),
        collapse_events=events, collapsed=int(events > 0),
        eval_points=len(ev), steps=s.get("steps"), wall_seconds=s.get("wall_seconds"),
    )


def _finite(values) -> list[float]:
    """The values that are not None and finite, as floats (NaN means "not measured" in the run rows)."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval) of finite values; half-width NaN for < 2 values."""
    xs = _finite(values)
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    from scipy import stats  # heavy (~1 s; comes with jax, not a declared dependency), needed only here

    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, float(stats.t.ppf(0.975, len(xs) - 1) * sd / math.sqrt(len(xs)))


def paired_power(n: int, effect_size: float, alpha: float = POWER_ALPHA) -> float:
    """Power of the two-sided paired t-test at level `alpha` with `n` >= 2 pairs when the true mean difference is
    `effect_size` standard deviations (Cohen's d_z): P(|T| > t_{1-alpha/2, n-1}) for T ~ noncentral t with n - 1
    degrees of freedom and noncentrality d_z * sqrt(n) (scipy.stats.nct). Checked against G*Power's tables
    (tests/test_launch.py). Raises ValueError for n < 2."""
    if n < 2:
        raise ValueError(f"paired_power: n must be >= 2 pairs, got {n}")
    from scipy import stats

    df, nc = n - 1, abs(effect_size) * math.sqrt(n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_for_power(diffs: list[float], power: float = POWER_TARGET, alpha: float = POWER_ALPHA,
                    max_seeds: int = POWER_MAX_SEEDS) -> Optional[int]:
    """The fewest paired seeds at which `paired_power` reaches `power`, taking the observed per-seed differences'
    mean and standard deviation (ddof 1) as the truth: the pilot's effect-size reading of "how many seeds would a
    comparison need". An estimate, as uncertain as the pilot's standard deviation. Returns None when it cannot be
    read (fewer than 2 finite differences, or a zero mean), ``max_seeds + 1`` when more than `max_seeds` are needed,
    and 2 when the differences are equal and non-zero (no spread: any test rejects)."""
    xs = _finite(diffs)
    if len(xs) < 2:
        return None
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    if mean == 0:
        return None
    if sd == 0:
        return 2
    d, lo, hi = mean / sd, 2, max_seeds
    if paired_power(hi, d, alpha) < power:
        return max_seeds + 1
    while lo < hi:  # power rises with n: bisect for the first n that reaches it
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if paired_power(mid, d, alpha) < power else (lo, mid)
    return lo


def paired_t_p(diffs: list[float]) -> Optional[float]:
    """Two-sided p-value of the paired t-test (one-sample t on the per-seed differences, mean 0 under the null;
    scipy.stats.ttest_1samp); None with fewer than 2 differences or none of them spread (t undefined)."""
    xs = _finite(diffs)
    if len(xs) < 2 or max(xs) == min(xs):
        return None
    from scipy import stats  # as in mean_ci95

    return float(stats.ttest_1samp(xs, 0.0).pvalue)


def holm_adjust(pvalues: list[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjustment (Holm 1979) of a family of p-values, in their order: the k-th smallest of the m
    defined ones becomes max over j <= k of min(1, (m - j + 1) p_(j)); None entries stay None and are not counted
    in the family. Rejecting where the adjusted p < alpha controls the family-wise error rate at alpha."""
    defined = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    out: list[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(defined):
        running = max(running, min(1.0, (len(defined) - rank) * p))
        out[i] = running
    return out


def _partners(rows: list[dict], axis: str, baseline) -> list[tuple[dict, dict]]:
    """(row, the row at the same point but `axis` = `baseline`) for every row off the baseline that has one."""
    index = {tuple(sorted(r["point"].items())): r for r in rows}
    pairs = [(r, index.get(tuple(sorted(dict(r["point"], **{axis: baseline}).items()))))
             for r in rows if r["point"].get(axis) != baseline]
    return [(r, partner) for r, partner in pairs if partner is not None]


def paired_differences(rows: list[dict], axis: str, baseline, metrics=PAIRED_METRICS, seed_key: str = "seed") -> list:
    """Per-seed differences of each arm against the `baseline` value of `axis` at the same other axis values.

    Runs that share a seed (and a warm start) see the same first rollout batch, so the paired difference
    removes the seed-to-seed spread that both arms share. Returns one dict per (arm, other axis values) that
    has a baseline partner: the keys of the point without the seed, ``n`` (paired seeds, both with a final
    accuracy), ``wins`` (seeds where the arm's final accuracy is above the baseline's), ``seeds_for_power``
    (`seeds_for_power` of the final-accuracy differences), ``p`` (`paired_t_p` of them), ``p_holm``
    (`holm_adjust` over the returned rows) and, per metric, (mean, 95% t half-width) of arm - baseline.
    """
    out: dict = {}
    for r, partner in _partners(rows, axis, baseline):
        key = tuple((k, v) for k, v in r["point"].items() if k != seed_key)
        out.setdefault(key, []).append((r, partner))
    result = []
    for key, pairs in out.items():
        diffs = {m: [a[m] - b[m] for a, b in pairs if a[m] is not None and b[m] is not None]
                 for m in dict.fromkeys((*metrics, "final_accuracy"))}
        pairs = [(a, b) for a, b in pairs if a["final_accuracy"] is not None and b["final_accuracy"] is not None]
        d = dict(key, n=len(pairs), wins=sum(a["final_accuracy"] > b["final_accuracy"] for a, b in pairs),
                 seeds_for_power=seeds_for_power(diffs["final_accuracy"]), p=paired_t_p(diffs["final_accuracy"]))
        d.update({m: mean_ci95(diffs[m]) for m in metrics})
        result.append(d)
    for d, adjusted in zip(result, holm_adjust([d["p"] for d in result])):
        d["p_holm"] = adjusted
    return result


def gap_changes(rows: list[dict], baseline: tuple, change: tuple, metrics=PAIRED_METRICS,
                seed_key: str = "seed") -> list:
    """Difference in differences, paired by seed: how each arm's difference to `baseline` changes along `change`.

    For baseline ``("criterion", "ratio")`` and change ``("delta", 0.05)``, a PDM arm's row at δ 0.15 holds, per
    seed, (PDM − DPPO at δ 0.15) − (PDM − DPPO at δ 0.05): positive where the gap to DPPO narrows (or PDM pulls
    ahead) at the larger radius. It is `paired_differences` along `change` of the per-seed arm − baseline
    differences, with the same fields (``wins``: seeds where the difference grew; ``p``: the paired t-test of
    the change = 0, the interaction test of a two-way design; ``p_holm`` over the returned rows).
    """
    keys = dict.fromkeys((*metrics, "final_accuracy"))
    diffs = [dict(point=r["point"], **{m: None if r[m] is None or b[m] is None else r[m] - b[m] for m in keys})
             for r, b in _partners(rows, *baseline)]
    return paired_differences(diffs, *change, metrics=metrics, seed_key=seed_key)


def step_means(runs: list[dict], out: str, metrics, steps, seed_key: str = "seed") -> list[dict]:
    """Per grid point without `seed_key`, per metric: the mean ± 95% t half-width over seeds of the metric's value
    at each of the RL `steps` (the ``phase == "rl"`` records of each finished run's ``metrics.jsonl``; a seed
    without that step or metric is left out of that cell, whose ``n`` says how many seeds it has).

    Returns ``[{<axis>: value, ..., "metric": str, "cells": [(mean, half_width, n) per step]}]``, groups in the
    order of `runs`. With every run's records from the same rollouts (e.g. a shared warm start and a staleness
    ramp), early steps show where arms part; `aggregate` prints it as a markdown table.
    """
    groups: dict = {}
    for run in runs:
        if not os.path.exists(os.path.join(out, run["name"], "summary.json")):
            continue
        by_step = {r["step"]: r for r in _read_jsonl(os.path.join(out, run["name"], "metrics.jsonl"))
                   if r.get("phase") == "rl" and "step" in r}
        key = tuple((k, v) for k, v in run["point"].items() if k != seed_key)
        groups.setdefault(key, []).append(by_step)
    table = []
    for key, members in groups.items():
        for m in metrics:
            cells = []
            for t in steps:
                vals = _finite([d[t][m] for d in members if t in d and isinstance(d[t].get(m), (int, float))])
                cells.append((*mean_ci95(vals), len(vals)))
            table.append({**dict(key), "metric": m, "cells": cells})
    return table


def _step_means_markdown(table: list[dict], steps) -> str:
    """`step_means` as a markdown table: one row per grid point and metric, one column per RL step."""
    keys = [k for k in table[0] if k not in ("metric", "cells")]
    lines = ["", "Per-step means over seeds (RL phase; mean ± 95% t half-width, the seeds' values at that step):", "",
             "| " + " | ".join(keys + ["metric"] + [f"step {t}" for t in steps]) + " |",
             "|" + "---|" * (len(keys) + 1 + len(steps))]
    for row in table:
        cells = ["–" if not math.isfinite(m) else (_num(m) if not math.isfinite(h) else f"{_num(m)} ± {_num(h)}")
                 for m, h, _ in row["cells"]]
        lines.append("| " + " | ".join([str(row[k]) for k in keys] + [row["metric"]] + cells) + " |")
    return "\n".join(lines) + "\n"


def aggregate(runs: list[dict], out: str, collapse_margin: float = 0.1, seed_key: str = "seed",
              paired_baseline: Optional[tuple] = None, paired_change: Optional[tuple] = None,
              step_table: Optional[dict] = None) -> dict:
    """Builds the per-run and per-group tables; writes ``sweep_runs.csv`` and ``sweep_table.md`` under `out`.

    Returns ``{"rows": [...], "groups": [...], "paired": [...], "changes": [...], "gap_changes": [...],
    "markdown": str}``; groups are the grid points without `seed_key`, each metric as (mean, ci95 half-width),
    with ``n`` runs, of which ``gained`` end above their warm start. paired_baseline: ``(axis, value)``, e.g.
    ``("criterion", "ratio")``: the markdown also gets `paired_differences` against it. paired_change:
    ``(axis, value)`` of another axis, e.g. ``("delta", 0.05)``: the markdown also gets each arm's paired change
    from that value (`paired_differences` along it) and, with a paired_baseline, the change of each arm's
    difference to the baseline (`gap_changes`). step_table: ``dict(metrics=[...], steps=[...])``: the markdown
    also gets `step_means` (returned as ``"step_means"``).
    """
    rows = []
    for run in runs:
        row = summarize_run(os.path.join(out, run["name"]), collapse_margin)
        if row is None:
            continue
        row["point"] = run["point"]
        rows.append(row)
    os.makedirs(out, exist_ok=True)
    axis_keys = list(runs[0]["point"].keys()) if runs else []
    with open(os.path.join(out, "sweep_runs.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(axis_keys + list(RUN_COLUMNS))
        for r in rows:
            w.writerow([r["point"][k] for k in axis_keys] + [r[c] for c in RUN_COLUMNS])
    group_keys = [k for k in axis_keys if k != seed_key]
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r["point"][k] for k in group_keys), []).append(r)
    group_rows = []
    for key, members in groups.items():
        g = dict(zip(group_keys, key))
        g["n"] = len(members)
        for m in GROUP_METRICS:
            g[m] = mean_ci95([r[m] for r in members])
        g["warmstart_accuracy"] = mean_ci95([r["warmstart_accuracy"] for r in members])
        g["gained"] = sum(1 for r in members if r["accuracy_gain"] is not None and r["accuracy_gain"] > 0)
        group_rows.append(g)

    md = _markdown(group_keys, group_rows, axis_keys, rows)
    paired = paired_differences(rows, *paired_baseline, seed_key=seed_key) if paired_baseline else []
    if paired:
        b = paired_baseline
        md += _paired_markdown(paired, f"arm − {b[0]}={b[1]} (same seed, same warm start)")
    changes = paired_differences(rows, *paired_change, seed_key=seed_key) if paired_change else []
    if changes:
        md += _paired_markdown(changes, f"each arm's change from {paired_change[0]}={paired_change[1]}: the arm at "
                                        f"the row's {paired_change[0]} − the same arm at {paired_change[1]}")
    gaps = gap_changes(rows, paired_baseline, paired_change, seed_key=seed_key) if paired_change and paired_baseline \
        else []
    if gaps:
        b, c = paired_baseline, paired_change
        md += _paired_markdown(gaps, f"the change from {c[0]}={c[1]} of each arm's difference to {b[0]}={b[1]}: "
                                     f"(arm − {b[1]}) at the row's {c[0]} − (arm − {b[1]}) at {c[0]}={c[1]}, "
                                     "positive where the arm gains on the baseline")
    per_step = step_means(runs, out, step_table["metrics"], step_table["steps"], seed_key) if step_table else []
    if per_step:
        md += _step_means_markdown(per_step, step_table["steps"])
    with open(os.path.join(out, "sweep_table.md"), "w") as f:
        f.write(md)
    return dict(rows=rows, groups=group_rows, paired=paired, changes=changes, gap_changes=gaps, step_means=per_step,
                markdown=md)


def _paired_markdown(paired: list[dict], what: str) -> str:
    """`paired_differences` (or `gap_changes`) as a markdown table headed "Paired by seed, <what>." (mean ± 95%
    half-width of the per-seed differences; "seeds above": seeds whose difference is positive), with the seeds
    a comparison of that final-accuracy difference would need (`seeds_for_power`) and its paired t-test's p-value,
    raw and Holm-adjusted over the table's rows."""
    keys = [k for k in paired[0] if k not in ("n", "wins", "seeds_for_power", "p", "p_holm") + PAIRED_METRICS]
    power = f"seeds for {POWER_TARGET:.0%} power"
    heads = keys + ["n", "seeds above"] + [f"Δ {m}" for m in PAIRED_METRICS] + [power, "p", "p Holm"]
    lines = ["", f"Paired by seed, {what}. "
             f"'{power}': the paired seeds a two-sided t-test at {POWER_ALPHA:g} needs to detect the Δ final_accuracy "
             "seen here, were its mean and standard deviation the truth (an estimate; – where it cannot be read, "
             f"> {POWER_MAX_SEEDS:,} beyond the search). 'p': the two-sided paired t-test of Δ final_accuracy = 0; "
             f"'p Holm': adjusted by Holm's step-down method over the {len(paired)} rows of this table, not for "
             "looking at the data before a planned seed count:", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for d in paired:
        cells = [f"{_num(m)} ± {_num(ci)}" if math.isfinite(ci) else (_num(m) if math.isfinite(m) else "–")
                 for m, ci in (d[k] for k in PAIRED_METRICS)]
        need = d["seeds_for_power"]
        need = "–" if need is None else (f"> {POWER_MAX_SEEDS:,}" if need > POWER_MAX_SEEDS else str(need))
        ps = ["–" if d.get(k) is None else f"{d[k]:.2g}" for k in ("p", "p_holm")]
        lines.append("| " + " | ".join([str(d[k]) for k in keys] + [str(d["n"]), f"{d['wins']}/{d['n']}"] + cells
                                       + [need] + ps) + " |")
    return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    """3 decimals, or 3 significant digits in e-notation below 0.01 (top-K KL is ~1e-3); |v| < 1e-9 is 0."""
    v = 0.0 if abs(v) < 1e-9 else v  # e.g. the rounding residue of a t-interval over equal values
    return f"{v:.2e}" if v != 0 and abs(v) < 0.01 else f"{v:.3f}"


def _markdown(group_keys: list, group_rows: list[dict], axis_keys: list, rows: list[dict]) -> str:
    """The grouped table (mean ± 95% half-width over seeds) and the per-run table of `aggregate`, as markdown."""
    def cell(mc):
        m, ci = mc
        if not math.isfinite(m):
            return "–"
        return _num(m) if not math.isfinite(ci) else f"{_num(m)} ± {_num(ci)}"

    heads = ["n", "warm start acc", "final acc", "gain", "seeds above warm start", "reward area", "reward rise",
             "masked frac", "outside frac", "direction disagree", "top-K KL", "collapse events", "collapse rate"]
    lines = ["| " + " | ".join(group_keys + heads) + " |", "|" + "---|" * (len(group_keys) + len(heads))]
    for g in group_rows:
        lines.append("| " + " | ".join([str(g[k]) for k in group_keys] + [str(g["n"]), cell(g["warmstart_accuracy"])]
                                       + [cell(g[m]) for m in GROUP_METRICS[:2]] + [f"{g['gained']}/{g['n']}"]
                                       + [cell(g[m]) for m in GROUP_METRICS[2:]]) + " |")
    cols = ("warmstart_accuracy", "final_accuracy", "accuracy_gain", "reward_area", "reward_rise", "mean_frac_masked",
            "mean_frac_outside", "mean_frac_direction_disagree", "mean_topk_kl", "collapse_events")
    heads = ["warm start", "final", "gain", "reward area", "reward rise", "masked", "outside", "disagree", "top-K KL",
             "collapses", "wall s"]
    lines += ["", "Per run:", "", "| " + " | ".join(axis_keys + heads) + " |",
              "|" + "---|" * (len(axis_keys) + len(heads))]
    f3 = lambda v: "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else (  # noqa: E731
        _num(v) if isinstance(v, float) else str(v))
    for r in rows:
        lines.append("| " + " | ".join([str(r["point"][k]) for k in axis_keys] + [f3(r[c]) for c in cols]
                                       + [f"{r['wall_seconds']:.0f}" if r.get("wall_seconds") else "–"]) + " |")
    return "\n".join(lines) + "\n"


def _series(members: list[list[dict]], phase: str, key: str) -> tuple[list, np.ndarray]:
    """(steps, [seeds, steps] array of `key` in the `phase` records, NaN where a seed has none)."""
    steps = sorted({r["step"] for recs in members for r in recs if r.get("phase") == phase and key in r})
    by_seed = [{r["step"]: r[key] for r in recs if r.get("phase") == phase and r.get(key) is not None}
               for recs in members]
    return steps, np.array([[d.get(s, np.nan) for s in steps] for d in by_seed], dtype=float)


def _smooth(vals: np.ndarray, xs: list, width: int) -> tuple[list, np.ndarray]:
    """Per-seed moving average over `width` steps (the rows of `vals`); returns the shortened steps too."""
    if width <= 1 or vals.shape[1] < width:
        return xs, vals
    kernel = np.ones(width) / width
    return xs[width - 1:], np.stack([np.convolve(v, kernel, mode="valid") for v in vals])


def _band(ax, xs, vals: np.ndarray, color, label=None, marker=None, floor=None):
    """Seed mean with a shaded mean ± 95% t-interval band (no band for one seed; lower edge >= `floor`)."""
    mean = np.nanmean(vals, axis=0)
    ax.plot(xs, mean, color=color, lw=1.3, marker=marker, ms=3, label=label)
    n = np.sum(np.isfinite(vals), axis=0)
    if vals.shape[0] > 1 and np.all(n > 1):
        from scipy import stats

        half = stats.t.ppf(0.975, n - 1) * np.nanstd(vals, axis=0, ddof=1) / np.sqrt(n)
        low = mean - half if floor is None else np.maximum(mean - half, floor)
        ax.fill_between(xs, low, mean + half, color=color, alpha=0.15, lw=0)


def plot_sweep(runs: list[dict], out: str, seed_key: str = "seed", smooth: int = 5) -> Optional[str]:
    """``<out>/sweep_curves.png``: per group (grid point without the seed) against the RL step, the seed-mean
    training reward (moving average over `smooth` steps), the held-out accuracy (avg@k) and the mean top-K KL
    between trainer and sampler (per-seed moving average, the group's δ dotted), the last two with a band of
    mean ± 95% t-interval over seeds. Returns the path or None."""
    # Heavy (~1 s), and the Agg backend must be selected before pyplot is imported: only when plotting.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for run in runs:
        recs = _read_jsonl(os.path.join(out, run["name"], "metrics.jsonl"))
        if not os.path.exists(os.path.join(out, run["name"], "summary.json")) or not recs:
            continue
        key = tuple((k, v) for k, v in run["point"].items() if k != seed_key)
        groups.setdefault(key, []).append(recs)
    if not groups:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    for i, (key, members) in enumerate(groups.items()):
        label = ", ".join(f"{k}={v}" for k, v in key) + f" (n={len(members)})"
        color = colors[i % len(colors)]
        steps, rew = _series(members, "rl", "reward")
        mean = np.nanmean(rew, axis=0)
        if smooth > 1 and len(mean) >= smooth:
            mean, steps = np.convolve(mean, np.ones(smooth) / smooth, mode="valid"), steps[smooth - 1:]
        axes[0].plot(steps, mean, color=color, lw=1.2)
        _band(axes[1], *_series(members, "eval", "eval_accuracy"), color, label=label, marker="o")
        ksteps, kl = _series(members, "rl", "mean_topk_kl")
        if ksteps:
            _band(axes[2], *_smooth(kl, ksteps, smooth), color, floor=1e-4)
        if dict(key).get("delta") is not None:
            axes[2].axhline(float(dict(key)["delta"]), color=color, ls=":", lw=0.8)
    axes[0].set_title(f"training reward (seed mean, {smooth}-step moving average)", fontsize=10)
    axes[1].set_title("held-out accuracy (avg@k; seed mean ± 95% interval)", fontsize=10)
    axes[2].set_title(f"mean top-K KL(sampler || trainer), {smooth}-step average (± 95%); dotted: δ", fontsize=10)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "sweep_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="sweep definition file (get_sweep(arg) -> dict)")
    p.add_argument("--sweep_arg", default=None, help="argument passed to get_sweep")
    p.add_argument("--out", required=True, help="directory holding one workdir per run, and the tables")
    p.add_argument("--print_only", action="store_true", help="print the commands instead of running them")
    p.add_argument("--pod", action="store_true",
                   help="with --print_only: launch/tpu_pod.sh commands, one pod per run (a gs:// --out: bucket "
                        "workdirs, resumable)")
    p.add_argument("--tpu_name", default="pdm-sweep")
    p.add_argument("--project", default="my-project")
    p.add_argument("--zone", default="us-central2-b")
    p.add_argument("--accelerator", default="v4-32")
    p.add_argument("--aggregate_only", action="store_true", help="only (re)build the tables")
    p.add_argument("--only", default="", help="comma-separated substrings: run only matching run names")
    p.add_argument("--compile_cache", default=None,
                   help="persistent XLA compilation cache shared by the runs (default <out>/.xla_cache)")
    p.add_argument("--timeout_s", type=float, default=None, help="per-run wall-clock limit")
    p.add_argument("--code_dir", default=REPO,
                   help="directory the runs execute in (a pinned copy of the code); default: this checkout")
    p.add_argument("--records", default=None,
                   help="directory of committed run records: finished runs found there are restored and skipped, "
                        "and each run finished here is recorded there (save_record)")
    p.add_argument("--no_shared_warmstart", action="store_true",
                   help="every run does its own warm start even if the sweep sets share_warmstart_by")
    args = p.parse_args(argv)
    sweep = load_sweep(args.sweep, args.sweep_arg)
    runs = grid = expand(sweep)
    if args.only:
        pats = [s for s in args.only.split(",") if s]
        runs = [r for r in runs if any(s in r["name"] for s in pats)]
        if not runs:
            print(f"--only {args.only!r} matches none of the sweep's {len(grid)} runs", file=sys.stderr)
            return 2
    if args.print_only:
        for i, r in enumerate(runs):
            wd = os.path.join(args.out, r["name"])
            if args.pod:
                try:
                    cmd = pod_command(r, i, args.out, tpu_name=args.tpu_name, project=args.project, zone=args.zone,
                                      accelerator=args.accelerator)
                except ValueError as e:
                    print(f"sweep.py: {e}", file=sys.stderr)
                    return 2
            else:
                cmd = train_command(r, wd)
            print(shlex.join(cmd))
        return 0
    try:  # a bad record or warm-start archive (named by its ValueError): one line and exit 2, no traceback
        if not args.aggregate_only:
            res = run_local(runs, args.out, compile_cache=args.compile_cache or os.path.join(args.out, ".xla_cache"),
                            timeout_s=args.timeout_s, code_dir=args.code_dir, grid=grid, records=args.records,
                            share_warmstart_by=None if args.no_shared_warmstart else sweep["share_warmstart_by"])
            failed = [r["name"] for r in res if r["returncode"] != 0]
            if failed:
                print(f"{len(failed)} run(s) failed: {failed}", file=sys.stderr)
        elif args.records:
            check_records_dir(args.records)
            restore_records(runs, args.out, args.records)
            for r in runs:
                save_record(os.path.join(args.out, r["name"]), args.records)
    except ValueError as e:
        print(f"sweep.py: {e}", file=sys.stderr)
        return 2
    with _reading_once():
        table = aggregate(runs, args.out, collapse_margin=float(sweep["collapse_margin"]),
                          paired_baseline=sweep["paired_baseline"], paired_change=sweep["paired_change"],
                          step_table=sweep["step_means"])
        if not table["rows"]:
            print(f"no finished runs under {args.out}: none of the sweep's {len(runs)} run directories has a "
                  f"summary.json (run the sweep without --aggregate_only first)", file=sys.stderr)
            return 1
        plot_sweep(runs, args.out)
    print(table["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
