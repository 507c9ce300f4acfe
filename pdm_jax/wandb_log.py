"""Weights & Biases as one more metrics sink (``log.wandb``): the scalars, the run config, curves and evaluations.

`open_wandb` starts (or on resume continues, by the id in ``WORKDIR/wandb_run_id``) the run's W&B run;
`pdm_jax.metrics.MetricsWriter` hands it every record (`WandbSink.log`: each finite scalar as ``<phase>/<name>``
against ``<phase>/step``), and at the end the summary, ``curves.png`` and the evaluations table
(`WandbSink.log_run_end`); the config is the redacted one of config.json. Failures never stop training: a
`WandbLoggingWarning` names what failed and W&B logging is off for the rest of the run. `offline_history` reads an
offline run back (for tests and before ``wandb sync``)."""

from __future__ import annotations

import glob
import json
import logging
import os
import secrets
import shutil
import string
import struct
import tempfile
import time
import warnings
from typing import Any, Mapping, NamedTuple, Optional

from pdm_jax import workdir as wd

log = logging.getLogger(__name__)

#: The file in the workdir that keeps the run's W&B id (a resumed run continues that W&B run).
RUN_ID_FILE = "wandb_run_id"
#: The summary fields logged as the evaluations table, in this column order.
EVAL_COLUMNS = ("rl_step", "eval_accuracy", "eval_greedy_accuracy", "eval_reward")


class WandbLoggingWarning(UserWarning):
    """W&B logging failed (or could not start) and is off for the rest of the run; the other sinks go on."""


class WandbSpec(NamedTuple):
    """The ``log.wandb*`` fields (read in `pdm_jax.run_spec`): ``enabled`` (``log.wandb``), ``project``, ``run_name``
    ("" = the workdir's base name), ``mode`` ("online" or "offline")."""

    enabled: bool = False
    project: str = "pdm_jax"
    run_name: str = ""
    mode: str = "online"


def _warn(what: str, error: BaseException | str) -> None:
    message = (f"W&B logging is off for the rest of this run ({what}: "
               f"{error if isinstance(error, str) else f'{type(error).__name__}: {error}'}); "
               f"metrics.jsonl and TensorBoard go on")
    log.warning("%s", message)
    warnings.warn(message, WandbLoggingWarning, stacklevel=3)


def new_run_id() -> str:
    """A fresh W&B run id: 8 random characters of ``[a-z0-9]`` (as W&B's own ids)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _run_id(workdir: str, make_id) -> str:
    """The run's W&B id: the one ``WORKDIR/wandb_run_id`` keeps, else a new one, written there first."""
    path = wd.join(workdir, RUN_ID_FILE)
    if wd.exists(path):
        run_id = wd.read_bytes(path).decode().strip()
        if run_id:
            return run_id
    run_id = make_id()
    wd.write_bytes(path, (run_id + "\n").encode())
    return run_id


def open_wandb(spec: WandbSpec, workdir: str, run_config: Mapping[str, Any]) -> Optional["WandbSink"]:
    """Starts (or continues) the run's W&B run: a `WandbSink`, or None when ``spec.enabled`` is off or W&B cannot start
    (a `WandbLoggingWarning` says why).

    Args:
      spec: the ``log.wandb*`` fields.
      workdir: the run's workdir; W&B's files go under ``WORKDIR/wandb`` (a bucket workdir's to a local temporary).
      run_config: the redacted run config as a plain dict."""
    if not spec.enabled:
        return None
    try:
        import wandb  # optional (pip install -e '.[wandb]'): only when log.wandb is on
    except ImportError as e:
        _warn("log.wandb = True but wandb is not installed: pip install -e '.[wandb]'", e)
        return None
    local = None if wd.is_remote(workdir) else workdir
    directory = local or tempfile.mkdtemp(prefix="pdm_jax_wandb_")
    try:
        run_id = _run_id(workdir, new_run_id)
        name = spec.run_name or os.path.basename(str(workdir).rstrip("/")) or None
        run = wandb.init(project=spec.project, name=name, id=run_id, resume="allow", mode=spec.mode, dir=directory,
                         config=dict(run_config), settings=wandb.Settings(console="off", silent=True))
    except Exception as e:  # noqa: BLE001 - no login, no network, a refused id...: a warning, never a stopped run
        _warn(f"wandb.init (project {spec.project!r}, mode {spec.mode!r})", e)
        return None
    log.info("W&B run %s (%s, project %s) logs this run", run_id, spec.mode, spec.project)
    return WandbSink(run, wandb, temp_dir=None if local else directory)


class WandbSink:
    """One W&B run (``run``, with the ``wandb`` module) as a metrics sink; every call is guarded (a failure:
    `WandbLoggingWarning`, then no-ops); ``temp_dir``, if any, is removed at `close`."""

    def __init__(self, run, wandb, *, temp_dir: Optional[str] = None):
        self.run, self._wandb, self._temp_dir = run, wandb, temp_dir
        self.active = True
        self._phases: set = set()

    def _guard(self, what: str, fn) -> None:
        if not self.active:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - W&B must never stop training
            self.active = False
            _warn(what, e)

    def log(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        """Logs one metrics record: ``{"<phase>/step": step, "<phase>/<name>": value}`` (finite floats only)."""
        def do():
            if phase not in self._phases:  # each phase against its own step counter
                self.run.define_metric(f"{phase}/step")
                self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
                self._phases.add(phase)
            self.run.log({f"{phase}/step": int(step), **{f"{phase}/{k}": float(v) for k, v in scalars.items()}})

        self._guard(f"logging {phase} step {step}", do)

    def log_run_end(self, summary: Mapping[str, Any], curves_png: Optional[str] = None) -> None:
        """The summary's scalars into the run summary, curves.png as ``curves`` and the evaluations as a table."""
        def do():
            self.run.summary.update({k: v for k, v in summary.items()
                                     if isinstance(v, (int, float)) and not isinstance(v, bool)})
            rows = [[e.get(c) for c in EVAL_COLUMNS] for e in summary.get("evaluations", [])]
            payload = {"evaluations": self._wandb.Table(columns=list(EVAL_COLUMNS), data=rows)}
            if curves_png and wd.exists(curves_png):
                local = curves_png
                if wd.is_remote(curves_png):
                    local = os.path.join(tempfile.mkdtemp(prefix="pdm_jax_curves_"), "curves.png")
                    with open(local, "wb") as f:
                        f.write(wd.read_bytes(curves_png))
                payload["curves"] = self._wandb.Image(local)
            self.run.log(payload)

        self._guard("logging the run's summary, curves and evaluations", do)

    def close(self) -> None:
        """Finishes the W&B run (uploads or, offline, closes its files); a failure is a warning."""
        self._guard("finishing the W&B run", self.run.finish)
        self.active = False
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- reading an offline run back
_BLOCK = 32768
_HEADER = 7  # ":W&B" + magic 0xBEE1 (little-endian) + version 0


def read_records(path: str) -> list:
    """The ``wandb_internal_pb2.Record`` protos of one W&B run file (``run-<id>.wandb``), in order: a 7-byte ``:W&B``
    header, then LevelDB's log format (32 KiB blocks of chunks with a 7-byte header: CRC-32, length, type); a torn
    last record is left out.

    Raises:
      ValueError: the file does not start with W&B's header."""
    from wandb.proto import wandb_internal_pb2 as pb  # optional, as open_wandb

    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a W&B run file (header {data[:4]!r})")
    records, pos, parts = [], _HEADER, []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            break  # torn
        pos += 7 + length
        if kind in (1, 2):
            parts = [chunk]
        elif kind in (3, 4) and parts:
            parts.append(chunk)
        if kind in (1, 4) and parts:
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def finished_records(wandb_dir: str, wait_s: float = 30.0) -> list:
    """``[records of each run file]`` of the offline runs under `wandb_dir`, oldest first, once each file ends with its
    run's ``exit`` record: W&B's service process writes the file after ``run.finish()`` returns, so a file is read again
    until it is complete, for at most `wait_s` seconds (then as it is)."""
    deadline = time.monotonic() + wait_s
    out = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb"))):
        while True:
            records = read_records(path)
            if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        out.append(records)
    return out


def offline_history(wandb_dir: str, wait_s: float = 30.0) -> list:
    """Every history row of the offline runs under `wandb_dir`, oldest first (waiting up to `wait_s` for W&B to finish):
    one dict ``{name: value}`` per ``run.log`` call (nested keys joined with ``/``; ``_step`` etc. included)."""
    rows = []
    for records in finished_records(wandb_dir, wait_s):
        for record in records:
            if record.WhichOneof("record_type") == "history":
                rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def offline_runs(wandb_dir: str, wait_s: float = 30.0) -> list:
    """``[(run_id, project, config dict)]`` of the offline runs under `wandb_dir`, oldest first (their run records;
    `finished_records`)."""
    out = []
    for records in finished_records(wandb_dir, wait_s):
        for record in records:
            if record.WhichOneof("record_type") == "run":
                config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
                out.append((record.run.run_id, record.run.project, config))
                break
    return out
