"""Mesh construction, logical-axis rules, parameter sharding and sharded forward on 8 CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pdm_jax import sharding as shd
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, init_model

# Sizes divisible by 2 on every sharded axis: D=32, N=4, K=2, F=48, V=64.
CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=10_000.0)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py must set 8 fake CPU devices"
    return shd.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def model():
    m = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    # O(1) weights so that sharding errors would show in the logits.
    state = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * (1.0 if x.ndim == 1 else 30.0), state))
    return m


def test_make_mesh_and_mesh_config():
    m = shd.make_mesh(data=2, fsdp=-1, tensor=2)
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert m.axis_names == shd.MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    assert shd.MeshConfig(fsdp=1, tensor=-1).axis_sizes(8) == (1, 1, 8)
    assert dict(shd.MeshConfig(data=-1, fsdp=2, tensor=1).make_mesh().shape) == {
        "data": 4, "fsdp": 2, "tensor": 1}
    with pytest.raises(ValueError, match="only one axis"):
        shd.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="not divisible"):
        shd.make_mesh(data=3, fsdp=-1)
    with pytest.raises(ValueError, match="tensor"):
        shd.make_mesh(tensor=0)
    with pytest.raises(ValueError, match="!= 8 devices"):
        shd.make_mesh(data=2, fsdp=2, tensor=1)


def test_logical_to_spec_rules(mesh):
    rules = shd.DEFAULT_RULES
    assert shd.logical_to_spec(("embed", "heads", "head_dim"), rules) == P("fsdp", "tensor",
                                                                            None)
    assert shd.logical_to_spec(("batch", "length", "embed"), rules) == P(("data", "fsdp"),
                                                                        None, None)
    # A mesh axis is used once: vocab and heads both want "tensor".
    assert shd.logical_to_spec(("vocab", "heads"), rules) == P("tensor", None)
    # Non-dividing axes are dropped when mesh and shape are known.
    assert shd.logical_to_spec(("kv_heads", "embed"), rules, mesh, (3, 32)) == P(None, "fsdp")
    assert shd.logical_to_spec(("batch",), rules, mesh, (2,)) == P("data")
    assert shd.logical_to_spec(("batch",), rules, mesh, (4,)) == P(("data", "fsdp"))
    with pytest.raises(ValueError, match="experts"):
        shd.logical_to_spec(("experts",), rules)
    with pytest.raises(ValueError, match="rank"):
        shd.logical_to_spec(("embed",), rules, mesh, (2, 2))


def test_param_partition_specs_cover_every_param(model, mesh):
    specs = dict(nnx.to_flat_state(shd.param_partition_specs(model, mesh=mesh)))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert specs.keys() == params.keys()
    want = {
        ("embed_tokens", "embedding"): P("tensor", "fsdp"),
        ("lm_head", "kernel"): P("fsdp", "tensor"),
        ("norm", "scale"): P(None),
        # stacked layer params: a leading, never sharded layer axis
        ("layers", "self_attn", "q_proj", "kernel"): P(None, "fsdp", "tensor", None),
        ("layers", "self_attn", "k_proj", "kernel"): P(None, "fsdp", "tensor", None),
        ("layers", "self_attn", "o_proj", "kernel"): P(None, "tensor", None, "fsdp"),
        ("layers", "self_attn", "q_norm", "scale"): P(None, None),
        ("layers", "mlp", "gate_proj", "kernel"): P(None, "fsdp", "tensor"),
        ("layers", "mlp", "down_proj", "kernel"): P(None, "tensor", "fsdp"),
    }
    for path, spec in want.items():
        assert specs[path] == spec, path
    # 2 kv heads on a 4-way tensor axis: replicated instead of an error.
    mesh4 = shd.make_mesh(data=1, fsdp=2, tensor=4)
    specs4 = dict(nnx.to_flat_state(shd.param_partition_specs(model, mesh=mesh4)))
    assert specs4[("layers", "self_attn", "k_proj", "kernel")] == P(None, "fsdp", None, None)
    assert specs4[("layers", "self_attn", "q_proj", "kernel")] == P(None, "fsdp", "tensor", None)


def test_shard_model_places_params_and_forward_matches(model, mesh):
    ids = np.random.RandomState(0).randint(0, CFG.vocab_size, (4, 6)).astype(np.int32)
    mask = np.ones((4, 6), bool)
    mask[1, :2] = False
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, attention_mask=m))
    want = np.asarray(fwd(state, ids, mask))

    sharded = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    shd.shard_model(sharded, mesh)
    q = sharded.layers.self_attn.q_proj.kernel.get_value()
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (CFG.num_hidden_layers, 16, 2, 8)
    emb = sharded.embed_tokens.embedding.get_value()
    assert emb.sharding.spec == P("tensor", "fsdp")
    assert emb.addressable_shards[0].data.shape == (32, 16)
    down = sharded.layers.mlp.down_proj.kernel.get_value()
    assert down.sharding.spec == P(None, "tensor", "fsdp")
    assert sharded.norm.scale.get_value().sharding.spec == P(None)

    s_graphdef, s_state = nnx.split(sharded)
    with shd.activation_sharding(mesh):
        fwd_s = jax.jit(lambda st, i, m: nnx.merge(s_graphdef, st)(i, attention_mask=m))
        got = fwd_s(s_state, ids, mask)
    assert got.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert np.abs(want).max() > 1.0


def test_sharded_decode_matches_unsharded(model, mesh):
    rng = np.random.RandomState(1)
    ids = rng.randint(0, CFG.vocab_size, (4, 5)).astype(np.int32)
    pos = np.tile(np.arange(5, dtype=np.int32), (4, 1))
    kv_mask = np.zeros((4, 8), bool)
    kv_mask[:, :5] = True
    graphdef, state = nnx.split(model)
    dec = jax.jit(lambda st, *a: nnx.merge(graphdef, st).decode(*a))
    want, _ = dec(state, ids, pos, model.init_cache(4, 8), jnp.int32(0), kv_mask)
    s_state = jax.device_put(state, shd.param_shardings(state, mesh))
    cache = model.init_cache(4, 8)
    specs = shd.kv_cache_specs(cache, mesh=mesh)
    assert specs.k[0] == P(("data", "fsdp"), "tensor", None, None)
    assert specs.v[0] == P(("data", "fsdp"), "tensor", None, None)
    cache = jax.device_put(
        cache, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P)))
    with shd.activation_sharding(mesh):
        got, new_cache = dec(s_state, ids, pos, cache, jnp.int32(0), kv_mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert jax.tree.map(jnp.shape, new_cache) == jax.tree.map(jnp.shape, cache)
    assert new_cache.k[0].sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, specs.k[0]), 4)  # the cache stays sharded


def test_constrain_is_noop_without_mesh():
    x = jnp.ones((4, 3))
    assert shd.constrain(x, ("batch", "embed")) is x


@pytest.mark.slow
def test_init_model_directly_sharded(mesh):
    m = init_model(CFG, seed=0, mesh=mesh)
    k = m.layers.self_attn.k_proj.kernel.get_value()
    assert k.sharding.spec == P(None, "fsdp", "tensor", None)
    ref = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(k), np.asarray(
        ref.layers.self_attn.k_proj.kernel.get_value()), atol=1e-7)


def test_custom_rules_with_use_rules(model, mesh):
    rules = tuple((k, None) if k == "batch" else (k, v) for k, v in shd.DEFAULT_RULES)
    with shd.use_rules(rules):
        assert shd.active_rules() == rules
    assert shd.active_rules() == shd.DEFAULT_RULES
    specs = dict(nnx.to_flat_state(shd.param_partition_specs(model, rules, mesh)))
    assert specs[("layers", "mlp", "up_proj", "kernel")] == P(None, "fsdp", "tensor")
