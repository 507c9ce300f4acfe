"""Per-host rollouts (pdm_jax.per_host): each process of a multi-process run samples only its share.

* the sampler's ``first_prompt_index`` keys a request's prompts as prompts f.. of a larger
  batch: a share of the prompts draws exactly the whole batch's tokens (static and
  continuous batching, through the wire, and the vLLM backend's per-prompt seeds);
* the group / process layout is checked with an error naming the fields;
* slow: 2 processes x 4 CPU devices (loopback, gloo) with per-host rollouts, colocated
  sampler, run the same RL steps as 1 process x 8 devices: the same global batches (rollouts,
  advantages), losses, mask statistics and evaluations; each process sampled half the prompts.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pdm_jax import distributed, per_host
from pdm_jax.sampler import wire, wire_request
from pdm_jax.sampler.engine import RequestError, SamplingEngine
from pdm_jax.rollouts.vllm_client import VLLMSampler, prompt_seed
from pdm_jax.sampler.vllm_fake import FakeVLLM, create_app, serve_in_thread
from pdm_jax.sampler.weights import save_weights
from pdm_jax.sharding import make_mesh
from conftest import free_port, xla_flags
from tests.test_distributed import wait_all
from tests.test_sampler_engine import CFG, K, make_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "per_host_worker.py")
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 2, 5]]


def _engine(params, batching):
    return SamplingEngine(CFG, params, max_prompt_length=16, max_new_tokens=16, quantization="none",
                          max_batch_size=4, batching=batching)


@pytest.mark.parametrize("batching", ["static", pytest.param("continuous", marks=pytest.mark.slow)])
def test_a_share_of_the_prompts_draws_the_whole_batch_tokens(batching):
    """Prompts 1..2 asked alone with first_prompt_index=1 == rows of prompts 1..2 of the 4-prompt request;
    without the offset they are other draws."""
    engine = _engine(make_params(), batching)
    gen = dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=1.0, seed=11)
    whole = engine.generate(PROMPTS, **gen)
    share = engine.generate(PROMPTS[1:3], first_prompt_index=1, **gen)
    rows = slice(2, 6)
    for name in ("completion_ids", "completion_mask", "topk_ids"):
        t = getattr(share, name).shape[1]
        np.testing.assert_array_equal(getattr(share, name), getattr(whole, name)[rows, :t], err_msg=name)
    t = share.completion_ids.shape[1]
    np.testing.assert_allclose(share.behavior_logprobs, whole.behavior_logprobs[rows, :t], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(share.topk_logprobs, whole.topk_logprobs[rows, :t], rtol=1e-6, atol=1e-6)
    assert list(share.group_ids) == [0, 0, 1, 1]  # group ids stay the request's own
    unkeyed = engine.generate(PROMPTS[1:3], **gen)
    assert not np.array_equal(unkeyed.completion_ids, share.completion_ids)
    with pytest.raises(RequestError, match="first_prompt_index"):
        engine.generate(PROMPTS, first_prompt_index=-1, **gen)
    with pytest.raises(RequestError, match="first_prompt_index"):
        engine.generate(PROMPTS, first_prompt_index=2 ** 32 - 3, **gen)


@pytest.mark.slow
def test_vllm_backend_seeds_a_share_by_its_prompt_indices(tmp_path):
    """VLLMSampler: prompt i of a request with first_prompt_index=1 is sent with prompt 1 + i's seed, so the
    fake vLLM server (our engine behind vLLM's routes) returns the whole request's rows for those prompts."""
    fake = FakeVLLM(weights_root=str(tmp_path), max_prompt_length=16, max_tokens=8, max_logprobs=5)
    url, stop = serve_in_thread(create_app(fake))
    try:
        client = VLLMSampler(url, model_config=CFG, weights_dir=str(tmp_path / "hf"), retries=0)
        save_weights(make_params(), str(tmp_path / "w1"), version=1)
        client.load_weights(str(tmp_path / "w1"), 1)
        gen = dict(n=2, temperature=1.0, max_new_tokens=6, top_k_logprobs=4, seed=99)
        whole = client.generate(PROMPTS, **gen)
        share = client.generate(PROMPTS[1:3], first_prompt_index=1, **gen)
        # one request per prompt, sent concurrently (arrival order varies): prompts 1 and 2's seeds
        assert sorted(r["seed"] for r in fake.requests[-2:]) == sorted(prompt_seed(99, i, 2) for i in (1, 2))
        t = share.completion_ids.shape[1]
        np.testing.assert_array_equal(share.completion_ids, whole.completion_ids[2:6, :t])
        np.testing.assert_allclose(share.behavior_logprobs, whole.behavior_logprobs[2:6, :t], rtol=0, atol=1e-6)
    finally:
        stop()


def test_wire_carries_first_prompt_index():
    req = wire_request.GenerateRequest(prompts=[[1, 2]], n=2, seed=3, first_prompt_index=5)
    body = req.to_wire()
    assert body[wire.FIRST_PROMPT_INDEX] == 5
    assert wire_request.GenerateRequest.from_wire(body).params().first_prompt_index == 5
    plain = wire_request.GenerateRequest(prompts=[[1, 2]], n=2, seed=3).to_wire()
    assert wire.FIRST_PROMPT_INDEX not in plain  # a whole-batch request's body is unchanged
    assert wire_request.GenerateRequest.from_wire(plain).first_prompt_index == 0


def test_host_prompt_range_and_eval_split(monkeypatch):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert per_host.host_prompt_range(4, 4, mesh) == (0, 4)  # one process: every prompt
    monkeypatch.setattr(per_host, "local_batch_rows", lambda n, mesh, axes: slice(n // 2, n))
    assert per_host.host_prompt_range(4, 4, mesh) == (2, 4)  # the second half's prompts
    with pytest.raises(ValueError, match=r"rl.prompts_per_step = 3 x rl.group_size = 4 .*mesh.data = 2 x "
                                         r"mesh.fsdp = 2.*cut a group of 4"):
        per_host.host_prompt_range(3, 4, mesh)  # rows [6, 12): prompt 1 split over two processes
    assert per_host.eval_prompt_range(7) == (0, 7)
    np.testing.assert_array_equal(per_host.gather_ragged(np.arange(14.0), 7, 2), np.arange(14.0))
    batch = dict(x=np.arange(16 * 3, dtype=np.float32).reshape(16, 3), v=np.arange(16, dtype=np.int32))
    glob = per_host.assemble(batch, mesh)
    for rows in ([3, 0, 15, 7, 8, 1, 2, 9], [5, 4, 3]):  # 8 rows split over data x fsdp; 3 replicated
        got = per_host.select_rows(glob, np.array(rows), mesh)
        want = distributed.put_global_batch({k: v[rows] for k, v in batch.items()}, mesh)
        for k in batch:
            np.testing.assert_array_equal(np.asarray(got[k]), batch[k][rows])
            assert got[k].sharding.is_equivalent_to(want[k].sharding, got[k].ndim), k
    assert not per_host.enabled(True, True)  # one process: the single-process path, unchanged


# ---------------------------------------------------------------- 2 processes x 4 devices vs 1 x 8
SMALL = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1",
    "--config.model.num_attention_heads=2", "--config.model.num_key_value_heads=1", "--config.model.head_dim=16",
    "--config.sft.steps=10", "--config.sft.batch_size=32", "--config.rl.steps=3", "--config.rl.prompts_per_step=4",
    "--config.rl.group_size=4", "--config.eval.num_prompts=6", "--config.eval.samples_per_prompt=2",
    "--config.data.num_eval=16", "--config.eval.every_steps=2", "--config.log.progress=False",
    "--config.sampler.mode=colocated", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
    # the second minibatch moves off-policy enough that the mask acts (about 6-8% of the tokens on 1 process)
    "--config.rl.learning_rate=0.01", "--config.trust_region.delta=0.0001",
]


def _launch(workdir, out, devices, env_extra, cache):
    env = dict(os.environ)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), **env_extra)
    return subprocess.Popen([sys.executable, WORKER, workdir, out, f"--config.compile_cache.dir={cache}"] + SMALL,
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {(r["phase"], r["step"]): r for r in recs if r["phase"] in ("rl", "eval")}


DETERMINISTIC = ("loss", "frac_masked", "frac_masked_first_minibatch", "frac_outside", "mean_divergence", "entropy",
                 "grad_norm", "reward", "accuracy", "response_length", "mean_topk_kl", "mean_tail_mass",
                 "staleness", "eval_accuracy", "eval_reward", "eval_greedy_accuracy")


@pytest.mark.slow
def test_two_processes_with_per_host_rollouts_match_one_process(tmp_path):
    port = free_port()
    cache = str(tmp_path / "jax_cache")
    common = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    procs = [_launch(two, two + ".npz", 4, dict(common, JAX_PROCESS_ID="0"), cache),
             _launch(two, two + ".npz", 4, dict(common, JAX_PROCESS_ID="1"), cache),
             _launch(one, one + ".npz", 8, dict(JAX_NUM_PROCESSES="1"), cache)]
    logs = wait_all(procs, timeout=900)
    # Each process sampled its own 2 of the 4 prompts per step (3 steps x 2 prompts x 4 samples); one process all.
    assert "per-host rollouts: process 1 of 2 samples prompts [2, 4)" in logs[1], logs[1][-3000:]
    assert "process 0/2 sampled 6 prompts 24 rows" in logs[0], logs[0][-3000:]
    assert "process 1/2 sampled 6 prompts 24 rows" in logs[1], logs[1][-3000:]
    assert "process 0/1 sampled 12 prompts 48 rows" in logs[2], logs[2][-3000:]
    a, b = np.load(one + ".npz"), np.load(two + ".npz")
    assert set(a.files) == set(b.files) and len([k for k in a.files if k.endswith("/completion_ids")]) == 6
    diffs = {}
    for k in a.files:  # the global batch of every optimizer step: rollouts, advantages, versions
        if a[k].dtype.kind in "biu":
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        else:
            diffs[k.split("/")[1]] = max(diffs.get(k.split("/")[1], 0.0), float(np.max(np.abs(b[k] - a[k]))))
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    ra, rb = _records(one), _records(two)
    assert sorted(ra) == sorted(rb) and ("rl", 3) in ra and ("eval", 2) in ra
    masked = [r["frac_masked"] for (phase, _), r in ra.items() if phase == "rl"]
    assert 0.0 < max(masked) < 1.0, masked
    for key, rec in ra.items():
        for field in DETERMINISTIC:
            if field in rec:
                diffs[field] = max(diffs.get(field, 0.0), abs(rb[key][field] - rec[field]))
                assert rb[key][field] == pytest.approx(rec[field], rel=1e-5, abs=1e-6), (key, field)
    print("largest |2 processes - 1 process|:", json.dumps(diffs, sort_keys=True))
