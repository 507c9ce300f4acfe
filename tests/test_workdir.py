"""The workdir lock: one holder at a time, named in the error; a dead holder's lock file does not block."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pdm_jax.workdir import LOCK_NAME, WorkdirLock, WorkdirLockedError, read_holder

HOLD = """
import sys, time
from pdm_jax.workdir import WorkdirLock
lock = WorkdirLock(sys.argv[1]).acquire()
print("LOCKED", flush=True)
time.sleep(120)
"""


def test_second_lock_is_refused_with_the_holder_named(tmp_path):
    a = WorkdirLock(str(tmp_path)).acquire()
    rec = read_holder(str(tmp_path))
    assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
    with pytest.raises(WorkdirLockedError, match=rf"workdir {tmp_path} is in use by another run \(pid {os.getpid()} "
                                                 rf"on host {socket.gethostname()}") as e:
        WorkdirLock(str(tmp_path)).acquire()
    assert e.value.holder["pid"] == os.getpid()
    a.release()
    assert read_holder(str(tmp_path)) == {}  # cleared on release
    with WorkdirLock(str(tmp_path)) as b:  # free again
        assert b.held
    assert not b.held


def test_lock_held_by_another_process_then_freed_when_it_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "LOCKED"
        with pytest.raises(WorkdirLockedError, match=f"pid {proc.pid} "):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        proc.kill()
        proc.wait()
    # SIGKILL: the holder never released, its record is still in the file, yet the lock is free.
    assert read_holder(str(tmp_path))["pid"] == proc.pid
    lock = WorkdirLock(str(tmp_path)).acquire()
    assert read_holder(str(tmp_path))["pid"] == os.getpid()
    lock.release()


def test_stale_lock_file_of_a_dead_pid_does_not_block(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps(dict(pid=dead.pid, host=socket.gethostname(), started="earlier")))
    t0 = time.time()
    lock = WorkdirLock(str(tmp_path)).acquire()
    assert time.time() - t0 < 1.0
    assert read_holder(str(tmp_path))["pid"] == os.getpid()
    lock.release()


def test_garbage_in_the_lock_file_does_not_block_or_crash(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"\xff\x00not json")
    assert read_holder(str(tmp_path)) == {}
    with WorkdirLock(str(tmp_path)):
        with pytest.raises(WorkdirLockedError):
            WorkdirLock(str(tmp_path)).acquire()
