"""`pdm_jax.train`: the command line. A config override that names no field or does not parse exits 2 with the
config error, as every other config error does."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_override_of_an_unknown_field_is_a_named_config_error():
    out = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", "--config.rl.foo=1",
                          "--workdir=/nonexistent/never-created"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    assert "config error: rl.foo: unknown config field" in out.stderr
    assert "AttributeError" not in out.stderr


def test_cli_override_bad_value_exit_code():
    out = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", "--config.rl.steps=abc",
                          "--workdir=/nonexistent/never-created"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "config error: rl.steps must be an integer, got 'abc'" in out.stderr
    assert "FATAL" not in out.stderr


def test_cli_argument_string_typo_is_a_named_config_error():
    """A bad key or value in ``--config=FILE:ARG`` exits 2 naming it, as a ``--config.`` override does (absl's own
    flag parsing exited 1 with a traceback)."""
    for arg, message in (("dleta=0.1", "config argument 'dleta': unknown field 'dleta'"),
                         ("delta=abc", "delta")):
        out = subprocess.run([sys.executable, "-m", "pdm_jax.train", f"--config=configs/tiny.py:{arg}",
                              "--workdir=/nonexistent/never-created"], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.startswith("config error: ") and message in out.stderr, out.stderr[-2000:]
        assert "FATAL" not in out.stderr and "Traceback" not in out.stderr


def test_distributed_with_a_bad_initialization_timeout_is_a_named_config_error():
    """``distributed=True`` reads ``multihost.initialization_timeout_s`` before validate_config (which needs the
    devices): a bad value is still a config error, exit 2, before any use."""
    out = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py",
                          "--config.distributed=True", "--config.multihost.initialization_timeout_s=-1",
                          "--workdir=/nonexistent/never-created"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("config error: multihost.initialization_timeout_s = -1: must be a finite number"), \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def _fake_checkpoint(root, step, meta, complete=True):
    """A checkpoint directory as orbax + the manifest leave it (only what `last_saved` reads)."""
    d = root / "checkpoints" / str(step)
    (d / "meta").mkdir(parents=True)
    (d / "meta" / "metadata").write_text(json.dumps(meta))
    if complete:
        (d / "integrity.json").write_text("{}")


def test_interrupted_note_names_the_last_complete_checkpoint_and_the_command(tmp_path):
    from pdm_jax.train import interrupted_note

    args = ["--config=configs/tiny.py:seed=2", f"--workdir={tmp_path}", "--config.rl.steps=50"]
    note = interrupted_note(str(tmp_path), args)
    assert "no checkpoint was saved yet" in note and note.endswith(
        f"python -m pdm_jax.train --config=configs/tiny.py:seed=2 --workdir={tmp_path} --config.rl.steps=50")
    _fake_checkpoint(tmp_path, 700, dict(rl_step=0, sft_step=700, warmstart=None))
    assert "checkpoint is 700 (the warm start (SFT step 700), before its evaluation)" in interrupted_note(
        str(tmp_path), args)
    _fake_checkpoint(tmp_path, 701, dict(rl_step=0, sft_step=700, warmstart={"eval_accuracy": 0.5}))
    assert "checkpoint is 701 (the evaluated warm start" in interrupted_note(str(tmp_path), args)
    _fake_checkpoint(tmp_path, 713, dict(rl_step=12, sft_step=700, warmstart={"eval_accuracy": 0.5}))
    _fake_checkpoint(tmp_path, 714, dict(rl_step=13), complete=False)  # being written when interrupted: not kept
    note = interrupted_note(str(tmp_path), args)
    assert f"checkpoint is 713 (RL step 12), in {tmp_path / 'checkpoints' / '713'}" in note, note
    assert note.endswith("--config.rl.steps=50")


@pytest.mark.slow
def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path):
    """SIGINT (Ctrl-C) to a running trainer: exit 130 with the last checkpoint and the resume command, no
    KeyboardInterrupt traceback."""
    from pdm_jax.checkpointing import last_saved
    from conftest import xla_flags
    from test_trainer import SMALL

    workdir = tmp_path / "run"
    args = ["--config=configs/tiny.py", f"--workdir={workdir}"] + SMALL + [
        "--config.rl.steps=10000", "--config.sampler.mode=in_process", "--config.eval.every_steps=100000",
        f"--config.compile_cache.dir={tmp_path / 'cache'}"]
    p = subprocess.Popen([sys.executable, "-m", "pdm_jax.train"] + args, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, XLA_FLAGS=xla_flags()))
    try:
        deadline = time.time() + 600
        while time.time() < deadline and p.poll() is None:
            saved = last_saved(str(workdir / "checkpoints"))
            if saved is not None and saved.meta.get("rl_step", 0) >= 1:
                break
            time.sleep(0.5)
        assert p.poll() is None, p.communicate()[1][-4000:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-4000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    saved = last_saved(str(workdir / "checkpoints"))
    assert f"interrupted: the last checkpoint is {saved.step} (RL step {saved.meta['rl_step']})" in err, err[-3000:]
    assert ("Resume from it with the same command:\n  python -m pdm_jax.train " + " ".join(args)) in err


def test_a_ctrl_c_during_a_checkpoint_save_is_held_back_until_it_is_written():
    """`deferred_interrupt` (around `Checkpointer.save`): SIGINT inside the body does not interrupt it; it is raised
    as KeyboardInterrupt when the body is done, and the previous handler is back."""
    from pdm_jax.checkpointing import deferred_interrupt

    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs between bytecodes: the body goes on
            done.append(True)
    assert done == [True] and signal.getsignal(signal.SIGINT) is before
    with deferred_interrupt():  # no signal: nothing raised
        done.append(True)
    assert done == [True, True]
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C interrupts the body at once
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append(True)
    assert done == [True, True] and signal.getsignal(signal.SIGINT) is before
