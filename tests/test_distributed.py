"""Multi-host support: 2 processes x 4 CPU devices give the same loss and gradients as 1 x 8.

The slow test launches tests/distributed_worker.py three times on loopback:
two processes of one jax.distributed run (gloo CPU collectives, 4 fake CPU
devices each) and one single-process reference with 8 fake devices.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdm_jax import distributed
from pdm_jax.config import get_base_config
from pdm_jax.run_spec import initialize_distributed, multihost_spec
from pdm_jax.sharding import make_mesh
from conftest import free_port, xla_flags

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(out, devices, env_extra):
    env = dict(os.environ)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **env_extra)
    return subprocess.Popen([sys.executable, WORKER, out], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_all(procs, timeout):
    """Each process's combined output once all have exited (any still running after a failure is killed)."""
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, logs):
        assert p.returncode == 0, out[-4000:]
    return logs


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    port = free_port()
    common = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    two = str(tmp_path / "two.npz")
    one = str(tmp_path / "one.npz")
    procs = [_launch(two, 4, dict(common, JAX_PROCESS_ID="0")),
             _launch(two, 4, dict(common, JAX_PROCESS_ID="1")),
             _launch(one, 8, dict(JAX_NUM_PROCESSES="1"))]
    logs = wait_all(procs, timeout=240)
    assert "process 1/2 rows 4:8" in logs[1], logs[1][-2000:]  # process 1 fed the second half only
    a, b = np.load(one), np.load(two)
    assert int(a["process_count"]) == 1 and int(b["process_count"]) == 2
    assert list(b["rows"]) == [0, 4] and list(a["rows"]) == [0, 8]
    assert set(a.files) == set(b.files)
    grads = [k for k in a.files if k.startswith("grad/")]
    assert len(grads) > 10
    assert 0.0 < float(a["aux/frac_masked"]) < 1.0
    for k in a.files:
        if k in ("rows", "process_count"):
            continue
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The packed step (plan from the gathered masks, rows over the mesh) gives the padded step's loss and gradient.
    assert 0.0 < float(a["packed_fill"]) < 1.0
    np.testing.assert_allclose(a["packed_loss"], a["loss"], rtol=1e-5, atol=1e-6)
    for k in grads:
        np.testing.assert_allclose(a["packed_" + k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_settings_from_config_and_env():
    mh = multihost_spec(get_base_config())  # the schema's defaults: "", 0, -1, "": all from the environment
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    s = distributed.settings_from(mh, env)
    assert (s.coordinator_address, s.num_processes, s.process_id, s.local_device_ids) == ("10.0.0.1:1234", 4, 3, None)
    mh = dataclasses.replace(mh, coordinator_address="host:99", process_id=1, local_device_ids="0,1")
    s = distributed.settings_from(mh, env)
    assert (s.coordinator_address, s.num_processes, s.process_id, s.local_device_ids) == ("host:99", 4, 1, (0, 1))
    empty = distributed.settings_from(multihost_spec(get_base_config()), {})
    assert empty.coordinator_address is None and empty.num_processes is None  # left to auto-detection
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        distributed.settings_from(multihost_spec(get_base_config()), {"JAX_NUM_PROCESSES": "x"})
    with pytest.raises(ValueError, match="process_id"):
        distributed.DistributedSettings(num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator_address"):
        distributed.DistributedSettings(coordinator_address="nohostport")
    with pytest.raises(ValueError, match="cpu_collectives"):
        distributed.DistributedSettings(cpu_collectives="nccl")
    assert initialize_distributed(get_base_config()) is False  # distributed = False: nothing started

    def timeout(t):
        return dataclasses.replace(multihost_spec(get_base_config()), initialization_timeout_s=t)

    for bad in (0, -5, float("inf"), float("nan"), "60", True):  # named before any use
        with pytest.raises(ValueError, match=r"multihost.initialization_timeout_s = .*: must be a finite number of "
                                             r"seconds > 0"):
            distributed.settings_from(timeout(bad), env)
    assert distributed.settings_from(timeout(0.5), env).initialization_timeout_s == 1  # whole s, never 0
    assert distributed.settings_from(timeout(60), env).initialization_timeout_s == 60


def test_single_process_batch_feeding_equals_device_put():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert distributed.local_batch_rows(8, mesh) == slice(0, 8)
    with pytest.raises(ValueError, match="not divisible"):
        distributed.local_batch_rows(6, mesh)
    arrays = dict(x=np.arange(8 * 3, dtype=np.float32).reshape(8, 3), odd=np.arange(3), s=np.float32(2.0))
    out = distributed.put_global_batch(arrays, mesh)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    assert out["x"].sharding.spec[0] == ("data", "fsdp")
    assert out["odd"].sharding.is_fully_replicated
    assert {s.data.shape for s in out["x"].addressable_shards} == {(2, 3)}
    assert float(jax.jit(lambda x: jnp.sum(x))(out["x"])) == float(arrays["x"].sum())
    assert distributed.is_primary()
