"""Training checkpoints with orbax, verified at restore: model, optimizer, step, RNG, data position, sampler version.

A checkpoint is one orbax `CheckpointManager` step (``DIR/<step>``) with ``state`` (the `TrainState` pytree) and
``meta`` (JSON: phase, RL step, data position, weights version, seed, warm-start accuracies, wall time, fallbacks),
plus the caller's ``extra_files``. Every random draw derives from (seed, RL step), so a resumed run draws what the
uninterrupted one would.

Integrity: after orbax's save, ``DIR/<step>/integrity.json`` records every file's size and sha256 (renamed into
place: complete or absent). A restore checks the files against it, restores, then refuses non-finite values; any
failure (a missing manifest included) is a `CheckpointError` naming the directory and reason.
`Checkpointer.restore_latest_intact` falls back to the newest intact checkpoint, moves refused ones to
``DIR.corrupt/`` and records the fallback in ``meta["checkpoint_fallbacks"]``. On a bucket (``gs://``) orbax writes
through TensorStore and marks a save with ``commit_success.txt``; the manifest records each object's size and the
store's CRC32C from one listing (a rewritten object gets a new CRC32C), and refused checkpoints are moved by
copy-then-delete."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pdm_jax import workdir as wd

log = logging.getLogger("pdm_jax.checkpointing")

MANIFEST_NAME = "integrity.json"
_MANIFEST_FORMAT = 1
_HASH_CHUNK = 8 << 20  # bytes read per hashlib update


class CheckpointLayoutError(ValueError):
    """A checkpoint intact on disk but with an older parameter layout (per-layer, not stacked); not a `CheckpointError`,
    so it is not moved aside: the run stops with this message."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored: damaged, incomplete, non-finite, or refused by orbax.

    Attributes:
      path: the checkpoint's directory (``DIR/<step>``), or the root when none is intact.
      step: the step id, or None for "no intact checkpoint".
      reason: what is wrong (files and how, or the offending parameters)."""

    def __init__(self, path: str, step: Optional[int], reason: str):
        self.path, self.step, self.reason = path, step, reason
        what = f"checkpoint {path}" if step is not None else f"no intact checkpoint under {path}"
        super().__init__(f"{what}: {reason}")


@dataclasses.dataclass
class Restored:
    """What `Checkpointer.restore_latest_intact` restored: ``state`` (the abstract target's structure and shardings),
    ``meta`` (with one ``checkpoint_fallbacks`` entry per refused checkpoint), ``step``, and ``fallbacks`` (this
    restore's entries; [] when the latest was intact)."""

    state: Any
    meta: dict
    step: int
    fallbacks: list


# ------------------------------------------------------------------ integrity manifest
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: str) -> list:
    """Relative paths of every file under ``root`` except the manifest, sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST_NAME and not rel.startswith(MANIFEST_NAME + "."):
                out.append(rel)
    return sorted(out)


def _remote_files(root: str) -> dict:
    """``{relpath: {"size", "crc32c"}}`` of every object under the URL `root` except the manifest (one listing).

    Raises:
      ValueError: the file system reports no CRC32C for an object (only GCS-like stores are supported).
    """
    fs, base = wd.filesystem(root)
    base = base.rstrip("/")
    out = {}
    for name, info in fs.find(base, detail=True, withdirs=False).items():
        rel = name[len(base) + 1:]
        if rel == MANIFEST_NAME or rel.startswith(MANIFEST_NAME + ".") or info.get("type") == "directory":
            continue
        if not info.get("crc32c"):
            raise ValueError(f"{root}/{rel}: the file system reports no crc32c checksum for it")
        out[rel] = dict(size=int(info["size"]), crc32c=str(info["crc32c"]))
    return out


def write_manifest(root: str) -> dict:
    """Writes ``root/integrity.json`` (``{"format", "algorithm": "sha256", "files": {relpath: {size, sha256}}}``) to a
    temporary file, fsynced and renamed; returns the dict. On a bucket: ``"crc32c"`` per object from one listing, one
    single-object upload."""
    if wd.is_remote(root):
        manifest = dict(format=_MANIFEST_FORMAT, algorithm="crc32c", files=_remote_files(root))
        wd.write_bytes(wd.join(root, MANIFEST_NAME), json.dumps(manifest, indent=1, sort_keys=True).encode())
        return manifest
    files = {rel: dict(size=os.path.getsize(os.path.join(root, rel)), sha256=_sha256(os.path.join(root, rel)))
             for rel in _files(root)}
    manifest = dict(format=_MANIFEST_FORMAT, algorithm="sha256", files=files)
    tmp = os.path.join(root, f"{MANIFEST_NAME}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST_NAME))
    return manifest


def _read_manifest(root: str) -> dict:
    path = wd.join(root, MANIFEST_NAME)
    if not wd.exists(path):
        raise ValueError(f"no integrity manifest {MANIFEST_NAME} (the save was interrupted after orbax's commit, "
                         "or the checkpoint predates integrity manifests)")
    algorithm = "crc32c" if wd.is_remote(root) else "sha256"
    try:
        manifest = json.loads(wd.read_bytes(path).decode("utf-8"))
        files = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("algorithm") != algorithm or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get(algorithm), str)
                for v in files.values()):
            raise ValueError("unexpected format, algorithm or file entries")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"integrity manifest {MANIFEST_NAME} is unreadable ({type(e).__name__}: {e})") from None
    return files


def verify_manifest(root: str) -> None:
    """Checks every file under ``root`` against ``root/integrity.json``; ValueError for no or an unreadable manifest, or
    files missing, resized, with another hash, or unlisted (naming up to 5)."""
    expected = _read_manifest(root)
    problems = []
    if wd.is_remote(root):
        got = _remote_files(root)
        for rel, want in sorted(expected.items()):
            if rel not in got:
                problems.append(f"{rel} is missing")
            elif got[rel]["size"] != want["size"]:
                problems.append(f"{rel} has {got[rel]['size']} bytes, {want['size']} were written")
            elif got[rel]["crc32c"] != want["crc32c"]:
                problems.append(f"{rel} has changed (crc32c differs from the one written)")
        problems += [f"{rel} was not written by the save" for rel in sorted(got) if rel not in expected]
        expected = {}
    for rel, want in sorted(expected.items()):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(p) != want["size"]:
            problems.append(f"{rel} has {os.path.getsize(p)} bytes, {want['size']} were written")
        elif _sha256(p) != want["sha256"]:
            problems.append(f"{rel} has changed (sha256 differs from the one written)")
    problems += [f"{rel} was not written by the save" for rel in _files(root) if rel not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{len(problems)} damaged file(s): " + "; ".join(problems[:5]) + more)


def nonfinite_leaves(tree: Any) -> list:
    """Key paths (``jax.tree_util.keystr``) of the floating-point leaves of ``tree`` holding a NaN or an inf."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return []
    ok = jax.device_get(jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])([x for _, x in leaves]))
    return [jax.tree_util.keystr(p) for (p, _), good in zip(leaves, ok) if not bool(good)]


# ------------------------------------------------------------------ the checkpointer
class Checkpointer:
    """Saves and restores (TrainState, meta) under `directory` (created if missing) with orbax and integrity manifests,
    keeping the `max_to_keep` most recent. Multi-host: every process calls `save` and `restore`; process 0 writes the
    manifest and moves refused checkpoints, the others wait at a barrier."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        self.directory = wd.run_path(directory)
        wd.makedirs(self.directory)
        self._barriers = 0
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False),
            item_names=("state", "meta"),
        )

    def step_path(self, step: int) -> str:
        """The directory of checkpoint ``step``."""
        return wd.join(self.directory, str(int(step)))

    def steps(self) -> list:
        """Every step id with a directory on disk, ascending (intact or not; orbax's temporary saves excluded)."""
        if wd.is_remote(self.directory):  # one listing; an object store's "directories" are prefixes
            fs, base = wd.filesystem(self.directory)
            try:
                entries = fs.ls(base, detail=True, refresh=True)
            except FileNotFoundError:
                return []
            names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]
            return sorted(int(n) for n in names if n.isdigit())
        return sorted(int(n) for n in os.listdir(self.directory)
                      if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

    def latest_step(self) -> Optional[int]:
        """The newest step on disk (an int id chosen by the caller), or None; it may still fail verification."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _barrier(self, what: str) -> None:
        self._barriers += 1
        ocp.multihost.sync_global_processes(f"pdm_jax_checkpointer_{what}_{self._barriers}")

    def save(self, step: int, state: Any, meta: dict, extra_files: Optional[dict] = None) -> None:
        """Saves `state` (a pytree of arrays) and `meta` (JSON-serialisable) as checkpoint `step`, synchronously:
        returns once orbax committed and the manifest is written. ``extra_files`` (``{name: bytes}``, on every
        process or none) are written before the manifest; read them with `read_file`. A Ctrl-C during the save is
        held until it completes (`deferred_interrupt`).

        Raises:
          pdm_jax.workdir.RunWriteError: naming the step's directory when a file cannot be written (a full disk);
            what is left is never taken by a restore."""
        with deferred_interrupt(), wd.naming_write_errors(self.step_path(step)):
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self._manager.wait_until_finished()
            if extra_files is not None:
                for name, data in extra_files.items():
                    wd.write_bytes(wd.join(self.step_path(step), name), data)
                self._barrier("extra_files")
            if jax.process_index() == 0:
                write_manifest(self.step_path(step))
        self._barrier("manifest")

    def read_file(self, step: int, name: str) -> Optional[bytes]:
        """The bytes of file ``name`` saved with checkpoint ``step`` (``save``'s ``extra_files``), or None."""
        path = wd.join(self.step_path(step), name)
        return wd.read_bytes(path) if wd.exists(path) else None

    def restore(self, abstract_state: Any, step: Optional[int] = None):
        """Restores (state, meta) of `step` (default: the latest) into `abstract_state`'s structure and shardings.

        Raises:
          FileNotFoundError: there is no checkpoint (of that step).
          CheckpointError: it fails its integrity check, orbax cannot restore it, or it holds a non-finite value
            (naming the directory and what is wrong)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        path = self.step_path(step)
        if not wd.isdir(path):
            raise FileNotFoundError(f"no checkpoint {path}")
        try:
            verify_manifest(path)
        except ValueError as e:
            raise CheckpointError(path, step, str(e)) from None
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                        meta=ocp.args.JsonRestore()),
            )
        except Exception as e:  # orbax/tensorstore raise many types; each one means "not restorable"
            self._check_layout(path, step)
            raise CheckpointError(path, step, f"orbax could not restore it ({type(e).__name__}: {e})") from e
        bad = nonfinite_leaves(restored["state"])
        if bad:
            raise CheckpointError(path, step, f"non-finite values (NaN or inf) in {len(bad)} array(s): "
                                              + ", ".join(bad[:5]))
        return restored["state"], restored["meta"]

    def _check_layout(self, path: str, step: int) -> None:
        """Raises `CheckpointLayoutError` if checkpoint `step` stores decoder layers one by one (a path
        ``.../layers/<i>/...``), showing the shortest such path."""
        try:
            tree = self._manager.item_metadata(step)["state"]
            paths = [tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in p)
                     for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        except Exception:  # unreadable metadata: a damaged checkpoint, reported by the caller
            return
        per_layer = [p for p in paths
                     if any(a == "layers" and b.strip("[]").isdigit() for a, b in zip(p, p[1:]))]
        if per_layer:  # the shortest such path: a parameter's, not an optimizer moment's
            example = "/".join(min(per_layer, key=lambda p: (len(p), p)))
            raise CheckpointLayoutError(
                f"checkpoint {path} stores the decoder layers one by one ({example}): it was "
                "written by a pdm_jax before the layers were stacked (parameters [L, ...] under "
                "'layers', scanned). This version cannot resume it; resume it with the pdm_jax "
                "commit that wrote it, or start a new workdir (export its weights with that "
                "commit's pdm_jax.models.hf_io.save_pretrained and set model.hf_path).")

    def restore_latest_intact(self, abstract_state: Any) -> Restored:
        """Restores the newest checkpoint that passes `restore`'s checks, falling back past refused ones: each is
        logged, moved to ``DIR.corrupt/<step>`` once an older one restored, and recorded as ``{"refused_step",
        "restored_step", "reason", "moved_to", "time"}`` in the returned ``meta["checkpoint_fallbacks"]``.

        Raises:
          FileNotFoundError: there is no checkpoint.
          CheckpointError: none is intact (listing every checkpoint and its reason; nothing is moved)."""
        steps = self.steps()[::-1]
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        refused = []
        for step in steps:
            try:
                state, meta = self.restore(abstract_state, step)
            except CheckpointError as e:
                log.error("%s", e)
                refused.append(e)
                continue
            fallbacks = [dict(refused_step=e.step, restored_step=step, reason=e.reason,
                              moved_to=self._quarantine(e.step), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                         for e in refused]
            if refused:
                self._barrier("quarantine")
                self._manager.reload()
                log.warning("FALLBACK: restored the older checkpoint %s because %s could not be restored "
                            "(moved to %s); the steps after it are redone", self.step_path(step),
                            ", ".join(e.path for e in refused), ", ".join(f["moved_to"] for f in fallbacks))
                meta = dict(meta, checkpoint_fallbacks=list(meta.get("checkpoint_fallbacks", [])) + fallbacks)
            return Restored(state=state, meta=meta, step=step, fallbacks=fallbacks)
        raise CheckpointError(self.directory, None, "; ".join(f"{e.path}: {e.reason}" for e in refused))

    def _quarantine(self, step: int) -> str:
        """Moves checkpoint ``step`` to ``DIR.corrupt/<step>[-time]`` (process 0 only); returns the new path."""
        dest_root = self.directory + ".corrupt"
        dest = wd.join(dest_root, str(step))
        if wd.exists(dest):
            dest = f"{dest}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if jax.process_index() == 0 and wd.is_remote(dest):  # no rename on an object store: copy, then delete
            fs, src = wd.filesystem(self.step_path(step))
            fs.copy(src, wd.filesystem(dest)[1], recursive=True)
            fs.rm(src, recursive=True)
        elif jax.process_index() == 0:
            os.makedirs(dest_root, exist_ok=True)
            shutil.move(self.step_path(step), dest)
        return dest

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


@contextlib.contextmanager
def deferred_interrupt():
    """Holds back Ctrl-C (SIGINT) for the body, then raises the KeyboardInterrupt it held, so a checkpoint save
    completes instead of leaving orbax's threads failing; a second Ctrl-C interrupts at once. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []

    def hold(signum, frame):
        held.append(signum)
        if len(held) > 1:  # a second Ctrl-C: the user insists (e.g. a save stuck at a multi-host barrier)
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def last_saved(directory: str) -> Optional[Restored]:
    """The newest complete checkpoint under `directory` (one whose integrity manifest was written) as
    ``Restored(state=None, meta, step, fallbacks=[])``, its meta read from the JSON orbax wrote; None when there is none
    or its meta cannot be read. Reads two small files, no arrays: the command line's note after an interrupt."""
    try:
        names = wd.listdir(directory)
    except OSError:
        return None
    for step in sorted((int(n) for n in names if n.isdigit()), reverse=True):
        path = wd.join(directory, str(step))
        if not wd.exists(wd.join(path, MANIFEST_NAME)):
            continue
        try:
            meta = json.loads(wd.read_bytes(wd.join(path, "meta", "metadata")))
        except (OSError, ValueError):
            return None
        return Restored(state=None, meta=meta, step=step, fallbacks=[]) if isinstance(meta, dict) else None
    return None


def run_finished(workdir: str, rl_steps: int) -> bool:
    """Whether the run in `workdir` has nothing left to do for ``rl.steps`` = `rl_steps`: its ``summary.json`` is
    written and its newest complete checkpoint (`last_saved`) is at RL step `rl_steps` or later."""
    saved = last_saved(wd.join(wd.run_path(workdir), "checkpoints"))
    return (saved is not None and int(saved.meta.get("rl_step", 0)) >= int(rl_steps)
            and wd.exists(wd.join(wd.run_path(workdir), "summary.json")))


def abstract_like(tree: Any) -> Any:
    """A pytree of jax.ShapeDtypeStruct (with shardings) matching `tree`, for restore targets."""

    def f(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(f, tree)
