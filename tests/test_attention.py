"""Attention kernels (pdm_jax/models/attention.py) and remat against the dense reference, f32 on CPU.

The dense path is the model's original attention: its logits and gradients are compared
bit for bit with values recorded before the move; every other kernel is compared with it
(GQA, left/right padding, segment ids, causal; forward and gradients) at 1e-5.
"""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM, default_positions
from pdm_jax.models import attention as attn_lib

# ----------------------------------------------------------------------------- dense path unchanged

REF_PATH = os.path.join(os.path.dirname(__file__), "data", "dense_attention_reference.npz")
REF_CONFIG = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_theta=10_000.0)
REF_MASK = np.ones((3, 10), bool)
REF_MASK[0, :4] = False
REF_MASK[1, :1] = False


def _abstract_model(config, **kwargs):
    """``Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), **kwargs)`` with abstract weights (shapes and dtypes only;
    `_ref_params` gives every weight its value): no initialiser is compiled."""
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), **kwargs))


def _ref_params(model, dtype):
    """The model's (graphdef, state) with O(1) random weights (a fixed function of the shapes).

    The values are drawn per layer, in the order of the per-layer parameter layout the
    recorded reference was made with (``layers.{i}.<name>``), then stacked into the model's
    ``layers.<name>`` [L, ...] parameters: the same weights as before the layers were stacked.
    """
    graphdef, state = nnx.split(model)
    flat = [(tuple(p), v.get_value()) for p, v in nnx.to_flat_state(state)]
    per_layer = []  # (old path, shape)
    for p, x in flat:
        if p[0] == "layers":
            per_layer += [(("layers", i) + p[1:], x.shape[1:]) for i in range(x.shape[0])]
        else:
            per_layer.append((p, x.shape))
    per_layer.sort(key=lambda e: [(0, k) if isinstance(k, int) else (1, k) for k in e[0]])
    layout = tuple((p, x.shape[0] if p[0] == "layers" else None) for p, x in flat)
    new = _ref_values(tuple(per_layer), layout, dtype)
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == len(new)
    return graphdef, jax.tree.unflatten(treedef, new)


@functools.partial(jax.jit, static_argnames=("per_layer", "layout", "dtype"))
def _ref_values(per_layer, layout, dtype):
    """`_ref_params`'s values, drawn and stacked in one compiled program per (layout, dtype) instead of each draw,
    scaling and stack compiled op by op (the same random bits and arithmetic: a function of the shapes).
    per_layer: ((per-layer path, shape), ...) in drawing order; layout: ((model path, L or None), ...)."""
    keys = jax.random.split(jax.random.key(11), len(per_layer))
    values = {p: (jax.random.normal(k, shape) * (1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[0]))
                  + (1.0 if len(shape) == 1 else 0.0)).astype(dtype)
              for k, (p, shape) in zip(keys, per_layer)}
    return [jnp.stack([values[("layers", i) + p[1:]] for i in range(n)]) if n is not None else values[p]
            for p, n in layout]


def dense_reference_case(dtype, **model_kwargs):
    """Logits [3,10,V] and parameter gradients of a fixed random left-padded case.

    The loss is the mask-weighted mean log-partition of the logits. ``REF_PATH`` holds this
    function's logits and a SHA-256 of its gradients' bytes, for f32 and bf16, computed
    with the model code of commit 23eb6c8 (before attention moved to
    ``pdm_jax/models/attention.py``) on XLA:CPU, jax 0.10.2.
    """
    model = _abstract_model(REF_CONFIG, dtype=dtype, param_dtype=dtype, **model_kwargs)
    graphdef, state = _ref_params(model, dtype)
    ids = np.random.RandomState(0).randint(0, REF_CONFIG.vocab_size, (3, 10)).astype(np.int32)

    def loss(st):
        logits = nnx.merge(graphdef, st)(ids, attention_mask=REF_MASK)
        return (jax.nn.logsumexp(logits, -1) * REF_MASK).sum() / REF_MASK.sum(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return np.asarray(logits, np.float32), [np.asarray(g.astype(jnp.float32))
                                            for g in _per_layer_leaves(grads)]


def _per_layer_leaves(state):
    """The leaves of a stacked-layout state in the order of the per-layer layout (each
    ``layers.<name>`` [L, ...] leaf split into its L rows, sorted as ``layers.{i}.<name>``)."""
    rows = []
    for p, v in nnx.to_flat_state(state):
        p, x = tuple(p), v.get_value() if isinstance(v, nnx.Variable) else v
        rows += ([(("layers", i) + p[1:], x[i]) for i in range(x.shape[0])] if p[0] == "layers"
                 else [(p, x)])
    rows.sort(key=lambda e: [(0, k) if isinstance(k, int) else (1, k) for k in e[0]])
    return [x for _, x in rows]


@pytest.mark.parametrize("name,dtype", [("f32", jnp.float32), ("bf16", jnp.bfloat16)])
@pytest.mark.slow
def test_dense_path_equals_the_values_before_the_move(name, dtype):
    """Default (dense, no remat) logits and gradients equal the values recorded before the move.

    Bit for bit on the CPU that recorded them (checked when the kernels moved); XLA:CPU rounds
    differently on other CPUs, so the comparison allows float rounding: the logits and the
    per-tensor sums of |gradient| within 1e-5 (f32) / 2e-2 (bf16) relative.
    """
    ref = np.load(REF_PATH)
    # The unrolled layer loop is the program the reference was recorded with; the scanned one
    # equals it to f32 rounding (test_scanned_layers_equal_unrolled), and in bf16 its different
    # fusion moves a few logits by a bf16 rounding step (~3e-2), beyond this test's tolerance.
    logits, grads = dense_reference_case(dtype, scan_layers=False)
    tol = 1e-5 if name == "f32" else 2e-2
    np.testing.assert_allclose(logits, ref[f"{name}_logits"], rtol=tol, atol=tol)
    sums = np.array([np.abs(g).sum(dtype=np.float64) for g in grads])
    np.testing.assert_allclose(sums, ref[f"{name}_grad_abs_sums"], rtol=tol)


# ----------------------------------------------------------------------------- kernels vs dense


def _qkv(rng, B, T, K, G, H):
    q = jnp.asarray(rng.randn(B, T, K, G, H), jnp.float32)
    k = jnp.asarray(rng.randn(B, T, K, H), jnp.float32)
    v = jnp.asarray(rng.randn(B, T, K, H), jnp.float32)
    return q, k, v


def _case(T, pad, segments, rng):
    """A 3-row SelfAttentionMask: row 0 left padded, row 1 right padded, row 2 full."""
    valid = np.ones((3, T), bool)
    if pad:
        valid[0, :pad] = False
        valid[1, T - pad:] = False
    seg = None
    if segments:
        seg = np.zeros((3, T), np.int32)
        seg[0, T // 2:] = 1
        seg[2, T // 3:] = 5
        seg[2, 2 * T // 3:] = -2  # any int is an id
    return valid, attn_lib.SelfAttentionMask(jnp.asarray(valid) if pad else None,
                                             None if seg is None else jnp.asarray(seg))


def _compare_with_dense(kernel, q, k, v, valid, mask, tol=1e-5):
    """Kernel vs dense: outputs at real queries, and d/d(q,k,v) of <out, c> with c = 0 at
    padded queries (as a loss that weights padding by 0)."""
    B, T = valid.shape
    ct = jnp.asarray(np.random.RandomState(9).randn(*q.shape), jnp.float32)
    ct = ct * valid[:, :, None, None, None]

    def dense(q, k, v):
        return attn_lib.dense_attention(q, k, v, mask.dense(B, T), dtype=q.dtype)

    outs, grads = [], []
    for f in (kernel, dense):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        outs.append(np.asarray(out))
        grads.append([np.asarray(g) for g in vjp(ct)])
    assert np.isfinite(outs[0]).all()
    np.testing.assert_allclose(outs[0][valid], outs[1][valid], atol=tol, rtol=0)
    for name, got, want in zip("qkv", *grads):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("K,G,T,bq,bkv,pad,segments", [
    (2, 3, 13, 4, 5, 3, True),    # GQA; tiles that do not divide T; padding and segments
    (1, 4, 13, 5, 3, 3, False),   # MQA; left/right padding
    (3, 1, 8, 16, 16, 0, False),  # MHA; one tile longer than T
    (2, 3, 12, 4, 4, 0, True),    # exact tiling, segments only
    (2, 2, 13, 4, 5, 0, False),   # causal only
])
@pytest.mark.slow
def test_blockwise_matches_dense(K, G, T, bq, bkv, pad, segments):
    rng = np.random.RandomState(T * 7 + K)
    q, k, v = _qkv(rng, 3, T, K, G, 8)
    valid, mask = _case(T, pad, segments, rng)

    def kernel(q, k, v):
        return attn_lib.blockwise_attention(q, k, v, mask, block_q=bq, block_kv=bkv)

    _compare_with_dense(kernel, q, k, v, valid, mask)


def test_blockwise_fully_padded_row_is_finite():
    """A row with no real token (every query's row fully masked): finite outputs and grads."""
    q, k, v = _qkv(np.random.RandomState(0), 2, 9, 2, 2, 8)
    valid = np.ones((2, 9), bool)
    valid[1] = False
    mask = attn_lib.SelfAttentionMask(jnp.asarray(valid), None)

    def f(q, k, v):
        return attn_lib.blockwise_attention(q, k, v, mask, block_q=4, block_kv=2)

    out = np.asarray(jax.jit(f)(q, k, v))
    grads = jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(out).all() and all(np.isfinite(np.asarray(g)).all() for g in grads)
    dense = jax.jit(lambda q, k, v: attn_lib.dense_attention(q, k, v, mask.dense(2, 9), dtype=jnp.float32))(q, k, v)
    np.testing.assert_allclose(out[0], np.asarray(dense)[0], atol=1e-5)  # the real row is exact


def test_blockwise_bf16_close_to_f32():
    q, k, v = _qkv(np.random.RandomState(1), 2, 20, 2, 2, 16)
    mask = attn_lib.SelfAttentionMask()
    # One program per dtype, not the kernel's operations compiled one by one.
    kernel = jax.jit(lambda q, k, v: attn_lib.blockwise_attention(q, k, v, mask, block_q=8, block_kv=8))
    want = kernel(q, k, v)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = kernel(*bf)
    assert got.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() < 0.05


@pytest.mark.slow
def test_splash_interpret_matches_dense():
    """The splash kernel (Pallas interpret mode on CPU): GQA, padding, segments; fwd and grads."""
    rng = np.random.RandomState(3)
    q, k, v = _qkv(rng, 3, 130, 2, 2, 8)  # T padded to 256: two 128-tiles
    valid, mask = _case(130, 7, True, rng)

    def kernel(q, k, v):
        return attn_lib.splash_attention(q, k, v, mask, block_q=128, block_kv=128, interpret=True)

    _compare_with_dense(kernel, q, k, v, valid, mask)


@pytest.mark.parametrize("impl,hardware", [("cudnn", "GPU"), ("splash", "TPU")])
def test_accelerator_kernels_refuse_cpu(impl, hardware):
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Qwen3ForCausalLM(REF_CONFIG, rngs=nnx.Rngs(0), attention=impl)))
    with pytest.raises(ValueError, match=f"'{impl}' needs .*{hardware}.*compiled for platform 'cpu'.*blockwise"):
        jax.eval_shape(lambda st: nnx.merge(graphdef, st)(np.zeros((1, 4), np.int32)), state)


def test_auto_resolution(monkeypatch):
    resolve = attn_lib.resolve_implementation
    assert resolve("auto", length=512, dtype=jnp.bfloat16, head_dim=128) == "dense"
    assert resolve("auto", length=513, dtype=jnp.bfloat16, head_dim=128) == "blockwise"  # CPU
    assert resolve("blockwise", length=8, dtype=jnp.float32, head_dim=8) == "blockwise"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve("auto", length=4096, dtype=jnp.float32, head_dim=128) == "splash"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve("auto", length=4096, dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert resolve("auto", length=4096, dtype=jnp.float32, head_dim=128) == "blockwise"
    assert resolve("auto", length=4096, dtype=jnp.bfloat16, head_dim=12) == "blockwise"


@pytest.mark.parametrize("kwargs,match", [
    ({"attention": "flash"}, "attention implementation.*'flash'"),
    ({"remat": "some"}, "remat.*'some'"),
    ({"attention_block_q": 0}, "block_q.*0"),
    ({"attention_block_kv": 2.0}, "block_kv.*2.0"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _abstract_model(REF_CONFIG, **kwargs)
    with pytest.raises(ValueError, match=match):
        _abstract_model(REF_CONFIG).set_compute_options(**kwargs)


# ----------------------------------------------------------------------------- whole model


@functools.cache
def _model_loss_and_grads(segments=True, dtype=jnp.float32, **options):
    """Mask-weighted loss, logits and parameter gradients of the fixed random model on
    ``_packed_case`` (cached: several tests share the dense baseline)."""
    mask, seg = _packed_case()
    segment_ids = seg if segments else None
    model = _abstract_model(REF_CONFIG, dtype=dtype, param_dtype=dtype, **options)
    graphdef, state = _ref_params(model, dtype)
    B, T = mask.shape
    ids = np.random.RandomState(4).randint(0, REF_CONFIG.vocab_size, (B, T)).astype(np.int32)

    def loss(st):
        logits = nnx.merge(graphdef, st)(ids, attention_mask=mask, segment_ids=segment_ids)
        return (jax.nn.logsumexp(logits, -1) * mask).sum() / mask.sum(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return float(value), np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(grads)]


def _assert_same(a, b, mask, tol=1e-5):
    assert abs(a[0] - b[0]) <= tol
    np.testing.assert_allclose(a[1][mask], b[1][mask], atol=tol, rtol=0)
    for x, y in zip(a[2], b[2], strict=True):
        np.testing.assert_allclose(x, y, atol=tol, rtol=0)


def _packed_case():
    mask = np.ones((2, 11), bool)
    mask[0, :3] = False
    mask[1, 9:] = False
    seg = np.zeros((2, 11), np.int32)
    seg[0, 7:] = 1
    seg[1, 4:] = 1
    seg[1, 6:] = 2
    return mask, seg


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.slow
def test_model_blockwise_equals_dense(segments):
    mask, _ = _packed_case()
    blockwise = _model_loss_and_grads(segments, attention="blockwise", attention_block_q=3,
                                      attention_block_kv=4)
    _assert_same(blockwise, _model_loss_and_grads(segments), mask)


def test_auto_on_short_rows_is_the_dense_path_exactly():
    a, b = _model_loss_and_grads(attention="auto"), _model_loss_and_grads()
    assert a[0] == b[0] and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("remat,attention", [("full", "dense"), ("full", "blockwise"),
                                             ("dots_saveable", "dense"),
                                             ("dots_with_no_batch_dims_saveable", "blockwise")])
@pytest.mark.slow
def test_remat_same_loss_and_grads(remat, attention):
    mask, _ = _packed_case()
    opts = {"attention": attention, "attention_block_q": 4, "attention_block_kv": 4}
    _assert_same(_model_loss_and_grads(remat=remat, **opts), _model_loss_and_grads(**opts), mask)


@pytest.mark.parametrize("remat,attention", [("none", "dense"), ("full", "blockwise"),
                                             ("dots_saveable", "dense")])
@pytest.mark.slow
def test_scanned_layers_equal_unrolled(remat, attention):
    """The layers under lax.scan (default) vs a Python loop over the stacked parameters:
    loss, logits and every gradient within 1e-5 in f32, with and without remat."""
    mask, _ = _packed_case()
    opts = {"attention": attention, "attention_block_q": 4, "attention_block_kv": 4, "remat": remat}
    _assert_same(_model_loss_and_grads(scan_layers=True, **opts),
                 _model_loss_and_grads(scan_layers=False, **opts), mask)


@pytest.mark.slow
def test_scanned_program_has_one_layer_body():
    """With scan_layers the forward's jaxpr holds one copy of the layer (a scan), so the program
    does not grow with depth; unrolled, it holds one copy per layer."""
    ids = np.zeros((1, 6), np.int32)

    def dots(scan, layers):
        config = dataclasses.replace(REF_CONFIG, num_hidden_layers=layers)
        # Abstract weights (shapes only): the jaxpr is the same, and no initialiser is compiled.
        model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), scan_layers=scan))
        graphdef, state = nnx.split(model)
        return str(jax.make_jaxpr(lambda st: nnx.merge(graphdef, st)(ids))(state)).count("dot_general")

    assert dots(True, 2) == dots(True, 6)
    assert dots(False, 6) - dots(False, 2) == 4 * (dots(False, 2) - dots(False, 1))


def test_remat_recomputes_in_the_backward():
    """Full remat: the backward program re-runs the layers' matmuls (more dot ops)."""
    model = _abstract_model(REF_CONFIG)  # the jaxpr needs shapes only
    ids = np.zeros((1, 6), np.int32)

    def dots(remat):
        graphdef, state = nnx.split(model.set_compute_options(remat=remat))
        grad = jax.grad(lambda st: nnx.merge(graphdef, st)(ids).sum())
        return str(jax.make_jaxpr(grad)(state)).count("dot_general")

    assert dots("full") > dots("none")


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_packed_rows_equal_separate_rows(attention):
    """Segment ids with default per-segment positions: a packed row's logits equal those of
    its sequences run alone (left padded), for each kernel."""
    rng = np.random.RandomState(5)
    lens = (4, 6, 3)
    seqs = [rng.randint(0, REF_CONFIG.vocab_size, n).astype(np.int32) for n in lens]
    packed = np.concatenate(seqs)[None]
    seg = np.repeat(np.arange(3, dtype=np.int32), lens)[None]
    T = max(lens)
    alone = np.zeros((3, T), np.int32)
    alone_mask = np.zeros((3, T), bool)
    for i, s in enumerate(seqs):
        alone[i, T - len(s):] = s
        alone_mask[i, T - len(s):] = True
    model = _abstract_model(REF_CONFIG, attention=attention,
                            attention_block_q=4, attention_block_kv=4)
    graphdef, state = _ref_params(model, jnp.float32)
    run = jax.jit(lambda st, ids, m, s: nnx.merge(graphdef, st)(ids, attention_mask=m, segment_ids=s))
    got = np.asarray(run(state, packed, np.ones_like(packed, bool), seg))[0]
    want = np.asarray(run(state, alone, alone_mask, None))
    np.testing.assert_allclose(got, np.concatenate([want[i, T - n:] for i, n in enumerate(lens)]),
                               atol=1e-5)


def test_default_positions_restart_per_segment():
    mask = np.array([[0, 1, 1, 1, 1, 1, 0]], bool)
    seg = np.array([[0, 0, 0, 1, 1, 2, 2]], np.int32)
    ids = np.zeros((1, 7), np.int32)
    np.testing.assert_array_equal(default_positions(ids, mask, seg), [[0, 0, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(default_positions(ids, None, seg), [[0, 1, 2, 0, 1, 0, 1]])
    np.testing.assert_array_equal(default_positions(ids, mask), [[0, 0, 1, 2, 3, 4, 4]])


def test_segment_ids_validation():
    model = _abstract_model(REF_CONFIG)  # the checks come before any use of the weights
    with pytest.raises(ValueError, match="segment_ids"):
        model(np.zeros((2, 3), np.int32), segment_ids=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(np.zeros((2, 3), np.int32), segment_ids=np.zeros((2, 3), np.float32))


def test_decode_unaffected_by_training_options():
    """A blockwise + remat model decodes (dense over the cache) to its own full forward."""
    model = _abstract_model(REF_CONFIG, attention="blockwise", remat="full",
                            attention_block_q=2, attention_block_kv=3)
    graphdef, state = _ref_params(model, jnp.float32)
    model = nnx.merge(graphdef, state)
    ids = np.random.RandomState(6).randint(0, REF_CONFIG.vocab_size, (2, 7)).astype(np.int32)
    mask = np.ones((2, 7), bool)
    mask[0, :2] = False
    positions = np.asarray(default_positions(ids, mask))
    full = np.asarray(jax.jit(lambda st: nnx.merge(graphdef, st)(
        ids, positions=positions, attention_mask=mask))(state))
    cache = model.init_cache(2, 7)
    logits, _ = jax.jit(lambda st, c: nnx.merge(graphdef, st).decode(ids, positions, c, 0, mask))(
        state, cache)
    np.testing.assert_allclose(np.asarray(logits)[mask], full[mask], atol=1e-5)
