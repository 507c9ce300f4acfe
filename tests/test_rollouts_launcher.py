"""`pdm_jax.rollouts.launcher`: starting a sampler subprocess, over stand-in processes (a few lines of Python, no
server): one that dies at start-up is named with its exit code and output (its log kept for a post-mortem), the
token travels in the environment, not on the command line, and one that never answers /health is stopped at the
deadline with nothing left behind. (The real server started through it: tests/test_sampler_server.py.)"""

import os
import sys
import tempfile

import pytest

from pdm_jax.rollouts.launcher import SamplerProcess, SamplerStartupError
from conftest import free_port

DIES = ("import os, sys; print('argv', sys.argv[1:], 'token', os.environ.get('PDM_SAMPLER_TOKEN'), file=sys.stderr); "
        "sys.exit(3)")
# Writes its pid and, atomically, a port nothing listens on to the --port_file it is given; then waits.
HANGS = ("import os, sys, time; port_file = sys.argv[-1].split('=', 1)[1]; "
         "open({pid_file!r}, 'w').write(str(os.getpid())); "
         "open(port_file + '.tmp', 'w').write('{port}'); os.rename(port_file + '.tmp', port_file); time.sleep(120)")


def test_a_server_that_dies_at_start_up_is_named_with_its_output_and_its_log_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the process's pdm_sampler_* directory lands here
    with pytest.raises(SamplerStartupError, match="sampler server exited with code 3 before writing its port file; "
                                                  "output tail:") as e:
        SamplerProcess([sys.executable, "-c", DIES], host="127.0.0.1", token="s3cret", startup_timeout_s=60)
    msg = str(e.value)
    assert "argv ['--port_file=" in msg and msg.count("s3cret") == 1 and "token s3cret" in msg  # env, not argv
    logs = list(tmp_path.glob("pdm_sampler_*/server.log"))
    assert len(logs) == 1 and "token s3cret" in logs[0].read_text()


def test_a_server_that_never_answers_health_is_stopped_at_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid_file = str(tmp_path / "pid")
    with pytest.raises(SamplerStartupError, match="sampler server not answering /health after 1 s"):
        SamplerProcess([sys.executable, "-c", HANGS.format(pid_file=pid_file, port=free_port())], host="127.0.0.1",
                       token=None, startup_timeout_s=1.0)
    with open(pid_file) as f:
        pid = int(f.read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
    assert list(tmp_path.glob("pdm_sampler_*")) == []  # its temporary directory removed
