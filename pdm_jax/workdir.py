"""An exclusive lock on a run directory, so that two trainers never write one workdir.

Two trainers on one workdir interleave their checkpoints and metrics (records
duplicated, others lost). `WorkdirLock` takes ``fcntl.flock(LOCK_EX | LOCK_NB)``
on ``WORKDIR/.lock`` and writes the holder's pid, host and start time into it.
The kernel releases a flock when its holder exits, however it exits (SIGKILL
included), so a lock file left by a dead process does not block: it is only a
file, and the next run locks it and overwrites its contents. A second run on a
held workdir gets `WorkdirLockedError` naming the workdir and the holder.

Limits: flock is advisory and per host. On a shared file system (NFS) Linux
emulates it with POSIX byte-range locks, which NFSv4 propagates between hosts;
some FUSE mounts (e.g. gcsfuse) do not propagate locks at all, and there two
hosts can both "hold" the lock. Multi-host runs share one workdir, so only
process 0 locks it (`pdm_jax.trainer.Trainer`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

LOCK_NAME = ".lock"


class WorkdirLockedError(RuntimeError):
    """Another live process holds the workdir's lock.

    Attributes:
      workdir: the absolute run directory.
      holder: the holder's record read from the lock file ({"pid", "host", "started"}), or {} if unreadable.
    """

    def __init__(self, workdir: str, holder: dict):
        self.workdir = workdir
        self.holder = holder
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
               + (f", started {holder['started']}" if holder.get("started") else "")) if holder else "an unknown process"
        super().__init__(
            f"workdir {workdir} is in use by another run ({who}; lock file {os.path.join(workdir, LOCK_NAME)}). "
            "Two trainers on one workdir would duplicate and lose records: stop the other run or choose another "
            "--workdir.")


class WorkdirLock:
    """An exclusive, non-blocking flock on ``WORKDIR/.lock`` (see module docstring).

    Use `acquire` (or the context manager), then `release`; the lock also goes
    away when the process exits or the object is garbage collected.

    Args:
      workdir: the run directory; created if missing.
    """

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, LOCK_NAME)
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock and records this process in the lock file; returns self.

        Raises:
          WorkdirLockedError: another open file description (another process, or
            another `WorkdirLock` in this one) holds the lock.
          OSError: the lock file cannot be created or locked for another reason.
        """
        if self._fd is not None:
            return self
        os.makedirs(self.workdir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
    try:
        with open(os.path.join(os.path.abspath(workdir), LOCK_NAME)) as f:
            rec = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}
