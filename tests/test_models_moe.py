"""Qwen3-MoE: config, the sparse MoE block (ragged_dot vs dense one-hot reference), the
router load-balancing loss (vs a numpy re-implementation of transformers'
``load_balancing_loss_func`` and, with torch, that function itself), HF I/O and parity
with the committed transformers reference (``scripts/make_qwen3_moe_reference.py``)."""
import dataclasses
import functools

import numpy as np
import pytest

from pdm_jax.models.qwen3 import Qwen3Config

from conftest import jit_method

TINY_MOE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12)


def _hf_moe_dict(**overrides):
    d = Qwen3Config(**TINY_MOE).to_hf_dict()
    d.update(overrides)
    return d


# ------------------------------------------------------------------------------ config


def test_config_round_trip_and_hf_names():
    cfg = Qwen3Config(**TINY_MOE, norm_topk_prob=True, router_aux_loss_coef=0.01)
    d = cfg.to_hf_dict()
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert Qwen3Config.from_hf_dict(d) == cfg and cfg.is_moe
    # transformers 5 writes the expert count as num_local_experts (its attribute_map).
    d2 = dict(d)
    d2["num_local_experts"] = d2.pop("num_experts")
    assert Qwen3Config.from_hf_dict(d2) == cfg
    # Absent MoE fields take Qwen3MoeConfig's defaults.
    d3 = {k: v for k, v in d.items() if k not in ("router_aux_loss_coef", "norm_topk_prob",
                                                   "mlp_only_layers", "decoder_sparse_step")}
    got = Qwen3Config.from_hf_dict(d3)
    assert (got.router_aux_loss_coef, got.norm_topk_prob, got.mlp_only_layers,
            got.decoder_sparse_step) == (0.001, False, (), 1)
    # The dense model is unchanged: num_experts 0, model_type qwen3.
    dense = Qwen3Config(**{**TINY_MOE, "num_experts": 0})
    assert not dense.is_moe and dense.to_hf_dict()["model_type"] == "qwen3"
    assert "num_experts" not in dense.to_hf_dict()


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", -1, "num_experts"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
    ("num_experts_per_tok", 5, "num_experts_per_tok must be <= num_experts = 4"),
    ("moe_intermediate_size", 0, "moe_intermediate_size"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
    ("norm_topk_prob", 1, "norm_topk_prob"),
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef"),
    ("router_aux_loss_coef", float("nan"), "router_aux_loss_coef"),
    ("mlp_only_layers", [2], "mlp_only_layers"),
    ("mlp_only_layers", [0, 0], "mlp_only_layers"),
    ("mlp_only_layers", [-1], "mlp_only_layers"),
])
def test_config_bad_moe_fields_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf_dict(_hf_moe_dict(**{field: value}))


@pytest.mark.parametrize("fields,sparse", [
    (dict(decoder_sparse_step=2, num_hidden_layers=5), [1, 3]),
    (dict(mlp_only_layers=[0, 2], num_hidden_layers=4), [1, 3]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=4), [1]),
])
def test_config_mixed_layers_plan(fields, sparse):
    """HF's rule (layer i sparse iff i not in mlp_only_layers and (i+1) % decoder_sparse_step
    == 0) and where each layer lives: sparse layers in stack 0, dense-MLP layers in stack 1."""
    cfg = Qwen3Config.from_hf_dict(_hf_moe_dict(**fields))
    L = cfg.num_hidden_layers
    assert [i for i in range(L) if cfg.is_sparse_layer(i)] == sparse
    assert cfg.is_moe and cfg.is_mixed
    assert cfg.stack_layer_ids(0) == tuple(sparse)
    assert cfg.stack_layer_ids(1) == tuple(i for i in range(L) if i not in sparse)
    assert [cfg.stack_layer_ids(s)[r] for s, r in cfg.layer_plan] == list(range(L))
    assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert not Qwen3Config(**TINY_MOE).is_mixed


def test_config_all_dense_moe_family_and_errors():
    # Every layer in mlp_only_layers: a dense model (the MoE fields unused).
    cfg = Qwen3Config.from_hf_dict(_hf_moe_dict(mlp_only_layers=[0, 1]))
    assert not cfg.is_moe and not any(cfg.is_sparse_layer(i) for i in range(2))
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(model_type="qwen3"))
    with pytest.raises(ValueError, match="num_local_experts"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(num_local_experts=8))
    with pytest.raises(ValueError, match="model_type"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(model_type="qwen2_moe"))
    assert dataclasses.replace(Qwen3Config(**TINY_MOE), mlp_only_layers=[]).mlp_only_layers == ()


# ------------------------------------------------------------------------------ model

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from pdm_jax.models import moe as moe_lib  # noqa: E402
from pdm_jax.models.qwen3 import Qwen3MoeForCausalLM, init_model  # noqa: E402


@functools.partial(jax.jit, static_argnums=(0, 1))
def _o1_draw(paths, seed, values):
    keys = jax.random.split(jax.random.key(seed), len(values))
    out = []
    for k, path, v in zip(keys, paths, values):
        if path[-1] == "scale":
            out.append(1.0 + 0.2 * jax.random.normal(k, v.shape, v.dtype))
            continue
        fan_in = v.shape[-3] if "experts" in path else v.shape[-2] if v.ndim >= 2 else 1
        if path[-2] in ("o_proj",):
            fan_in = v.shape[-3] * v.shape[-2]
        out.append(jax.random.normal(k, v.shape, v.dtype) / np.sqrt(fan_in))
    return out


def _o1_weights(model, seed=3):
    """Re-draws every parameter at O(1) scale (init's N(0, 0.02) routes almost uniformly,
    a weak test); norms near 1. One compiled program per model shape for all the draws
    (drawn op by op, they built a few dozen small programs)."""
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    values = _o1_draw(tuple(path for path, _ in flat), seed, [var.get_value() for _, var in flat])
    for (_, var), value in zip(flat, values):
        var.set_value(value)
    nnx.update(model, state)
    return model


def _inputs(B=3, T=7, V=64, seed=1):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 0, V)
    mask = jnp.ones((B, T), jnp.int32).at[0, :2].set(0).at[1, -1].set(0)
    return ids, mask


@pytest.mark.slow
# Each implementation costs a forward + backward program. norm_topk_prob on an all-sparse model is left out: the
# mixed model's sparse layers run the same routing with norm_topk_prob (it only rescales the top-k weights, whatever
# the other layers are), and the all-sparse stack is the first case's. The blocked implementation is checked on the
# all-sparse model only: it replaces the grouped matmul inside the MoE block, which is the same block in a mixed
# model (the dense-MLP layers never reach it), and test_blocked_gmm_equals_ragged_dot checks the matmul alone.
@pytest.mark.parametrize("norm_topk_prob,fields", [
    (False, {}), (True, dict(num_hidden_layers=3, mlp_only_layers=(1,)))])
def test_ragged_dot_equals_dense_reference_forward_and_grads(norm_topk_prob, fields):
    cfg = Qwen3Config(**{**TINY_MOE, **fields}, norm_topk_prob=norm_topk_prob)
    model = _o1_weights(init_model(cfg, seed=0))
    assert isinstance(model, Qwen3MoeForCausalLM)
    ids, mask = _inputs()
    graphdef, state = nnx.split(model)
    probe = jax.random.normal(jax.random.key(9), (3, 7, 64))

    def loss(state, impl):
        m = nnx.merge(graphdef, state)
        m.set_compute_options(moe_implementation=impl)
        logits, aux = m(ids, attention_mask=mask, return_aux=True)
        return jnp.sum(logits * probe) + 10.0 * aux, (logits, aux)

    impls = ("dense", "ragged_dot") + (() if cfg.is_mixed else ("blocked",))

    @jax.jit  # every implementation in one program (they share the embedding and the first attention)
    def values_and_grads(state):
        return {impl: jax.value_and_grad(loss, has_aux=True)(state, impl) for impl in impls}

    got = {impl: (logits, aux, grads) for impl, ((_, (logits, aux)), grads) in values_and_grads(state).items()}
    (l_d, a_d, g_d), (l_r, a_r, g_r) = got["dense"], got["ragged_dot"]
    if "blocked" in got:
        l_b, a_b, g_b = got["blocked"]
        np.testing.assert_allclose(l_b, l_r, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(a_b, a_r, atol=1e-6)
        flat_r = dict(nnx.to_flat_state(g_r))
        for path, g in nnx.to_flat_state(g_b):
            want_g = np.asarray(flat_r[path].get_value())
            np.testing.assert_allclose(g.get_value(), want_g, rtol=0, atol=1e-5 * max(1.0, np.abs(want_g).max()),
                                       err_msg="blocked " + "/".join(map(str, path)))
    assert float(jnp.abs(l_d).max()) > 1.0  # O(1) logits: not a flat, trivially equal output
    np.testing.assert_allclose(l_r, l_d, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(a_r, a_d, atol=1e-6)
    flat_d = dict(nnx.to_flat_state(g_d))
    for path, g in nnx.to_flat_state(g_r):
        # 1e-5 relative to the gradient's scale (entries reach ~50: sums over B*T*V terms).
        want_g = np.asarray(flat_d[path].get_value())
        np.testing.assert_allclose(g.get_value(), want_g, rtol=0,
                                   atol=1e-5 * max(1.0, np.abs(want_g).max()),
                                   err_msg="/".join(map(str, path)))
    # The expert kernels and the router do get gradient (routing weights are differentiable).
    assert float(jnp.abs(flat_d[("layers", "mlp", "gate", "kernel")].get_value()).max()) > 1e-3
    if cfg.is_mixed:  # ... and so do the dense-MLP layers' kernels
        assert float(jnp.abs(flat_d[("dense_layers", "mlp", "up_proj", "kernel")].get_value()).max()) > 1e-3


# Every case has M = 36 rows (the groups plus the extra rows) and takes its sizes as an argument: the four
# programs (ragged_dot and three blockings, values and gradients) are built once for the three cases.
@pytest.mark.parametrize("sizes,extra_rows", [
    ((5, 0, 17, 1, 0, 13), 0),      # empty groups, a group spanning blocks
    ((0, 0, 33, 0, 0, 0), 3),       # one group; rows past the groups give zeros
    ((6, 6, 6, 6, 6, 6), 0)])
@pytest.mark.slow
def test_blocked_gmm_equals_ragged_dot_values_and_grads(sizes, extra_rows):
    """`moe.blocked_gmm` == ``jax.lax.ragged_dot`` (the XLA reference), forward and both gradients."""
    sizes_E = jnp.asarray(sizes, jnp.int32)
    M, E, A, C = sum(sizes) + extra_rows, len(sizes), 12, 10
    assert M == _GMM_ROWS
    lhs = jax.random.normal(jax.random.key(0), (M, A))
    rhs = jax.random.normal(jax.random.key(1), (E, A, C))
    probe = jax.random.normal(jax.random.key(2), (M, C))
    want, (gl_w, gr_w) = _gmm_values_and_grads(None, None)(lhs, rhs, sizes_E, probe)
    for block_rows, per_step in ((8, 1), (8, 3), (128, 8)):
        got, (gl, gr) = _gmm_values_and_grads(block_rows, per_step)(lhs, rhs, sizes_E, probe)
        assert float(jnp.abs(want).max()) > 1.0
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(gl, gl_w, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(gr, gr_w, atol=1e-5, rtol=1e-5)
    if extra_rows:
        np.testing.assert_array_equal(np.asarray(got[-extra_rows:]), 0.0)


_GMM_ROWS = 36


@functools.lru_cache(maxsize=None)
def _gmm_values_and_grads(block_rows, per_step):
    """Values and both gradients (against a probe) of ``jax.lax.ragged_dot`` (block_rows None) or
    `moe.blocked_gmm`, one compiled program taking (lhs, rhs, group sizes, probe)."""
    def f(a, b, sizes):
        if block_rows is None:
            return jax.lax.ragged_dot(a, b, sizes)
        return moe_lib.blocked_gmm(a, b, sizes, block_rows=block_rows, blocks_per_step=per_step)

    @jax.jit
    def values_and_grads(a, b, sizes, probe):
        return f(a, b, sizes), jax.grad(lambda a, b: jnp.sum(f(a, b, sizes) * probe), argnums=(0, 1))(a, b)

    return values_and_grads


def test_moe_auto_resolves_by_target_platform(monkeypatch):
    """``auto``: megablox for TPU (dims % 128), blocked for GPU, ragged_dot elsewhere."""
    from pdm_jax import sharding as shd
    from pdm_jax.models import moe

    for platform, dims, want in (("tpu", (256, 128), "megablox"), ("tpu", (64, 128), "ragged_dot"),
                                 ("gpu", (64, 48), "blocked"), ("cpu", (256, 128), "ragged_dot")):
        monkeypatch.setattr(shd, "target_platform", lambda p=platform: p)
        assert moe.resolve_implementation("auto", hidden_size=dims[0], moe_intermediate_size=dims[1]) == want


def test_megablox_interpret_equals_dense():
    """megablox gmm (Pallas; interpret mode off TPU) gives the dense reference's logits."""
    model = _o1_weights(init_model(Qwen3Config(**TINY_MOE), seed=0))
    ids, mask = _inputs()
    want = jit_method(model.set_compute_options(moe_implementation="dense"))(ids, attention_mask=mask)
    got = jit_method(model.set_compute_options(moe_implementation="megablox"))(ids, attention_mask=mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_scan_unrolled_remat_and_decode_agree():
    model = _o1_weights(init_model(Qwen3Config(**TINY_MOE), seed=0))
    ids, mask = _inputs()
    forward = jit_method(model, return_aux=True)  # (the default options: scan, no remat)
    ref, aux = forward(ids, attention_mask=mask)
    for opts in (dict(scan_layers=False), dict(scan_layers=True, remat="full")):
        model.set_compute_options(**opts)
        got, got_aux = jit_method(model, return_aux=True)(ids, attention_mask=mask)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_aux, aux, atol=1e-6)
    model.set_compute_options(scan_layers=True, remat="none")
    # Prefill through the KV cache = the training forward (right-padded rows only).
    full = jnp.ones_like(mask)
    want, _ = forward(ids, attention_mask=full)  # the first program again (same shapes)
    cache = model.init_cache(3, 7)
    positions = jnp.broadcast_to(jnp.arange(7), (3, 7))
    got, _ = jit_method(model, "decode")(ids, positions, cache, 0, full.astype(bool))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


MIXED_MOE = dict(TINY_MOE, num_hidden_layers=3, mlp_only_layers=(1,))  # 0, 2 sparse; 1 dense


@pytest.mark.slow
def test_mixed_model_forward_paths_decode_and_routing_agree():
    """A mixed sparse/dense model: ragged_dot == the dense one-hot reference, remat and the
    (ignored) scan option change nothing, prefill through the KV cache == the forward, the
    routing is -1 at the dense-MLP layer and replaying it reproduces the logits."""
    cfg = Qwen3Config(**MIXED_MOE)
    model = _o1_weights(init_model(cfg, seed=0))
    assert model.dense_layers.mlp.gate_proj.kernel.get_value().shape == (1, 16, 24)
    assert model.layers.mlp.experts.gate_proj.kernel.get_value().shape == (2, 4, 16, 12)
    ids, mask = _inputs()
    full = jnp.ones_like(mask)
    ref, ref_aux = jit_method(model.set_compute_options(moe_implementation="dense"), return_aux=True)(
        ids, attention_mask=full)
    model.set_compute_options(moe_implementation="ragged_dot")
    got, aux, routed = jit_method(model.set_compute_options(scan_layers=True, remat="full"), return_aux=True,
                                  return_routing=True)(ids, attention_mask=full)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(aux, ref_aux, rtol=1e-6)
    routed = np.asarray(routed)
    assert routed.shape == (3, 7, 3, 2) and np.all(routed[:, :, 1] == -1)
    assert np.all(routed[:, :, [0, 2]] >= 0)
    replayed = jit_method(model)(ids, attention_mask=full, routed_experts=routed)
    np.testing.assert_allclose(replayed, ref, atol=1e-5, rtol=1e-5)
    cache = model.init_cache(3, 8)
    positions = jnp.broadcast_to(jnp.arange(7), (3, 7))
    got, _, dec_routed = jit_method(model, "decode", return_routing=True)(
        ids, positions, cache, 0, jnp.arange(8)[None].repeat(3, 0) < 7)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(dec_routed, routed)


def test_moe_implementation_option_checked():
    model = init_model(Qwen3Config(**TINY_MOE), seed=0)
    with pytest.raises(ValueError, match="moe_implementation"):
        model.set_compute_options(moe_implementation="gmm")


@pytest.mark.slow
def test_dense_model_aux_is_zero_and_unchanged():
    cfg = Qwen3Config(**{**TINY_MOE, "num_experts": 0})
    model = init_model(cfg, seed=0)
    ids, mask = _inputs()
    logits, aux = jit_method(model, return_aux=True)(ids, attention_mask=mask)
    assert float(aux) == 0.0
    np.testing.assert_array_equal(logits, jit_method(model)(ids, attention_mask=mask))


# ------------------------------------------------------------------------------ aux loss


def _np_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask=None):
    """numpy transcription of transformers 5.24 ``load_balancing_loss_func`` (Qwen3-MoE)."""
    tokens = np.zeros(num_experts)
    probs_sum = np.zeros(num_experts)
    rows = 0.0
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1).astype(np.float64)
    for layer in gate_logits:
        z = layer - layer.max(-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
        w = np.ones(len(p)) if flat_mask is None else flat_mask
        for k in range(top_k):
            np.add.at(tokens, top[:, k], w)
        probs_sum += (p * w[:, None]).sum(0)
        rows += w.sum()
    return num_experts * np.sum((tokens / rows) * (probs_sum / rows))


def _moe_lib_loss(gate_logits, top_k, mask=None):
    return float(_moe_lib_loss_program(gate_logits, top_k, mask))


@functools.partial(jax.jit, static_argnums=1)  # one program (op by op, some twenty small ones)
def _moe_lib_loss_program(gate_logits, top_k, mask):
    sums = None
    for layer in gate_logits:
        _, experts, probs = moe_lib.route(jnp.asarray(layer), top_k, False)
        s = moe_lib.load_balancing_stats(probs, experts, None if mask is None
                                         else jnp.asarray(mask).reshape(-1))
        sums = s if sums is None else tuple(a + b for a, b in zip(sums, s))
    return moe_lib.load_balancing_loss(*sums)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_numpy_transformers_formula(masked):
    rng = np.random.RandomState(0)
    E, K, B, T = 6, 2, 3, 5
    logits = [2.0 * rng.randn(B * T, E).astype(np.float32) for _ in range(3)]
    mask = (rng.rand(B, T) > 0.3).astype(np.int32) if masked else None
    want = _np_load_balancing_loss(logits, E, K, mask)
    assert abs(want - K) > 0.05  # an unbalanced router: not the balanced value K
    np.testing.assert_allclose(_moe_lib_loss(logits, K, mask), want, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_transformers_function(masked):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    rng = np.random.RandomState(1)
    E, K, B, T = 6, 2, 3, 5
    logits = [2.0 * rng.randn(B * T, E).astype(np.float32) for _ in range(3)]
    mask = (rng.rand(B, T) > 0.3).astype(np.int64) if masked else None
    want = float(load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), E, K,
                                          None if mask is None else torch.tensor(mask)))
    np.testing.assert_allclose(_moe_lib_loss(logits, K, mask), want, rtol=1e-5)
    np.testing.assert_allclose(_np_load_balancing_loss(logits, E, K, mask), want, rtol=1e-5)


@pytest.mark.parametrize("fields", [{}, dict(num_hidden_layers=3, mlp_only_layers=(1,))])
def test_model_aux_loss_is_the_formula_on_its_router_logits(fields):
    """The model's aux loss == the numpy formula on router logits recomputed layer by layer
    (a mixed model: the sparse layers' router logits only, as transformers)."""
    cfg = Qwen3Config(**{**TINY_MOE, **fields})
    model = _o1_weights(init_model(cfg, seed=0))
    ids, mask = _inputs()
    # Router logits per layer: run the unrolled layers by hand (one compiled program, not one per operation).
    from pdm_jax.models import attention as attn_lib
    from pdm_jax.models.qwen3 import default_positions, layer_slice
    stacks = [nnx.split(m) for m in (model.layers, model.dense_layers) if m is not None]

    @jax.jit
    def aux_and_gate_logits(ids, mask):
        _, aux = model(ids, attention_mask=mask, return_aux=True)
        x = model._embed(ids)
        amask = attn_lib.SelfAttentionMask(key_valid=mask, segment_ids=None)
        pos = default_positions(ids, mask)
        gate_logits = []
        for i, (stack, row) in enumerate(cfg.layer_plan):
            layer = nnx.merge(stacks[stack][0], layer_slice(stacks[stack][1], row))
            h = x + layer.self_attn(layer.input_layernorm(x), pos, amask)[0]
            if cfg.is_sparse_layer(i):
                gate_logits.append(layer.mlp.gate(layer.post_attention_layernorm(h).reshape(-1, cfg.hidden_size)))
            x = layer(x, pos, amask)[0]
        return aux, gate_logits

    aux, gate_logits = aux_and_gate_logits(ids, mask)
    gate_logits = [np.asarray(g) for g in gate_logits]
    assert len(gate_logits) == len(cfg.stack_layer_ids(0))
    want = _np_load_balancing_loss(gate_logits, cfg.num_experts, cfg.num_experts_per_tok,
                                   np.asarray(mask))
    np.testing.assert_allclose(float(aux), want, rtol=1e-5)


# ------------------------------------------------------------------------------ HF I/O

import os  # noqa: E402
import re  # noqa: E402

from pdm_jax import sharding as shd  # noqa: E402
from pdm_jax.models import from_pretrained, hf_io, save_pretrained  # noqa: E402

MOE_REF_DIR = os.path.join(os.path.dirname(__file__), "data", "qwen3_moe_reference")


# case -> (norm_topk_prob, the sparse layers)
MOE_REF_CASES = {"hub_layout": (False, (0, 1)), "fused_layout": (True, (0, 1)),
                 "sparse_step_2": (True, (1, 3)), "mlp_only_layers": (False, (0, 2))}


@pytest.mark.parametrize("case", list(MOE_REF_CASES))
@pytest.mark.slow
def test_committed_moe_reference_parity(case):
    """Logits and router aux loss of transformers' Qwen3MoeForCausalLM (committed by
    scripts/make_qwen3_moe_reference.py): hub per-expert layout and transformers 5's fused
    layout, top-2 with and without norm_topk_prob, GQA/MQA, tied/untied, and mixed
    sparse/dense-MLP layers (decoder_sparse_step = 2; mlp_only_layers = [1])."""
    path = os.path.join(MOE_REF_DIR, case)
    ref = np.load(os.path.join(path, "reference.npz"))
    model = from_pretrained(path, dtype=jnp.float32)
    norm_topk_prob, sparse = MOE_REF_CASES[case]
    assert model.config.is_moe and model.config.norm_topk_prob == norm_topk_prob
    assert model.config.stack_layer_ids(0) == sparse
    assert (model.dense_layers is None) == (len(sparse) == model.config.num_hidden_layers)
    real = ref["attention_mask"].astype(bool)
    for impl in ("ragged_dot", "dense"):
        logits, aux = jit_method(model.set_compute_options(moe_implementation=impl), return_aux=True)(
            ref["input_ids"], positions=ref["position_ids"], attention_mask=ref["attention_mask"])
        assert np.abs(np.asarray(logits) - ref["logits"])[real].max() <= 1e-4, impl
        np.testing.assert_allclose(float(aux), float(ref["aux_loss"]), rtol=1e-5)
    assert np.abs(ref["logits"][real]).max() > 1.0  # not trivially flat


@pytest.mark.slow
def test_mixed_moe_hf_io_sharding_quantization_and_counts(tmp_path):
    """A mixed model (layers 0, 2 sparse; 1 dense-MLP): HF names per layer kind, a bit-exact
    save/load round trip, a missing dense tensor named, the dense stack's partition specs,
    fp8 scales per (layer, output channel) and the parameter counts in closed form."""
    from pdm_jax.models import presets
    from pdm_jax.sampler import quantize as q
    cfg = Qwen3Config(**MIXED_MOE)
    model = _o1_weights(init_model(cfg, seed=0))
    sd = hf_io.hf_state_dict(model)
    dense_gate = np.asarray(model.dense_layers.mlp.gate_proj.kernel.get_value())  # [1, D, F]
    np.testing.assert_array_equal(sd["model.layers.1.mlp.gate_proj.weight"], dense_gate[0].T)
    up = np.asarray(model.layers.mlp.experts.up_proj.kernel.get_value())  # [2, E, D, I]
    np.testing.assert_array_equal(sd["model.layers.2.mlp.experts.3.up_proj.weight"], up[1, 3].T)
    np.testing.assert_array_equal(  # row 0 of dense_layers is layer 1
        sd["model.layers.1.input_layernorm.weight"],
        model.dense_layers.input_layernorm.scale.get_value()[0])
    assert "model.layers.1.mlp.gate.weight" not in sd and "model.layers.0.mlp.up_proj.weight" not in sd
    save_pretrained(model, str(tmp_path))
    back = from_pretrained(str(tmp_path))
    assert back.config == cfg
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                              nnx.to_flat_state(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(p))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj"):
        hf_io.load_hf_state_dict(back, {k: v for k, v in sd.items()
                                        if k != "model.layers.1.mlp.down_proj.weight"})
    specs = dict(nnx.to_flat_state(shd.param_partition_specs(model, mesh=shd.make_mesh(
        data=2, fsdp=2, tensor=2))))
    P = jax.sharding.PartitionSpec
    assert specs[("dense_layers", "mlp", "gate_proj", "kernel")] == P(None, "fsdp", "tensor")
    assert specs[("layers", "mlp", "experts", "gate_proj", "kernel")] == P(None, "fsdp", None, "tensor")
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    got = q.prepare_sampler_params(pure, "fp8", compute_dtype=jnp.float32)
    w = np.asarray(pure["dense_layers"]["mlp"]["down_proj"]["kernel"], np.float32)  # [1, F, D]
    import ml_dtypes
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(448.0)
    want = (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    np.testing.assert_allclose(got["dense_layers"]["mlp"]["down_proj"]["kernel"], want, rtol=1e-6)
    D, F, I, E, k = 16, 24, 12, 4, 2  # noqa: E741 (I: the MLP's intermediate size)
    sparse_cfg = Qwen3Config(**{**MIXED_MOE, "mlp_only_layers": ()})
    assert presets.count_params(cfg) == (presets.count_params(sparse_cfg)
                                         - (D * E + E * 3 * D * I) + 3 * D * F)
    assert presets.count_params(cfg) - presets.count_params(cfg, active=True) == 2 * (E - k) * 3 * D * I


@pytest.mark.slow
def test_moe_save_load_round_trip_hub_names(tmp_path):
    model = _o1_weights(init_model(Qwen3Config(**TINY_MOE), seed=0))
    files = save_pretrained(model, str(tmp_path), max_shard_size="6KB")
    assert len(files) > 1  # sharded with an index
    import json
    names = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    back = from_pretrained(str(tmp_path))
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                              nnx.to_flat_state(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(p))
    # HF per-expert tensors in HF's [out, in] layout.
    sd = hf_io.hf_state_dict(model)
    kernel = np.asarray(model.layers.mlp.experts.gate_proj.kernel.get_value())  # [L,E,D,I]
    np.testing.assert_array_equal(sd["model.layers.1.mlp.experts.2.gate_proj.weight"],
                                  kernel[1, 2].T)
    router = np.asarray(model.layers.mlp.gate.kernel.get_value())  # [L, D, E]
    np.testing.assert_array_equal(sd["model.layers.0.mlp.gate.weight"], router[0].T)
    # A fused (transformers 5 save_original_format=False) dict loads to the same model.
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        fused[pre + "gate_up_proj"] = np.stack([np.concatenate(
            [sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]]) for e in range(4)])
        fused[pre + "down_proj"] = np.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(4)])
    other = init_model(Qwen3Config(**TINY_MOE), seed=5)
    hf_io.load_hf_state_dict(other, fused)
    np.testing.assert_array_equal(other.layers.mlp.experts.up_proj.kernel.get_value(),
                                  model.layers.mlp.experts.up_proj.kernel.get_value())
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.0"):
        hf_io.load_hf_state_dict(other, {k: v for k, v in sd.items()
                                         if k != "model.layers.0.mlp.experts.0.up_proj.weight"})


def test_moe_sharded_load_and_expert_parallel_forward():
    """Expert kernels sharded over the expert axis (logical 'expert' -> fsdp) on 8 fake CPU
    devices: each device reads its own experts, and the sharded forward (logits and aux loss)
    equals the unsharded one."""
    path = os.path.join(MOE_REF_DIR, "hub_layout")
    ref = np.load(os.path.join(path, "reference.npz"))
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = from_pretrained(path, mesh=mesh)
    plain = from_pretrained(path)
    kernel = sharded.layers.mlp.experts.gate_proj.kernel.get_value()  # [L, E=4, D, I]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None, "tensor")
    assert {tuple(s.data.shape) for s in kernel.addressable_shards} == {(2, 2, 16, 6)}
    args = (ref["input_ids"], ref["position_ids"], ref["attention_mask"])
    want, want_aux = jit_method(plain, return_aux=True)(*args)
    graphdef, state = nnx.split(sharded)

    @jax.jit
    def fwd(state, ids, pos, mask):
        return nnx.merge(graphdef, state)(ids, pos, mask, return_aux=True)

    with shd.activation_sharding(mesh):
        got, got_aux = fwd(state, *args)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_aux, want_aux, rtol=1e-6)
    # transformers 5's fused layout, expert width split over tensor = 4: the same values.
    fused = os.path.join(MOE_REF_DIR, "fused_layout")
    a = from_pretrained(fused, mesh=shd.make_mesh(data=1, fsdp=2, tensor=4))
    b = from_pretrained(fused)
    assert a.layers.mlp.experts.down_proj.kernel.get_value().sharding.spec == \
        jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a, nnx.Param)),
                              nnx.to_flat_state(nnx.state(b, nnx.Param))):
        np.testing.assert_array_equal(x.get_value(), y.get_value(), err_msg=str(p))


def test_blocked_experts_split_width_over_tensor_axis():
    """``blocked`` under a mesh whose ``tensor`` axis splits the expert width (the rollout engine's): each device
    multiplies its slice of I and the partial outputs are summed; values and gradients equal the unsharded dense
    reference, and the compiled program all-gathers no expert kernel (it reduces [N, D] outputs instead)."""
    N, D, E, I, K = 16, 8, 4, 12, 2  # noqa: E741
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (N, D))
    gate, up = (jax.random.normal(k, (E, D, I)) for k in keys[1:3])
    down = jax.random.normal(keys[3], (E, I, D))
    weights, experts = moe_lib.route(jax.random.normal(keys[4], (N, E)), K, True)[:2]
    probe = jax.random.normal(jax.random.key(4), (N, D))

    def loss(impl, x, gate, up, down):
        y = moe_lib.experts(x, weights, experts, gate, up, down, dtype=jnp.float32, implementation=impl)
        return jnp.sum(y * probe), y

    want_grads, want = jax.grad(functools.partial(loss, "dense"), argnums=(0, 1, 2, 3), has_aux=True)(
        x, gate, up, down)
    mesh = shd.make_mesh(data=2, fsdp=1, tensor=4)
    assert moe_lib._split_width_axes(shd.logical_to_spec(("batch", None), shd.DEFAULT_RULES, mesh, (N, D)),
                                     shd.DEFAULT_RULES, mesh, gate.shape) == ("tensor",)
    step = jax.jit(jax.grad(functools.partial(loss, "blocked"), argnums=(0, 1, 2, 3), has_aux=True))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tensor"))  # as the engine's
    gate, up = jax.device_put(gate, split), jax.device_put(up, split)
    down = jax.device_put(down, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor", None)))
    with shd.activation_sharding(mesh):
        grads, got = step(x, gate, up, down)
        hlo = step.lower(x, gate, up, down).compile().as_text()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    assert "all-reduce" in hlo
    assert not re.search(r"f32\[4,(8,12|12,8)\][^\n]*all-gather", hlo)  # no kernel gathered whole


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob,layers", [
    (False, {}), (True, {}),
    (True, dict(num_hidden_layers=4, decoder_sparse_step=2)),  # sparse 1, 3; dense 0, 2
    (False, dict(num_hidden_layers=3, mlp_only_layers=[0])),  # sparse 1, 2; dense 0
])
def test_live_torch_moe_parity(tmp_path, norm_topk_prob, layers):
    """transformers Qwen3MoeForCausalLM -> save_pretrained -> pdm_jax.models.from_pretrained
    (logits within 1e-4 in f32, aux loss), and our save -> transformers load; all-sparse and
    mixed sparse/dense-MLP layers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(11)
    # Widths are multiples of 4 floats: the grouped-mm experts of a transformers model
    # loaded by from_pretrained need 16-byte strides (torch._grouped_mm).
    hf_config = transformers.Qwen3MoeConfig(
        **{"num_hidden_layers": 2, **layers},
        vocab_size=40, hidden_size=24, intermediate_size=36,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_experts=5,
        num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=norm_topk_prob,
        rope_parameters={"rope_type": "default", "rope_theta": 3_000.0},
        tie_word_embeddings=False, attn_implementation="eager")
    hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.ndim >= 2 else 1.0)
                    + (1.0 if p.ndim == 1 else 0.0))
    hf_model.save_pretrained(tmp_path / "hf")
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 40, (2, 11))
    mask = np.ones((2, 11), np.int64)
    mask[0, :4] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0) + 17
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
              position_ids=torch.tensor(positions), output_router_logits=True)
    with torch.no_grad():
        out = hf_model(**kw)
    want = out.logits.numpy()
    ours = from_pretrained(str(tmp_path / "hf"), dtype=jnp.float32)
    assert ours.config.is_mixed == bool(layers)
    got, aux = ours(ids, positions, mask, return_aux=True)
    assert np.abs(np.asarray(got) - want)[mask.astype(bool)].max() <= 1e-4
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    save_pretrained(ours, str(tmp_path / "ours"), max_shard_size="8KB")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        again = back(**kw).logits.numpy()
    assert np.abs(again - want)[mask.astype(bool)].max() <= 1e-5


# ------------------------------------------------------------------------------ run config


def test_run_config_moe_implementation_reaches_the_model():
    from pdm_jax.config import get_base_config, validate_config
    from pdm_jax.sections import compute_options
    c = get_base_config()
    assert compute_options(c.model)["moe_implementation"] == "ragged_dot"
    c.model.moe_implementation = "dense"
    model = init_model(Qwen3Config(**TINY_MOE), seed=0, **compute_options(c.model))
    assert model.moe_implementation == "dense"
    c.model.moe_implementation = "gmm"
    with pytest.raises(ValueError, match="model.moe_implementation"):
        validate_config(c)
