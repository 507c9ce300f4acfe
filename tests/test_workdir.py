"""The workdir lock: one holder at a time, named in the error; a dead holder's lock file does not block."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
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


def test_the_lock_refuses_links_directories_and_a_read_only_workdir(tmp_path):
    """A .lock symlink is never followed (its target is left whole); a directory or an unwritable
    workdir is a ValueError naming the path, not a traceback."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        WorkdirLock(str(run)).acquire()
    assert victim.read_text() == "precious"
    run2 = tmp_path / "run2"
    (run2 / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"\.lock is a directory"):
        WorkdirLock(str(run2)).acquire()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(ValueError, match=r"cannot be created or opened"):
            WorkdirLock(str(ro)).acquire()


def test_run_files_are_written_whole_or_not_at_all(tmp_path):
    """write_bytes (the trainer's summary.json and config.json) replaces a file atomically: a write that
    fails part way leaves the previous file, never a torn one."""
    from pdm_jax import workdir as wd

    path = str(tmp_path / "summary.json")
    wd.write_bytes(path, b'{"old": 1}')

    real_write = wd._write_new

    def failing_write(tmp, data):
        real_write(tmp, data[:4])  # a partial write, then the disk is full
        raise OSError(28, "No space left on device")

    wd._write_new = failing_write
    try:
        with pytest.raises(wd.RunWriteError, match=r"cannot write .*summary.json: ENOSPC"):
            wd.write_bytes(path, b'{"new": 2}')
    finally:
        wd._write_new = real_write
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary left
    # a link planted at the temporary's name is removed, never written through
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    wd.write_bytes(path, b'{"new": 3}')
    assert victim.read_text() == "keep" and json.loads(open(path).read()) == {"new": 3}
    assert not os.path.islink(path)
    wd.write_bytes(path, b'{"old": 1}')
    assert json.loads(open(path).read()) == {"old": 1}
    trainer_src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pdm_jax", "trainer.py")
    assert "atomic=False" not in open(trainer_src).read()  # every run file the trainer writes is atomic


def test_every_writer_of_the_run_names_a_full_disk_and_leaves_no_temporary(small_disk):
    """On a real full file system (the kernel's ENOSPC), each writer of the run raises `RunWriteError` naming its
    file and ENOSPC at once: the run files, the sampler's weights, the checkpoints, the curves, the metrics."""
    import jax
    import jax.numpy as jnp

    from pdm_jax import workdir as wd
    from pdm_jax.checkpointing import Checkpointer
    from pdm_jax.metrics import MetricsWriter, plot_curves
    from flax import nnx

    from conftest import TINY_DENSE
    from pdm_jax.models.qwen3 import Qwen3ForCausalLM
    from pdm_jax.rollouts.vllm_client import export_hf_weights
    from pdm_jax.sampler.weights import save_weights

    tiny_params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(TINY_DENSE, rngs=nnx.Rngs(0)), nnx.Param))
    run = os.path.join(small_disk.root, "run")
    os.makedirs(run)
    state = {"w": jnp.ones((64, 64), jnp.float32)}
    ckpt = Checkpointer(os.path.join(run, "checkpoints"))
    ckpt.save(1, state, {"step": 1})  # room enough before the disk fills
    writer = MetricsWriter(run, tensorboard=True)
    writer.write(1, "rl", {"reward": 0.5})
    small_disk.fill()
    enospc = r"cannot write {}: ENOSPC: No space left on device \(free space"
    writes = {
        os.path.join(run, "summary.json"): lambda: wd.write_bytes(os.path.join(run, "summary.json"), b"{}" * 4096),
        os.path.join(run, "weights", "v000001", "params.safetensors"):
            lambda: save_weights({"w": np.ones((256, 256), np.float32)}, os.path.join(run, "weights", "v000001"),
                                 version=1),
        os.path.join(run, "checkpoints", "2"): lambda: ckpt.save(2, state, {"step": 2}),
        os.path.join(run, "curves.png"):
            lambda: plot_curves([{"step": 1, "phase": "rl", "reward": 0.5}], os.path.join(run, "curves.png")),
        os.path.join(run, "metrics.jsonl"): lambda: writer.write(2, "rl", {"reward": 0.6, "x" * 8192: 1.0}),
        os.path.join(run, "vllm", "v1"):  # the vLLM backend's Hugging Face export
            lambda: export_hf_weights(tiny_params, TINY_DENSE, os.path.join(run, "vllm", "v1")),
    }
    for path, write in writes.items():
        with pytest.raises(wd.RunWriteError, match=enospc.format(re.escape(path))) as e:
            write()
        assert e.value.errno == errno.ENOSPC
    # A disk that fills under the data itself, with room left for the small files: orbax's arrays (tensorstore's
    # ValueError naming the OS error) and the Hugging Face export's tensors (safetensors' own error) are named too.
    small_disk.free()
    small_disk.fill(leave=64 << 10)
    rng = np.random.default_rng(0)
    big = {"w": jnp.asarray(rng.standard_normal((512, 1024), np.float32))}  # 2 MiB that do not compress
    big_params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), tiny_params)  # 82 KB
    writes = {os.path.join(run, "checkpoints", "3"): lambda: ckpt.save(3, big, {"step": 3}),
              os.path.join(run, "vllm", "v2"):
                  lambda: export_hf_weights(big_params, TINY_DENSE, os.path.join(run, "vllm", "v2/"))}
    for path, write in writes.items():
        with pytest.raises(wd.RunWriteError, match=enospc.format(re.escape(path))) as e:
            write()
        assert e.value.errno == errno.ENOSPC
    small_disk.free()
    left = [f for d, _, files in os.walk(run) for f in files if f.endswith(".tmp") or d.endswith(".tmp")]
    assert left == []  # no half-written temporary of the run files or the weights
    assert ckpt.latest_step() == 1  # the failed save is orbax's temporary directory, never a step
    ckpt.close()
    writer.close()


def test_a_resume_with_another_config_keeps_the_earlier_config_json(tmp_path, caplog):
    """`write_run_config`: the same config rewrites nothing; another one keeps the earlier file as config.<n>.json
    (the first free n) and names the changed fields; a torn earlier file is kept too."""
    from pdm_jax.workdir import write_run_config

    wd, first = str(tmp_path), json.dumps({"rl": {"steps": 1, "temperature": 1.0}, "seed": 0}, indent=2)
    assert write_run_config(wd, first) == [] and sorted(os.listdir(wd)) == ["config.json"]
    assert write_run_config(wd, json.dumps(json.loads(first))) == []  # the same values, laid out otherwise
    assert sorted(os.listdir(wd)) == ["config.json"]
    second = json.dumps({"rl": {"steps": 2, "temperature": 1.0}, "seed": 0, "sampler": {"temperature": 1.3}})
    with caplog.at_level("WARNING", logger="pdm_jax.workdir"):
        assert write_run_config(wd, second) == ["rl.steps", "sampler.temperature"]
    assert "differs from the earlier run's in rl.steps, sampler.temperature" in caplog.text
    assert json.loads(open(os.path.join(wd, "config.1.json")).read()) == json.loads(first)
    assert open(os.path.join(wd, "config.json")).read() == second
    with open(os.path.join(wd, "config.json"), "w") as f:
        f.write('{"rl": {"ste')  # torn by a crash
    assert write_run_config(wd, second) == ["<unreadable config.json>"]
    assert open(os.path.join(wd, "config.2.json")).read() == '{"rl": {"ste'
    assert sorted(os.listdir(wd)) == ["config.1.json", "config.2.json", "config.json"]


def _finished_run(root, rl_steps=4, config=None):
    """A workdir as a finished run leaves it (only what `run_finished` and `refuse_changed_config` read)."""
    ckpt = root / "checkpoints" / str(10 + 1 + rl_steps)
    (ckpt / "meta").mkdir(parents=True)
    (ckpt / "meta" / "metadata").write_text(json.dumps({"rl_step": rl_steps, "sft_step": 10}))
    (ckpt / "integrity.json").write_text("{}")
    (root / "summary.json").write_text("{}")
    if config is not None:
        (root / "config.json").write_text(config)


def test_a_finished_run_refuses_another_config_and_keeps_its_config_json(tmp_path):
    """`run_finished` + `refuse_changed_config`: on a finished workdir another config is refused naming each changed
    field with both values, and config.json is not touched; the same values pass; a larger rl.steps is a resume."""
    from pdm_jax.checkpointing import run_finished
    from pdm_jax.workdir import FinishedRunError, refuse_changed_config

    first = json.dumps({"rl": {"steps": 4, "temperature": 1.0}, "trust_region": {"delta": 0.05}}, indent=2)
    assert not run_finished(str(tmp_path), 4)  # nothing there
    _finished_run(tmp_path, rl_steps=4, config=first)
    assert run_finished(str(tmp_path), 4) and run_finished(str(tmp_path), 3) and not run_finished(str(tmp_path), 5)
    refuse_changed_config(str(tmp_path), json.dumps(json.loads(first)))  # the same values: passes
    changed = json.dumps({"rl": {"steps": 4, "temperature": 1.0}, "trust_region": {"delta": 0.1}, "seed": 3})
    with pytest.raises(FinishedRunError, match=r"changes 2 field\(s\) .*\(seed: '<absent>' -> 3; "
                                               r"trust_region.delta: 0.05 -> 0.1\).*new --workdir.*raise rl.steps"):
        refuse_changed_config(str(tmp_path), changed)
    assert (tmp_path / "config.json").read_text() == first and sorted(os.listdir(tmp_path)) == [
        "checkpoints", "config.json", "summary.json"]
    os.remove(tmp_path / "summary.json")  # stopped after its last checkpoint, before the summary: not finished
    assert not run_finished(str(tmp_path), 4)


def test_the_trainer_refuses_another_config_on_a_finished_run_before_any_work(tmp_path):
    """The trainer checks a finished workdir first (no tokenizer, model or compile): an override on it exits 2 in
    the command line (FinishedRunError is a ValueError) and config.json keeps the value the run ran with."""
    from pdm_jax.config import redacted
    from pdm_jax.trainer import Trainer
    from pdm_jax.workdir import FinishedRunError
    from test_trainer import tiny_test_config

    ran = tiny_test_config()
    _finished_run(tmp_path, rl_steps=ran.rl.steps, config=redacted(ran).to_json_best_effort(indent=2))
    with pytest.raises(FinishedRunError, match=r"trust_region.delta: 0.05 -> 0.2"):
        Trainer(tiny_test_config(**{"trust_region.delta": 0.2}), str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["trust_region"]["delta"] == 0.05
    assert not (tmp_path / "tokenizer").exists()  # refused before the tokenizer was built
