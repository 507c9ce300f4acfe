"""Run-directory helpers: an exclusive lock, bucket (``gs://``) paths, and the run's ``config.json``.

`WorkdirLock` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``WORKDIR/.lock`` and records the holder's pid, host and
start time; the kernel releases it when the holder exits (SIGKILL included), so a stale file does not block, and a
second run gets `WorkdirLockedError` naming the holder. flock is advisory and per host (NFSv4 propagates it, gcsfuse
does not); multi-host runs lock from process 0 only. A workdir may be a bucket URL: run files go through fsspec
(`is_remote`, `run_path`, `join`, `write_bytes`, ...), where `write_bytes` is one single-object upload (visible whole
or not at all) and locally a temporary + ``os.replace``; a bucket has no locks, so `WorkdirLock` only warns there."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import stat
import time
from typing import Optional

log = logging.getLogger("pdm_jax.workdir")

LOCK_NAME = ".lock"


class RunWriteError(OSError):
    """A run file could not be written (a full disk, a quota, a read-only or vanished directory), naming the file and
    the error (``errno`` kept); the run stops at once, and the same command resumes from its last checkpoint once
    fixed. Raised by every writer of the run."""


# The OS error a library reports inside its own exception type: tensorstore (orbax's arrays) raises ValueError "...
# [os_error_code='28'] ...", safetensors SafetensorError "... (os error 28)".
_WRAPPED_OS_ERROR = re.compile(r"os_error_code='(\d+)'|\(os error (\d+)\)")


def wrapped_os_errno(e: BaseException) -> Optional[int]:
    """The errno an exception carries: an OSError's own, or the OS error a library's exception names in its text
    (tensorstore, safetensors); None when it carries none."""
    if isinstance(e, OSError):
        return e.errno
    m = _WRAPPED_OS_ERROR.search(str(e))
    return int(m.group(1) or m.group(2)) if m else None


@contextlib.contextmanager
def naming_write_errors(path: str):
    """Re-raises an OSError from the body, or a library's exception naming an OS error (`wrapped_os_errno`: orbax's
    tensorstore, safetensors), as `RunWriteError` naming `path` and the errno's name."""
    try:
        yield
    except RunWriteError:
        raise
    except Exception as e:  # noqa: BLE001 - only those that carry an OS error are renamed
        code = wrapped_os_errno(e)
        if code is None and not isinstance(e, OSError):
            raise
        name = errno.errorcode.get(code, "") if code else ""
        why = (e.strerror if isinstance(e, OSError) else None) or (os.strerror(code) if code else str(e))
        message = (f"cannot write {path}: {name + ': ' if name else ''}{why} (free space or fix the directory, then "
                   "run the same command: it resumes from the last checkpoint)")
        raise (RunWriteError(message) if code is None else RunWriteError(code, message)) from e


@contextlib.contextmanager
def close_after(resource, what: str):
    """Closes `resource` when the body ends; the body's own error wins: an error of the close is logged and added to it
    as a note (``__notes__``), and raised as is when the body succeeded."""
    try:
        yield resource
    except BaseException as first:
        try:
            resource.close()
        except Exception as later:  # noqa: BLE001 - reported beside the first error, never instead of it
            note = f"also, closing {what} after it failed: {type(later).__name__}: {later}"
            log.error("%s", note)
            first.add_note(note)
        raise
    resource.close()


def _write_new(tmp: str, data: bytes) -> None:
    """Writes `data` to the new file `tmp` (a stale one of a dead process removed first; never through a link)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a link planted at the name is removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class WorkdirLockedError(RuntimeError):
    """Another live process holds the workdir's lock.

    Attributes:
      workdir: the absolute run directory.
      holder: the holder's record read from the lock file ({"pid", "host", "started"}), or {} if unreadable.
    """

    def __init__(self, workdir: str, holder: dict):
        self.workdir = workdir
        self.holder = holder
        started = f", started {holder['started']}" if holder and holder.get("started") else ""
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{started}" if holder
               else "an unknown process")
        super().__init__(
            f"workdir {workdir} is in use by another run ({who}; lock file {os.path.join(workdir, LOCK_NAME)}). "
            "Two trainers on one workdir would duplicate and lose records: stop the other run or choose another "
            "--workdir.")


class WorkdirLock:
    """An exclusive, non-blocking flock on ``WORKDIR/.lock`` (`workdir` created if missing): `acquire` (or the context
    manager), then `release`; also released at process exit or garbage collection."""

    def __init__(self, workdir: str):
        self.workdir = run_path(workdir)
        self.path = join(self.workdir, LOCK_NAME)
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock and records this process in the lock file; returns self.

        Raises:
          WorkdirLockedError: another open file description holds the lock.
          ValueError: the lock path is a symbolic link, a directory or not a regular file, or cannot be created
            (naming it).
          OSError: the lock file cannot be locked for another reason."""
        if self._fd is not None:
            return self
        if is_remote(self.workdir):
            if not getattr(self, "_warned", False):
                log.warning("workdir %s is on an object store, which has no locks: it is not locked (make sure "
                            "no other run uses it)", self.workdir)
            self._warned = True
            return self
        try:
            os.makedirs(self.workdir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            why = {errno.ELOOP: "is a symbolic link; a lock file is never followed (remove the link)",
                   errno.EISDIR: "is a directory, not a lock file (remove it)"}.get(
                e.errno, f"cannot be created or opened ({e.strerror}; is the workdir writable?)")
            raise ValueError(f"workdir lock {self.path} {why}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: nothing a run may write to
            os.close(fd)
            raise ValueError(f"workdir lock {self.path} is not a regular file (remove it)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirLockedError(self.workdir, read_holder(self.workdir)) from None
            raise
        record = dict(pid=os.getpid(), host=socket.gethostname(),
                      started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clears the holder record and releases the lock (idempotent). The file itself stays."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # still held: nobody reads a half-cleared record
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except OSError:
            pass


def read_holder(workdir: str) -> dict:
    """The record ({"pid", "host", "started"}) in ``WORKDIR/.lock``, or {} if absent, empty or unreadable."""
    if is_remote(workdir):
        return {}
    try:
        with open(os.path.join(os.path.abspath(workdir), LOCK_NAME)) as f:
            rec = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


# ------------------------------------------------------------------ run files on a local disk or a bucket
def is_remote(path) -> bool:
    """Whether `path` is a URL of a remote file system (``gs://...``, ``s3://...``, ``memory://...``)."""
    path = os.fspath(path)
    return "://" in path and not path.startswith("file://")


def run_path(path) -> str:
    """A run path in its canonical form: absolute for a local path, the URL without a trailing ``/`` otherwise."""
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def join(root: str, *parts: str) -> str:
    """`os.path.join` for local paths, ``/``-joined for URLs."""
    return posixpath.join(root, *parts) if is_remote(root) else os.path.join(root, *parts)


def filesystem(path: str):
    """``(fsspec file system, path within it)`` of a URL (gcsfs for ``gs://``; fsspec's error if not installed).

    Listings are not cached: other hosts write the same bucket, so every call sees the bucket as it is.
    """
    import fsspec  # here: local runs never need it

    return fsspec.core.url_to_fs(path, use_listings_cache=False)


def makedirs(path: str) -> None:
    """Creates a directory and its parents if missing (a no-op on object stores, which have no directories).

    Raises:
      RunWriteError: it cannot be created (a read-only or full file system, a file in its place), naming it.
    """
    if not is_remote(path):
        with naming_write_errors(path):
            os.makedirs(path, exist_ok=True)
        return
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)


def exists(path: str) -> bool:
    """Whether a file or directory exists at `path`."""
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    """Whether `path` is a directory (on an object store: a prefix with objects under it)."""
    if not is_remote(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    return fs.isdir(p)


def listdir(path: str) -> list:
    """Names of the entries of directory `path` ([] if it does not exist), unsorted."""
    if not is_remote(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = filesystem(path)
    try:
        return [posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False, refresh=True)]
    except FileNotFoundError:
        return []


def rmtree(path: str) -> None:
    """Deletes a directory tree; missing is fine."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


def read_bytes(path: str) -> bytes:
    """The bytes of a file. Raises FileNotFoundError (or the file system's OSError)."""
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def write_bytes(path: str, data: bytes, *, atomic: bool = True) -> None:
    """Writes a file whole. Local: to a temporary name, then ``os.replace`` (atomic for readers) when `atomic`, else a
    plain overwrite. URL: one single-object upload (on GCS the object appears complete or not at all; no temporary name,
    as object stores have no rename). Raises `RunWriteError` (local) naming `path` when the file cannot be written."""
    if is_remote(path):
        fs, p = filesystem(path)
        fs.pipe_file(p, data)
        return
    with naming_write_errors(path):
        if not atomic:
            with open(path, "wb") as f:
                f.write(data)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            _write_new(tmp, data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk (or any failure) keeps no half-written temporary
            raise


def upload_file(local: str, remote: str) -> None:
    """Copies the local file `local` to the URL `remote` (one single-object upload)."""
    fs, p = filesystem(remote)
    fs.put_file(local, p)


def _flat(d, prefix: str = "") -> dict:
    """Dotted paths of a nested dict's leaves."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _changed_fields(earlier: bytes, config_json: str) -> dict:
    """``{dotted path: (earlier value, new value)}`` of the fields in which two run configs differ, sorted by path
    (``{"<unreadable config.json>": (None, None)}`` when `earlier` is not JSON)."""
    try:
        old, new = _flat(json.loads(earlier)), _flat(json.loads(config_json))
    except ValueError:
        return {"<unreadable config.json>": (None, None)}
    return {k: (old.get(k, "<absent>"), new.get(k, "<absent>")) for k in sorted(old.keys() | new.keys())
            if old.get(k, "<absent>") != new.get(k, "<absent>")}


class FinishedRunError(ValueError):
    """A command with another config on a finished run's workdir (`refuse_changed_config`)."""


def refuse_changed_config(workdir: str, config_json: str) -> None:
    """Refuses another config on a finished run's workdir before any work (the same values in any layout, or no
    ``config.json``, pass).

    Raises:
      FinishedRunError: naming the workdir, each changed field with both values, and the ways on (a new
        ``--workdir``, or a larger ``rl.steps``)."""
    path = join(workdir, "config.json")
    if not exists(path):
        return
    changed = _changed_fields(read_bytes(path), config_json)
    if changed:
        fields = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise FinishedRunError(
            f"{workdir} holds a finished run, and this command changes {len(changed)} field(s) of the config it ran "
            f"with ({fields}): nothing would run with them, so nothing is done and its config.json stays as it is. "
            "For a run with this config choose a new --workdir; to continue this run, raise rl.steps")


def write_run_config(workdir: str, config_json: str) -> list:
    """Writes the run's ``config.json`` (``config_json``: the redacted config as JSON text); an earlier one with other
    content is kept as ``config.<n>.json`` (the first free n) and the changed fields are logged.

    Returns:
      The sorted dotted paths of the fields that differ from the earlier ``config.json`` (``["<unreadable
      config.json>"]`` for a torn one; ``[]`` on a first run or the same config).

    Raises:
      RunWriteError: a file cannot be written (local workdir), naming it."""
    path = join(workdir, "config.json")
    if not exists(path):
        write_bytes(path, config_json.encode())
        return []
    earlier = read_bytes(path)
    if earlier == config_json.encode():
        return []
    changed = list(_changed_fields(earlier, config_json))
    if not changed:  # the same fields and values, laid out otherwise
        write_bytes(path, config_json.encode())
        return []
    n = 1
    while exists(join(workdir, f"config.{n}.json")):
        n += 1
    write_bytes(join(workdir, f"config.{n}.json"), earlier)
    write_bytes(path, config_json.encode())
    log.warning("%s: this run's config differs from the earlier run's in %s; the earlier one is kept as "
                "config.%d.json", workdir, ", ".join(changed), n)
    return changed
