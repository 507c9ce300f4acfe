"""`pdm_jax.train`: the command line. A config override that names no field or does not parse exits 2 with the
config error, as every other config error does."""

import os
import subprocess
import sys

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
