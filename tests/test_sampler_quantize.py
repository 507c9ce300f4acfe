"""Sampler weight copies: fp8-e4m3 per-output-channel quantization and bf16, against independent references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.sampler import quantize as q
from conftest import TINY_DENSE
from quant_reference import INT_RANGES, fp8_reference, int_matches

CFG = TINY_DENSE


@pytest.fixture(scope="module")
def params():
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # std 0.5 instead of 0.02: peaked distributions, realistic quantization error
    return q._map_with_path(lambda path, x: x if path[-1] == "scale" else x * 25.0, pure)  # not the norms


@pytest.mark.parametrize("shape,axes", [((32, 4, 8), (1, 2)), ((4, 8, 32), (2,)), ((32, 64), (1,))])
@pytest.mark.slow
def test_fp8_matches_independent_reference(shape, axes):
    w = jax.random.normal(jax.random.PRNGKey(1), shape) * jnp.linspace(0.1, 3.0, shape[-1])
    t = q.quantize_fp8(w, axes)
    qv_ref, scale_ref = fp8_reference(w, axes)
    assert t.qvalue.dtype == jnp.float8_e4m3fn and t.scale.dtype == jnp.float32
    assert t.scale.shape == scale_ref.shape  # reduced (contraction) axes kept as size 1
    np.testing.assert_allclose(np.asarray(t.scale), scale_ref, rtol=1e-6)
    deq_ref = qv_ref.astype(np.float32) * scale_ref
    np.testing.assert_allclose(np.asarray(t.dequantize()), deq_ref, rtol=1e-5, atol=1e-7)
    # each channel's absmax is exactly representable (maps to +-448)
    assert np.abs(np.asarray(t.qvalue, np.float32)).max() == 448.0
    # e4m3 has 3 mantissa bits: elementwise relative error <= 2^-4 for normal values
    w_np, deq = np.asarray(w), np.asarray(t.dequantize())
    big = np.abs(w_np) > np.broadcast_to(scale_ref, w_np.shape) * 2.0 ** -6 * 2  # avoid subnormals
    assert np.all(np.abs(deq - w_np)[big] <= 2.0 ** -4 * np.abs(w_np)[big] + 1e-12)


def test_fp8_zero_channel_and_nonfinite():
    w = jnp.zeros((8, 3)).at[:, 1].set(jnp.arange(8.0))
    t = q.quantize_fp8(w, (1,))
    deq = np.asarray(t.dequantize())
    assert np.all(np.isfinite(deq)) and np.all(deq[:, 0] == 0) and np.all(deq[:, 2] == 0)
    np.testing.assert_array_equal(deq[:, 1], np.arange(8.0))  # small integers are exact in e4m3
    with pytest.raises(ValueError, match="non-finite"):
        q.quantize_fp8(w.at[0, 0].set(jnp.nan), (1,))


def test_default_output_axes_follow_model_layout(params):
    axes = {}
    q._map_with_path(lambda p, x: axes.__setitem__("/".join(p), q.default_output_axes(p, x.shape)), params)
    # stacked layer parameters [L, ...]: the layer axis keeps its own scales (an output axis)
    assert axes["layers/self_attn/q_proj/kernel"] == (0, 2, 3)   # [L, D, N, H]
    assert axes["layers/self_attn/k_proj/kernel"] == (0, 2, 3)   # [L, D, K, H]
    assert axes["layers/self_attn/o_proj/kernel"] == (0, 3)      # [L, N, H, D]
    assert axes["layers/mlp/gate_proj/kernel"] == (0, 2)         # [L, D, F]
    assert axes["layers/mlp/down_proj/kernel"] == (0, 2)         # [L, F, D]
    assert axes["layers/input_layernorm/scale"] is None           # [L, D]
    assert axes["embed_tokens/embedding"] is None and axes["lm_head/kernel"] is None
    # the per-layer paths (one layer's [D, N, H] kernel) keep their axes
    assert q.default_output_axes(("layers", "0", "self_attn", "q_proj", "kernel"), (32, 4, 8)) == (1, 2)
    assert q.default_output_axes(("layers", "1", "self_attn", "o_proj", "kernel"), (4, 8, 32)) == (2,)
    assert q.default_output_axes(("lm_head", "kernel"), (32, 32), quantize_lm_head=True) == (1,)
    assert q.default_output_axes(("embed_tokens", "embedding"), (32, 32), quantize_embedding=True) == (0,)


def test_stacked_quantization_equals_per_layer(params):
    """fp8 of a stacked [L, ...] kernel == the stack of each layer's own fp8 (scales never mix layers)."""
    w = params["layers"]["self_attn"]["o_proj"]["kernel"]
    stacked = q.quantize_fp8(w, q.default_output_axes(("layers", "self_attn", "o_proj", "kernel"), w.shape))
    for i in range(w.shape[0]):
        one = q.quantize_fp8(w[i], q.default_output_axes(("layers", str(i), "self_attn", "o_proj", "kernel"),
                                                         w[i].shape))
        np.testing.assert_array_equal(np.asarray(stacked.dequantize()[i]), np.asarray(one.dequantize()))


@pytest.mark.slow
def test_prepare_modes_and_errors(params):
    f32 = q.prepare_sampler_params(params, "none")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), f32, params))
    bf16 = q.prepare_sampler_params(params, "bf16")
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    err_bf16 = q.relative_errors(params, bf16)
    assert max(err_bf16.values()) <= 2.0 ** -8  # bf16 round-to-nearest: 8 mantissa bits
    quantized = q.quantize_params_fp8(params)
    err_fp8 = q.relative_errors(params, quantized)
    kernels = {k: v for k, v in err_fp8.items() if k.endswith("kernel") and "lm_head" not in k}
    assert len(kernels) == 7  # q, k, v, o, gate, up, down, each stacked over the layers
    # per-channel e4m3 on Gaussian weights: a few percent, never above 2^-4
    assert all(0.005 < v < 2.0 ** -4 for v in kernels.values()), kernels
    assert err_fp8["lm_head/kernel"] == 0.0 and err_fp8["embed_tokens/embedding"] == 0.0
    with pytest.raises(ValueError, match="quantization"):
        q.prepare_sampler_params(params, "int3")


@pytest.mark.slow
def test_logits_error_ordering(params):
    """Logit error vs f32: fp8 (bf16 compute) > bf16 > 0, and fp8 stays small (relative <= 10%)."""
    ids = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, CFG.vocab_size)

    def logits(p, dtype):
        model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        st = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(st, p)
        nnx.update(model, st)
        return np.asarray(jax.jit(lambda i: model(i))(ids))

    ref = logits(params, jnp.float32)
    errs = {}
    for mode in ("bf16", "fp8"):
        out = logits(q.prepare_sampler_params(params, mode), jnp.bfloat16)
        errs[mode] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 0 < errs["bf16"] < errs["fp8"] < 0.1, errs


def test_same_numbers_as_qwix_model_level_ptq():
    """qwix.quantize_model (weight-only fp8 PTQ) computes what our dequantize-then-matmul computes."""
    import qwix

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.kernel = nnx.Param(jax.random.normal(rngs.params(), (16, 4, 8)))

        def __call__(self, x):
            return jnp.einsum("bd,dnh->bnh", x, self.kernel[...])

    m = Tiny(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn)]
    qm = qwix.quantize_model(m, qwix.PtqProvider(rules), x)
    ours = jnp.einsum("bd,dnh->bnh", x, q.quantize_fp8(m.kernel[...], (1, 2)).dequantize())
    np.testing.assert_allclose(np.asarray(qm(x)), np.asarray(ours), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(m(x)), np.asarray(ours), atol=1e-3)  # quantization did something


@pytest.mark.parametrize("mode,dtype", [("fp8", jnp.float32), ("fp8", jnp.bfloat16), ("bf16", jnp.float32),
                                        ("none", jnp.float32)])
def test_one_program_preparation_is_bit_identical_to_the_eager_path(params, mode, dtype):
    """The jitted whole-tree preparation (once per weights version) == the leaf-by-leaf eager reference."""
    got = q.prepare_sampler_params(params, mode, compute_dtype=dtype)
    if mode == "fp8":
        want = q.dequantize_params(q.quantize_params_fp8(params), dtype)
    elif mode == "bf16":
        want = q.dequantize_params(q.dequantize_params(params, jnp.bfloat16), dtype)
    else:
        want = q.dequantize_params(params, dtype)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if mode == "fp8" and dtype == jnp.float32:  # f32 compute keeps every fp8 weight value exactly
        up = q.quantize_params_fp8(params)["layers"]["mlp"]["up_proj"]["kernel"]  # stacked [L, D, F]
        exact = np.asarray(up.qvalue, np.float32) * np.asarray(up.scale)
        np.testing.assert_array_equal(np.asarray(got["layers"]["mlp"]["up_proj"]["kernel"]), exact)


@pytest.mark.parametrize("mode", ["int8", "int4", "int2"])
def test_integer_modes_match_independent_reference(params, mode):
    """int8 / int4 / int2 weight-only (qwix's per-channel absmax: scale = max|W| / 127.5 (int4: / 7.5, int2: / 1.5)
    over the input axes, W times 1/scale rounded half to even, clipped to [-128, 127] (int4: [-8, 7], int2: [-2, 1]))
    == a numpy reference on a stacked [L, D, F] kernel (tests/quant_reference.py); embeddings, lm_head and norms
    unchanged; per-tensor error below fp8's for int8 (8 bits of uniform grid vs e4m3's 3 mantissa bits), above it
    for int4 (16 levels: the coarse copy sampler.quantization=int4 offers as a mismatch lever), and int2's (4
    levels) above int4's."""
    _, lo, hi = INT_RANGES[mode]
    got = q.prepare_sampler_params(params, mode, compute_dtype=jnp.float32)
    w = np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"], np.float32)  # [L, D, F]: scales per (L, F)
    out = np.asarray(got["layers"]["mlp"]["up_proj"]["kernel"])
    assert int_matches(out, w, (0, 2), mode).all()
    assert len(np.unique(out[0, :, 0])) <= hi - lo + 1
    np.testing.assert_array_equal(np.asarray(got["embed_tokens"]["embedding"]), params["embed_tokens"]["embedding"])
    err = q.relative_errors(params, got)
    errf8 = q.relative_errors(params, q.prepare_sampler_params(params, "fp8", compute_dtype=jnp.float32))
    kernels = [k for k in err if k.endswith("kernel") and "lm_head" not in k]
    assert len(kernels) == 7
    if mode == "int8":
        assert all(0 < err[k] < 0.5 * errf8[k] for k in kernels), (err, errf8)
    elif mode == "int4":
        assert all(2 * errf8[k] < err[k] < 0.25 for k in kernels), (err, errf8)
    else:
        err4 = q.relative_errors(params, q.prepare_sampler_params(params, "int4", compute_dtype=jnp.float32))
        assert all(2 * err4[k] < err[k] < 0.8 for k in kernels), (err, err4)


def test_non_finite_weight_is_refused_naming_it(params):
    bad = jax.tree.map(np.array, params)
    leaf = [(k, x) for k, x in jax.tree_util.tree_flatten_with_path(bad)[0]
            if "down_proj" in jax.tree_util.keystr(k)][0][1]
    leaf.flat[3] = np.inf
    with pytest.raises(ValueError, match=r"non-finite values: .*down_proj/kernel holds 1 NaN/inf"):
        q.prepare_sampler_params(bad, "fp8")


def _tree_equal(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


def test_weight_noise_is_a_fixed_gaussian_perturbation_per_output_channel(params):
    """``weight_noise`` sigma: every matmul weight, the embedding and lm_head become ``w + sigma * rms_c * z`` with
    ``rms_c`` the RMS of w's output channel (numpy, float64) and z standard normal (mean 0, std 1 per leaf, its own
    draws per channel); RMSNorm scales untouched; the same seed gives the same copy, another seed a copy whose
    distance to the first is sigma * sqrt(2); 0 is the program without noise."""
    sigma = 0.1
    # channels of very different sizes, so that a noise scaled by the leaf's RMS would fail the per-channel check
    params = {**params, "lm_head": {"kernel": params["lm_head"]["kernel"] * np.geomspace(0.1, 10.0, CFG.vocab_size)},
              "embed_tokens": {"embedding": params["embed_tokens"]["embedding"]
                               * np.geomspace(0.1, 10.0, CFG.vocab_size)[:, None]}}
    assert _tree_equal(q.prepare_sampler_params(params, "none"),
                       q.prepare_sampler_params(params, "none", weight_noise=0.0, noise_seed=7))
    noised = q.prepare_sampler_params(params, "none", weight_noise=sigma, noise_seed=3)
    touched = set()
    for (path, w), (_, got) in zip(q._named_leaves(params), q._named_leaves(noised)):
        w, got = np.asarray(w, np.float64), np.asarray(got, np.float64)
        if path[-1] == "scale":
            np.testing.assert_array_equal(got, w)
            continue
        touched.add("/".join(path))
        axes = {"embedding": (0,)}.get(path[-1], q.noise_output_axes(path, w.shape))
        reduce = tuple(a for a in range(w.ndim) if a not in axes)
        z = (got - w) / (sigma * np.sqrt(np.mean(w ** 2, axis=reduce, keepdims=True)))
        tol = 5.0 / np.sqrt(z.size)  # five standard errors
        assert abs(z.mean()) < tol and abs(z.std() - 1.0) < tol, (path, z.mean(), z.std())
        per_channel = np.sqrt(np.mean(z ** 2, axis=reduce))  # each channel's noise is its own size, not the leaf's
        tol = 6.0 / np.sqrt(2.0 * z.size / per_channel.size)
        assert np.all(np.abs(per_channel - 1.0) < tol), (path, per_channel.min(), per_channel.max())
    assert {"embed_tokens/embedding", "lm_head/kernel", "layers/self_attn/q_proj/kernel",
            "layers/mlp/down_proj/kernel"} <= touched and len(touched) == 9
    assert _tree_equal(noised, q.prepare_sampler_params(params, "none", weight_noise=sigma, noise_seed=3))
    other = q.relative_errors(noised, q.prepare_sampler_params(params, "none", weight_noise=sigma, noise_seed=4))
    assert all(0.9 * sigma * 2 ** 0.5 < v < 1.1 * sigma * 2 ** 0.5 for k, v in other.items()
               if not k.endswith("scale")), other


@pytest.mark.parametrize("mode", ["bf16", "fp8", "int4"])
def test_weight_noise_comes_before_the_quantization(params, mode):
    """The noised quantized copy is the quantization of the noised f32 copy, up to rounding ties (the noise is
    computed inside the same program, where XLA may fuse its multiply-add: at most 0.5% of a leaf's entries one
    quantization step away)."""
    noised = q.prepare_sampler_params(params, "none", weight_noise=0.05, noise_seed=1)
    want = q.prepare_sampler_params(noised, mode, compute_dtype=jnp.float32)
    got = q.prepare_sampler_params(params, mode, compute_dtype=jnp.float32, weight_noise=0.05, noise_seed=1)
    for (path, a), (_, b) in zip(q._named_leaves(want), q._named_leaves(got)):
        a, b = np.asarray(a), np.asarray(b)
        off = a != b
        assert off.mean() <= 0.005, (path, off.mean())
        if off.any():
            step = np.abs(a).max() / (7.0 if mode == "int4" else 100.0)
            assert np.abs(a - b).max() <= step, path


def test_weight_noise_is_finite_near_the_float32_limit_and_independent_of_the_default_prng():
    """A channel whose entries reach 1e37 gets finite noise (its RMS is taken on the channel scaled by its max, so
    w**2 never overflows); the draws come from the named threefry PRNG, so a process whose default PRNG is another
    one draws the same copy."""
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    w[0, 0] = 1e37
    tree = {"layers": {"0": {"mlp": {"up_proj": {"kernel": w}}}}}
    for mode in ("none", "fp8", "int4"):
        out = q.prepare_sampler_params(tree, mode, weight_noise=0.1, check_all_finite=True, compute_dtype=jnp.float32)
        got = np.asarray(out["layers"]["0"]["mlp"]["up_proj"]["kernel"])
        assert np.isfinite(got).all() and np.abs(got[:, 0] - w[:, 0]).max() > 0, mode
    want = q.prepare_sampler_params(tree, "none", weight_noise=0.1, noise_seed=5)
    old = jax.config.jax_default_prng_impl
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        got = q.prepare_sampler_params(tree, "none", weight_noise=0.1, noise_seed=5)
    finally:
        jax.config.update("jax_default_prng_impl", old)
    assert _tree_equal(want, got)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), 1.5, True, "0.1"])
def test_bad_weight_noise_is_refused_naming_it(params, value):
    with pytest.raises(ValueError, match="weight_noise"):
        q.prepare_sampler_params(params, "none", weight_noise=value)
    for seed in (-1, 2**32, True, 1.0):
        with pytest.raises(ValueError, match="weight_noise_seed"):
            q.prepare_sampler_params(params, "none", weight_noise=0.1, noise_seed=seed)
