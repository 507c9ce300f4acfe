"""Workdirs on a bucket (gs://...), against a local GCS stand-in (tests/gcs_standin.py: gcp-storage-emulator).

In this process: orbax checkpoints with CRC32C manifests (damage refused, fallback and
quarantine in the bucket), metrics.jsonl and TensorBoard uploads with resume, curves.png,
weights versions, the file-mode sampler refused. Slow: a 2-process x 2-device run (no warm start:
`sft.steps=0`, the RL phase is what is tested) with its workdir in the bucket is SIGKILLed after RL step 2 and
resumed (process 1, which cannot finish its collectives, is killed with it, as a pod loses a VM); step 3 equals an
uninterrupted 2-process run's, and process 1's checkpoint shards are in the bucket.
"""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gcs_standin  # noqa: E402
from conftest import free_port, xla_flags

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "pdm-standin"


@pytest.fixture(scope="module")
def bucket():
    """The emulator's environment set in this process (restored afterwards); yields ``(env, gcsfs file system)``."""
    import fsspec
    import gcsfs.core

    proc, env = gcs_standin.start_emulator(BUCKET)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when imported (maybe before this module): the plain
    # GCSFileSystem, without the bucket-type probe the emulator cannot answer, serves gs:// here.
    previous = {protocol: fsspec.get_filesystem_class(protocol) for protocol in ("gs", "gcs")}
    for protocol in previous:
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    try:
        yield env, gcsfs.core.GCSFileSystem(use_listings_cache=False)
    finally:
        for protocol, cls in previous.items():
            fsspec.register_implementation(protocol, cls, clobber=True)
        proc.kill()
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _state(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32), "b": jnp.asarray(rng.standard_normal(8)),
            "step": jnp.asarray(seed, jnp.int32)}


@pytest.mark.slow
def test_checkpoints_on_a_bucket_manifest_damage_fallback(bucket):
    from pdm_jax.checkpointing import CheckpointError, Checkpointer, abstract_like

    _, fs = bucket
    root = f"gs://{BUCKET}/ckpt_test/checkpoints"
    ck = Checkpointer(root, max_to_keep=3)
    for step in (1, 2):
        ck.save(step, _state(step), {"rl_step": step})
    assert ck.steps() == [1, 2] and ck.step_path(2) == root + "/2"
    manifest = json.loads(fs.cat_file(f"{BUCKET}/ckpt_test/checkpoints/2/integrity.json"))
    assert manifest["algorithm"] == "crc32c"
    assert "commit_success.txt" in manifest["files"]  # orbax's GCS commit marker (no rename on GCS)
    assert all(v["size"] > 0 or name.endswith(".txt") for name, v in manifest["files"].items())
    state, meta = ck.restore(abstract_like(_state(0)))
    assert meta == {"rl_step": 2}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(2)["w"]))

    # Rewrite one array object of step 2 with other bytes of the same size: refused (crc32c), falls back to 1.
    data_files = [n for n in manifest["files"] if "/d/" in n]
    victim = f"{BUCKET}/ckpt_test/checkpoints/2/{sorted(data_files)[0]}"
    raw = bytearray(fs.cat_file(victim))
    raw[-1] ^= 0xFF
    fs.pipe_file(victim, bytes(raw))
    with pytest.raises(CheckpointError, match="crc32c differs"):
        ck.restore(abstract_like(_state(0)), 2)
    restored = ck.restore_latest_intact(abstract_like(_state(0)))
    assert restored.step == 1 and restored.meta["rl_step"] == 1
    assert restored.fallbacks[0]["refused_step"] == 2
    assert restored.fallbacks[0]["moved_to"] == f"gs://{BUCKET}/ckpt_test/checkpoints.corrupt/2"
    assert ck.steps() == [1]
    assert fs.exists(f"{BUCKET}/ckpt_test/checkpoints.corrupt/2/integrity.json")
    ck.close()


def test_metrics_tensorboard_and_curves_on_a_bucket(bucket):
    from pdm_jax.metrics import MetricsWriter, plot_curves, read_metrics

    _, fs = bucket
    wd = f"gs://{BUCKET}/metrics_test"
    w = MetricsWriter(wd, tensorboard=True)
    for step in (1, 2, 3):
        w.write(step, "rl", {"reward": 0.1 * step, "frac_masked": 0.01, "mean_topk_kl": 0.02})
        # The bucket's copy is complete after every record (one upload each).
        lines = fs.cat_file(f"{BUCKET}/metrics_test/metrics.jsonl").decode().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, step + 1))
    w.write(2, "eval", {"eval_accuracy": 0.5})
    w.close()
    events = fs.ls(f"{BUCKET}/metrics_test/tensorboard", detail=True)
    assert len(events) == 1 and "tfevents" in events[0]["name"] and events[0]["size"] > 100

    w = MetricsWriter(wd, tensorboard=False, resume_from_step=2)  # resumed at RL step 2: records >= 2 dropped
    recs = read_metrics(w.path)
    assert [(r["step"], r["phase"]) for r in recs] == [(1, "rl")]
    w.write(2, "rl", {"reward": 0.7})
    w.close()
    got = [json.loads(x) for x in fs.cat_file(f"{BUCKET}/metrics_test/metrics.jsonl").decode().splitlines()]
    assert [(r["step"], r["reward"]) for r in got] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.7))]

    plot_curves(got, f"gs://{BUCKET}/metrics_test/curves.png")
    assert fs.cat_file(f"{BUCKET}/metrics_test/curves.png")[:8] == b"\x89PNG\r\n\x1a\n"


def test_weights_versions_on_a_bucket(bucket):
    from pdm_jax.sampler.weights import CorruptWeightsError, load_weights, save_weights

    _, fs = bucket
    params = {"layer": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4)}, "bias": np.ones(4, np.float32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    path = f"gs://{BUCKET}/weights_test/weights/v000003"
    assert save_weights(params, path, version=3) == path
    got = load_weights(path, abstract=abstract, version=3)
    np.testing.assert_array_equal(got["layer"]["kernel"], params["layer"]["kernel"])
    raw = bytearray(fs.cat_file(f"{BUCKET}/weights_test/weights/v000003/params.safetensors"))
    raw[-1] ^= 0x01
    fs.pipe_file(f"{BUCKET}/weights_test/weights/v000003/params.safetensors", bytes(raw))
    with pytest.raises(CorruptWeightsError, match="crc32c checksum"):
        load_weights(path, abstract=abstract)


def test_file_sampler_modes_refuse_a_bucket_workdir():
    import dataclasses

    from pdm_jax.config import get_base_config
    from pdm_jax.rollouts.supervisor import SamplerSpec, SamplerSupervisor

    for mode in ("subprocess", "in_process"):
        sc = dataclasses.replace(SamplerSpec.from_config(get_base_config().sampler), mode=mode)
        with pytest.raises(ValueError, match=f"sampler.mode = '{mode}'.*colocated"):
            SamplerSupervisor(sc, workdir="gs://b/run", model_config=None, max_new_tokens=4)


def test_workdir_paths():
    from pdm_jax import workdir as wd

    assert wd.is_remote("gs://b/run") and not wd.is_remote("/tmp/run") and not wd.is_remote("file:///tmp/x")
    assert wd.run_path("gs://b/run/") == "gs://b/run"
    assert wd.run_path("rel") == os.path.abspath("rel")
    assert wd.join("gs://b/run", "checkpoints", "3") == "gs://b/run/checkpoints/3"
    lock = wd.WorkdirLock("gs://b/run").acquire()  # no locks on an object store: a warning, nothing held
    assert not lock.held


# ---------------------------------------------------------------- 2 processes, killed and resumed
SMALL = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1",
    "--config.model.num_attention_heads=2", "--config.model.num_key_value_heads=1", "--config.model.head_dim=16",
    "--config.sft.steps=0", "--config.rl.steps=3", "--config.rl.prompts_per_step=4",
    "--config.rl.group_size=4", "--config.eval.num_prompts=8", "--config.eval.samples_per_prompt=2",
    "--config.data.num_eval=16", "--config.checkpoint.every_steps=1", "--config.eval.every_steps=2",
    "--config.log.progress=False", "--config.sampler.mode=colocated", "--config.distributed=True",
    "--config.mesh.data=2", "--config.mesh.fsdp=2",
]
DETERMINISTIC_KEYS = ("reward", "loss", "frac_masked", "frac_outside", "mean_divergence", "entropy", "grad_norm",
                      "response_length", "mean_tail_mass")


def _run_two(workdir, args, env, logdir, timeout=600):
    """Two processes x 2 CPU devices of ``python -m pdm_jax.train`` on loopback; returns their exit codes."""
    port = free_port()
    procs = []
    for i in range(2):
        e = dict(os.environ, **env)
        e.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2),
                 JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        log = open(os.path.join(logdir, f"{os.path.basename(workdir)}_{len(os.listdir(logdir))}_p{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py",
                                       f"--workdir={workdir}"] + SMALL + args, cwd=REPO, env=e, stdout=log,
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                # A process died (the kill test SIGKILLs process 0, as a lost VM): its peer cannot finish its
                # collectives and would wait for JAX's coordination-service timeout; it is stopped as the
                # rest of a pod would be.
                time.sleep(2)
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def _rl_records(fs, run):
    lines = fs.cat_file(f"{BUCKET}/{run}/metrics.jsonl").decode().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["phase"] == "rl"}


def _tail(logdir):
    return "\n".join(f"== {n}\n" + open(os.path.join(logdir, n)).read()[-2500:] for n in sorted(os.listdir(logdir)))


@pytest.mark.slow
def test_two_process_run_on_the_bucket_killed_and_resumed_exactly(bucket, tmp_path):
    env, fs = bucket
    logs = tmp_path / "logs"
    logs.mkdir()
    cache = [f"--config.compile_cache.dir={tmp_path / 'jax_cache'}"]
    codes = _run_two(f"gs://{BUCKET}/full", cache, env, str(logs))
    assert codes == [0, 0], _tail(logs)
    ref = _rl_records(fs, "full")
    assert sorted(ref) == [1, 2, 3]
    assert json.loads(fs.cat_file(f"{BUCKET}/full/summary.json"))["steps"] == 3
    assert fs.exists(f"{BUCKET}/full/curves.png") and fs.exists(f"{BUCKET}/full/config.json")
    # Every host wrote its own shards of the multi-host checkpoint into the bucket.
    last = max(int(n.rsplit("/", 1)[-1]) for n in fs.ls(f"{BUCKET}/full/checkpoints") if n[-1].isdigit())
    objects = fs.find(f"{BUCKET}/full/checkpoints/{last}")
    assert any("/ocdbt.process_0/" in o for o in objects) and any("/ocdbt.process_1/" in o for o in objects)
    manifest = json.loads(fs.cat_file(f"{BUCKET}/full/checkpoints/{last}/integrity.json"))
    assert manifest["algorithm"] == "crc32c" and any("ocdbt.process_1/" in n for n in manifest["files"])

    codes = _run_two(f"gs://{BUCKET}/killed", cache + ["--config.debug.kill_after_rl_step=2"], env, str(logs))
    assert codes[0] == -9, (codes, _tail(logs))  # process 0 SIGKILLed itself after RL step 2
    assert sorted(_rl_records(fs, "killed")) == [1, 2]
    codes = _run_two(f"gs://{BUCKET}/killed", cache, env, str(logs))  # the same command again: resumes
    assert codes == [0, 0], _tail(logs)
    got = _rl_records(fs, "killed")
    assert sorted(got) == [1, 2, 3]
    for s in (1, 2, 3):
        for k in DETERMINISTIC_KEYS:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-6), (s, k)
    assert not os.path.exists(os.path.join(REPO, "gs:"))  # nothing went to a local "gs:" directory
