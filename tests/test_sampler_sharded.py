"""The sharded SamplingEngine (issue #13) on 8 fake CPU devices (tests/conftest.py) against the
single-device engine: same seeds -> same tokens, log mu and top-K log mu within 1e-5 (f32), greedy and
sampled, static and continuous batching, shared prefill (n = 2); weights, quantized copies and the KV
cache sharded by the model's logical-axis rules; clear errors for meshes that do not divide.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from pdm_jax import sharding as shd
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import quantize as quant
from pdm_jax.sampler.engine import SamplingEngine, make_sampler_mesh

# 8 heads / 4 kv heads / MLP 64 / vocab 32: all divisible by a 4-way tensor axis.
CFG = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=8)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10], [3, 3, 3, 3, 3, 3, 3]]
GEN = dict(n=2, max_new_tokens=12, top_k_logprobs=5, stop_token_ids=[7, 11], seed=5)
LIMITS = dict(quantization="none", max_prompt_length=16, max_new_tokens=16, max_batch_size=4)


@pytest.fixture(scope="module")
def params():
    """Random weights scaled x5 (the RMSNorm scales stay 1): peaked but not saturated distributions."""
    pure = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0)), nnx.Param))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if jax.tree_util.keystr(path).endswith("['scale']") else x * 5.0, pure)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (conftest)"
    return make_sampler_mesh(data=2, tensor=4)


def _max_abs(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_sharded_engine_equals_single_device(params, mesh, batching):
    """data 2 x tensor 4: tokens, masks, finish reasons and top-K ids equal; log mu / top-K log mu within
    1e-5 (float32; the sharded matmuls sum their partial products in another order). Continuous batching
    runs cache phases of P + 4, 8, 16 slots and parks rows past the first while rows are pending."""
    single = SamplingEngine(CFG, params, batching=batching, **LIMITS)
    sharded = SamplingEngine(CFG, params, batching=batching, mesh=mesh, **LIMITS)
    single.min_cache_phase = sharded.min_cache_phase = 4
    # weights: q_proj kernels [L, embed, heads, head_dim] split over tensor on heads
    leaves = jax.tree_util.tree_leaves_with_path(sharded._state)
    q = [x for p, x in leaves if "q_proj" in jax.tree_util.keystr(p) and x.ndim >= 3][0]
    assert "tensor" in tuple(q.sharding.spec) and q.sharding.mesh == mesh
    for temperature in (0.0, 0.8):
        a = single.generate(PROMPTS, temperature=temperature, **GEN)
        b = sharded.generate(PROMPTS, temperature=temperature, **GEN)
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
        np.testing.assert_array_equal(a.finish_reason, b.finish_reason)
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        assert a.completion_mask.sum() > 0 and len(set(a.completion_mask.sum(1))) > 1  # stops cut some rows
        d_logp, d_topk = _max_abs(a.behavior_logprobs, b.behavior_logprobs), _max_abs(a.topk_logprobs, b.topk_logprobs)
        print(f"{batching} tau={temperature}: max |d log mu| {d_logp:.2e}, max |d top-K log mu| {d_topk:.2e}")
        assert d_logp <= 1e-5 and d_topk <= 1e-5
    assert sharded.prefill_rows < sharded.prefill_rows_unshared  # shared prefill ran (n = 2)
    assert (sharded.parked_rows > 0) == (batching == "continuous"), sharded.parked_rows


def test_sharded_kv_cache_layout(params, mesh):
    """The decode program's KV cache is [B/data, kv_heads/tensor, head_dim, S] per device (keys)."""
    from pdm_jax.sampler.static_batching import _GENERATE_JIT, StaticBatch, StaticShape

    eng = SamplingEngine(CFG, params, mesh=mesh, **LIMITS)
    b, p = 4, 8
    batch = StaticBatch(jnp.zeros((b, p), jnp.int32), jnp.ones((b, p), bool), jnp.zeros((b, 2), jnp.uint32),
                        jnp.zeros((b,), jnp.uint32), jnp.zeros((b,), jnp.uint32), jnp.ones((b,)), jnp.ones((b,)),
                        jnp.zeros((b,), jnp.int32), jnp.full((b,), 16, jnp.int32), jnp.full((b, 4), -1, jnp.int32))
    shape = StaticShape(num_new=16, k_logprobs=5, cache_dtype=jnp.float32, first_segment=64)
    with eng._layout():
        text = _GENERATE_JIT.lower(eng._graphdef, eng._state, batch, shape).compile().as_text()
    s = p + 16
    assert f"f32[{b // 2},{CFG.num_key_value_heads // 4},{CFG.head_dim},{s}]" in text  # keys, sharded
    assert f"f32[{b},{CFG.num_key_value_heads},{CFG.head_dim},{s}]" not in text  # never a whole cache


@pytest.mark.parametrize("quantization,noise", [("bf16", 0), ("fp8", 0), ("int8", 0), ("int4", 0), ("none", 0.1),
                                                ("int4", 0.1)])
def test_sharded_quantized_copy_equals_unsharded(params, mesh, quantization, noise):
    """prepare_sampler_params with shardings: the same values as on one device, placed by the rules; with
    ``weight_noise`` the same draws too (threefry is partitionable: a shard draws its own part of the leaf's),
    scaled by channel RMS values that a sharded reduction sums in another order (float32 rounding; int4: about one
    entry in 10^4 one level away)."""
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0)))
    shardings = nnx.to_pure_dict(shd.param_shardings(nnx.state(model, nnx.Param), mesh))
    kw = dict(compute_dtype=jnp.float32, weight_noise=noise, noise_seed=5)
    one = quant.prepare_sampler_params(params, quantization, **kw)
    many = quant.prepare_sampler_params(params, quantization, shardings=shardings, **kw)
    for (path, x), y, s in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(many),
                               jax.tree.leaves(shardings)):
        if noise and quantization == "none":
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7,
                                       err_msg=jax.tree_util.keystr(path))
        elif noise:  # an entry at a rounding boundary may land one int4 level (channel max / 7.5) away
            a, b = np.asarray(x), np.asarray(y)
            apart = np.abs(a - b) > 1e-5 * np.abs(a).max()
            assert apart.mean() <= 1e-3, (jax.tree_util.keystr(path), apart.mean())
            assert np.abs(a - b).max() <= np.abs(a).max() / 7.5 + 1e-6, jax.tree_util.keystr(path)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
        assert y.sharding == s
    assert any(s.spec != PartitionSpec() for s in jax.tree.leaves(shardings))
    with pytest.raises(ValueError, match="either device or shardings"):
        quant.prepare_sampler_params(params, quantization, shardings=shardings, device=jax.devices()[0])


def test_mesh_errors_name_the_field(params):
    """Heads / kv heads / MLP over tensor and rows over data must divide; bad mesh sizes are named."""
    with pytest.raises(ValueError, match="num_key_value_heads = 4 .* tensor axis \\(8\\)"):
        SamplingEngine(CFG, params, mesh=make_sampler_mesh(data=1, tensor=8), **LIMITS)
    with pytest.raises(ValueError, match="max_batch_size = 4 .* row shards .* 8"):
        SamplingEngine(CFG, params, mesh=make_sampler_mesh(data=8, tensor=1), **LIMITS)
    with pytest.raises(ValueError, match="max_slots = 2 .* row shards"):
        SamplingEngine(CFG, params, mesh=make_sampler_mesh(data=4, tensor=2), batching="continuous", max_slots=2,
                       **dict(LIMITS, max_batch_size=8))
    with pytest.raises(ValueError, match="either device .* or mesh"):
        SamplingEngine(CFG, params, mesh=make_sampler_mesh(data=2), device=jax.devices()[0], **LIMITS)
    with pytest.raises(ValueError, match="16 devices"):
        make_sampler_mesh(data=4, tensor=4)
    with pytest.raises(ValueError, match="tensor must be an integer >= 1"):
        make_sampler_mesh(data=1, tensor=0)
    assert make_sampler_mesh(1, 1) is None  # 1 x 1: the single-device engine


def test_reachable_from_the_config(params, tmp_path):
    """sampler.mesh: validated by name; the colocated engine (SamplerSupervisor.memory_engine) is sharded
    over the first data x tensor local devices; the server takes --mesh_data / --mesh_tensor."""
    import dataclasses

    from pdm_jax.config import get_base_config, validate_config
    from pdm_jax.sampler import server
    from pdm_jax.rollouts.supervisor import SamplerSpec, SamplerSupervisor

    c = get_base_config()
    assert (c.sampler.mesh.data, c.sampler.mesh.tensor) == (1, 1)  # default: the single-device engine
    c.sampler.mesh.tensor = 0
    with pytest.raises(ValueError, match="sampler.mesh.tensor"):
        validate_config(c)
    c.sampler.update(mode="colocated", quantization="fp8", max_prompt_length=16, max_batch_size=4)
    c.sampler.mesh.update(data=2, tensor=2)
    sc = SamplerSpec.from_config(c.sampler)
    sup = SamplerSupervisor(sc, workdir=str(tmp_path), model_config=CFG, max_new_tokens=16)
    eng = sup.memory_engine(params, 1, "fp8").engine
    assert dict(eng.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2} and eng.device is None
    assert set(eng.mesh.devices.flat) == set(jax.local_devices()[:4])  # a sub-mesh of the trainer's devices
    assert all(x.sharding.mesh == eng.mesh for x in jax.tree.leaves(eng._state))
    single = SamplerSupervisor(dataclasses.replace(sc, mesh_data=1, mesh_tensor=1), workdir=str(tmp_path),
                               model_config=CFG, max_new_tokens=16)
    one = single.memory_engine(params, 1, "fp8").engine
    assert one.mesh is None and one.device == jax.local_devices()[0]
    for a, b in zip(jax.tree.leaves(one._state), jax.tree.leaves(eng._state)):  # the same fp8 copy, sharded
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    args = server.parse_args(["--model_config=m.json", "--checkpoint_root=.", "--mesh_data=2", "--mesh_tensor=4"])
    assert (args.mesh_data, args.mesh_tensor) == (2, 4)
    with pytest.raises(SystemExit):
        server.parse_args(["--model_config=m.json", "--checkpoint_root=.", "--mesh_tensor=0"])


@pytest.mark.slow
def test_sharded_server_subprocess_equals_in_process(params, tmp_path):
    """The subprocess server with --mesh_data 2 --mesh_tensor 4 (its own 8 fake devices, inherited
    XLA_FLAGS) and --weight_noise serves the single-device engine's tokens, log mu within 1e-5."""
    import json

    from pdm_jax.sampler import weights as wts
    from pdm_jax.rollouts.launcher import start_sampler_server

    with open(tmp_path / "config.json", "w") as f:
        json.dump(CFG.to_hf_dict(), f)
    path = wts.save_weights(params, str(tmp_path / "weights" / "0"), version=0)
    noise = dict(weight_noise=0.05, weight_noise_seed=9)  # sampler.weight_noise: the same draws on every mesh
    single = SamplingEngine(CFG, params, batching="continuous", **noise, **LIMITS)
    sp = start_sampler_server(model_config=str(tmp_path), weights=path, version=0, quantization="none",
                              checkpoint_root=str(tmp_path), max_prompt_length=16, max_new_tokens=16, max_batch_size=4,
                              batching="continuous", mesh_data=2, mesh_tensor=4, startup_timeout_s=240, **noise)
    try:
        assert sp.client.health()["weight_noise"] == 0.05 and single.health()["weight_noise"] == 0.05
        a = single.generate(PROMPTS, temperature=0.8, **GEN)
        b = sp.client.generate(PROMPTS, temperature=0.8, **GEN)
        plain = SamplingEngine(CFG, params, batching="continuous", **LIMITS).generate(PROMPTS, temperature=0.8, **GEN)
    finally:
        sp.stop()
    assert _max_abs(plain.topk_logprobs, a.topk_logprobs) > 1e-3  # the noise is there
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    assert _max_abs(a.behavior_logprobs, b.behavior_logprobs) <= 1e-5
    assert _max_abs(a.topk_logprobs, b.topk_logprobs) <= 1e-5
