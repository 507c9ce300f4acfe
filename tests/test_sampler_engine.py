"""SamplingEngine: decode-time logprobs vs teacher forcing, top-K, temperature consistency,
stop tokens, greedy, top-k/top-p filtering, reproducibility, request validation.

All generations use one shape bucket (B=4, P=8, T=16, K=5) so the engine compiles once
per weight dtype.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.rollouts.in_process import InProcessSampler
from pdm_jax.sampler.engine import RequestError, SamplingEngine, resolve_compute_dtype
from pdm_jax.sampler.sampling import sampling_distribution
from conftest import TINY_DENSE, jit_method

CFG = TINY_DENSE
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
K = 5
GEN = dict(n=2, max_new_tokens=12, top_k_logprobs=K)
TAU = 0.6


def make_params(seed=0, scale=25.0):
    """Random Qwen3 weights with std 0.5 (peaked, realistic distributions)."""
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(seed))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree_util.tree_map_with_path(  # the RMSNorm scales stay 1 (stacked: [L, D], 2-D)
        lambda path, x: x if jax.tree_util.keystr(path).endswith("['scale']") else x * scale, pure)


def make_engine(params, **kw):
    """A tiny engine; static batching unless asked (the continuous tests below ask for it by name)."""
    kw.setdefault("quantization", "none")
    kw.setdefault("batching", "static")
    return SamplingEngine(CFG, params, max_prompt_length=16, max_new_tokens=16, **kw)


def full_logits(params, batch, dtype=jnp.float32):
    """The trainer's view: one full causal forward over prompt + completion (independent of decode)."""
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    st = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    nnx.update(model, st)
    ids = np.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
    logits = jax.jit(lambda i, m: model(i, attention_mask=m))(jnp.asarray(ids), jnp.asarray(mask))
    p = batch.prompt_ids.shape[1]
    return np.asarray(logits[:, p - 1:-1], np.float64)  # logits predicting completion token t


def log_softmax_np(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture(scope="module")
def engine(params):
    return make_engine(params, version=3)


@pytest.fixture(scope="module")
def batch(engine):
    return engine.generate(PROMPTS, temperature=TAU, seed=11, **GEN)


@pytest.mark.slow
def test_batch_layout(batch):
    assert batch.num_sequences == 4 and batch.top_k == K
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.weights_version, [3] * 4)
    np.testing.assert_array_equal(batch.prompt_mask.sum(1), [5, 5, 3, 3])
    np.testing.assert_array_equal(batch.prompt_ids[2, -3:], [6, 7, 8])
    assert set(batch.finish_reason) == {"length"}
    np.testing.assert_array_equal(batch.completion_mask.sum(1), [12] * 4)
    assert batch.behavior_logprobs.dtype == np.float32 and batch.topk_logprobs.dtype == np.float32


def test_decode_logprobs_equal_teacher_forcing_and_temperature_consistency(params, batch):
    """Trainer recomputation (full forward, logits/tau, log_softmax, gather) == sampler's log mu, f32 1e-5."""
    logp = log_softmax_np(full_logits(params, batch) / TAU)
    tf = np.take_along_axis(logp, batch.completion_ids[..., None], -1)[..., 0]
    m = batch.completion_mask
    np.testing.assert_allclose(batch.behavior_logprobs[m], tf[m], atol=1e-5)
    ratio = np.exp(tf[m] - batch.behavior_logprobs[m])
    assert np.all(np.abs(ratio - 1) <= 1e-5)


def test_topk_equals_independent_topk(params, batch):
    logp = log_softmax_np(full_logits(params, batch) / TAU)
    m = batch.completion_mask
    order = np.argsort(-logp, axis=-1, kind="stable")[..., :K]
    ref_vals = np.take_along_axis(logp, order, -1)
    # f32: 1e-5 absolute plus 2e-6 relative (tail entries reach log mu ~ -10, where one f32 ulp is ~1e-6)
    np.testing.assert_allclose(batch.topk_logprobs[m], ref_vals[m], atol=1e-5, rtol=2e-6)
    # ids carry the values they claim (robust to near-ties in the ordering)
    np.testing.assert_allclose(np.take_along_axis(logp, batch.topk_ids, -1)[m], batch.topk_logprobs[m],
                               atol=1e-5, rtol=2e-6)
    tk = batch.topk_ids[m]
    assert all(len(set(r)) == K for r in tk), "top-K ids must be unique"
    assert np.all(np.diff(batch.topk_logprobs[m], axis=-1) <= 0), "ranks must be ordered"
    hit = batch.topk_ids == batch.completion_ids[..., None]
    rows, cols, ks = np.nonzero(hit & m[..., None])
    assert len(rows) > 0
    np.testing.assert_array_equal(batch.behavior_logprobs[rows, cols], batch.topk_logprobs[rows, cols, ks])


@pytest.mark.parametrize("quantization", ["fp8", "int8", "int4", "int2"])
def test_quantized_decode_equals_quantized_prefill(params, quantization):
    """fp8 / int8 / int4 / int2 weights, f32 compute: decode logprobs == teacher-forced logprobs of the same quantized
    weights."""
    eng = make_engine(params, quantization=quantization, compute_dtype=jnp.float32)
    b = eng.generate(PROMPTS, temperature=1.0, seed=5, **GEN)
    logp = log_softmax_np(full_logits(eng.params, b))
    tf = np.take_along_axis(logp, b.completion_ids[..., None], -1)[..., 0]
    m = b.completion_mask
    np.testing.assert_allclose(b.behavior_logprobs[m], tf[m], atol=1e-5)
    # ... and differs from the f32 policy: the off-policy gap the masks exist for
    lp_f32 = log_softmax_np(full_logits(params, b))
    pi = np.take_along_axis(lp_f32, b.completion_ids[..., None], -1)[..., 0]
    gap = np.abs(pi[m] - b.behavior_logprobs[m])
    # int4: 16 levels, a coarse copy; int2: 4 levels, a copy far from the policy (the stress lever)
    assert 1e-4 < gap.mean() < {"int4": 1.0, "int2": 10.0}.get(quantization, 0.5)


@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.slow
def test_layers_sliced_before_the_loop_give_the_same_tokens_bit_for_bit(params, batching):
    """On XLA:CPU the engine slices the layers out of the stacks once, before its decode loops
    (`engine.hoist_layer_slices`); inside each step (TPU's way) the same program gives the same tokens, log mu and
    top-K to the last bit."""
    from pdm_jax.sampler import sampling

    assert sampling.hoist_layer_slices("cpu") and not sampling.hoist_layer_slices("tpu")
    hoisted, per_step = make_engine(params, batching=batching), make_engine(params, batching=batching)
    assert hoisted.slice_layers_once
    per_step.slice_layers_once = False
    prompts = [[1, 2, 3], [4, 5], [6]]
    a, b = (e.generate(prompts, n=2, temperature=1.0, max_new_tokens=8, top_k_logprobs=4, seed=5)
            for e in (hoisted, per_step))
    for field in ("completion_ids", "completion_mask", "behavior_logprobs", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_reproducible_and_seed_sensitive(engine, batch):
    again = engine.generate(PROMPTS, temperature=TAU, seed=11, **GEN)
    for f in ("completion_ids", "behavior_logprobs", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(again, f), getattr(batch, f))
    other = engine.generate(PROMPTS, temperature=TAU, seed=12, **GEN)
    assert not np.array_equal(other.completion_ids, batch.completion_ids)
    big = engine.generate(PROMPTS, temperature=TAU, seed=2**40 + 11, **GEN)  # the high 32 bits count too
    assert not np.array_equal(big.completion_ids, batch.completion_ids)
    np.testing.assert_array_equal(engine.generate(PROMPTS, temperature=TAU, seed=2**40 + 11, **GEN).completion_ids,
                                  big.completion_ids)
    # the two samples of one prompt differ (independent per-row keys)
    assert not np.array_equal(batch.completion_ids[0], batch.completion_ids[1])


def test_stop_tokens_and_finish_reason(engine, batch):
    stop = int(batch.completion_ids[0, 2])
    b = engine.generate(PROMPTS, temperature=TAU, seed=11, stop_token_ids=[stop], **GEN)
    for r in range(4):
        ids = batch.completion_ids[r]
        hits = np.flatnonzero(ids == stop)
        if hits.size:  # per-token keys depend on (row, t) only: the prefix is unchanged
            t = hits[0] + 1
            assert b.finish_reason[r] == "stop" and b.completion_mask[r].sum() == t
            np.testing.assert_array_equal(b.completion_ids[r, :t], ids[:t])
            assert b.completion_ids[r, t - 1] == stop  # the stop token is kept
            assert np.all(b.completion_ids[r, t:] == 0) and np.all(b.behavior_logprobs[r, t:] == 0)
        else:
            assert b.finish_reason[r] == "length" and b.completion_mask[r].sum() == 12
    assert b.finish_reason[0] == "stop" and b.completion_mask[0].sum() == 3
    short = engine.generate(PROMPTS, temperature=TAU, seed=11, n=2, max_new_tokens=4, top_k_logprobs=K)
    assert short.completion_ids.shape == (4, 4) and set(short.finish_reason) == {"length"}
    np.testing.assert_array_equal(short.completion_ids, batch.completion_ids[:, :4])


def test_greedy_is_argmax_with_tau1_logprobs(params, engine):
    b = engine.generate(PROMPTS, temperature=0.0, seed=0, **GEN)
    z = full_logits(params, b)
    m = b.completion_mask
    np.testing.assert_array_equal(b.completion_ids[m], z.argmax(-1)[m])
    np.testing.assert_array_equal(b.completion_ids[0], b.completion_ids[1])  # greedy ignores the seed
    tf = np.take_along_axis(log_softmax_np(z), b.completion_ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(b.behavior_logprobs[m], tf[m], atol=1e-5)


def _filtered_reference(z, tau, top_k, top_p):
    """Independent numpy top-k then top-p filter (renormalised), -inf outside the support."""
    lp = log_softmax_np(z / tau)
    out = np.full_like(lp, -np.inf)
    for idx in np.ndindex(lp.shape[:-1]):
        row = lp[idx]
        order = np.argsort(-row, kind="stable")
        keep = order[:top_k] if top_k else order
        p = np.exp(row[keep] - np.log(np.exp(row[keep]).sum()))
        n = max(1, int(np.sum(np.cumsum(p) - p < top_p)))
        keep = keep[:n]
        sub = row[keep]
        out[idx][keep] = sub - np.log(np.exp(sub).sum())
    return out


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6)])
def test_topk_topp_logprobs_are_of_the_sampled_distribution(params, engine, top_k, top_p):
    b = engine.generate(PROMPTS, temperature=TAU, seed=2, top_k=top_k, top_p=top_p, **GEN)
    m = b.completion_mask
    ref = _filtered_reference(full_logits(params, b), TAU, top_k, top_p)
    tf = np.take_along_axis(ref, b.completion_ids[..., None], -1)[..., 0]
    assert np.all(np.isfinite(tf[m])), "sampled tokens lie in the filtered support"
    np.testing.assert_allclose(b.behavior_logprobs[m], tf[m], atol=1e-5)
    support = np.isfinite(ref).sum(-1)[m]
    if top_k:
        assert np.all(support == top_k)
        assert np.all(np.isneginf(b.topk_logprobs[m][:, top_k:]))
    # the K reported entries carry the whole mass when the support fits in K
    fits = support <= K
    assert fits.any()
    mass = np.exp(b.topk_logprobs[m][fits].astype(np.float64)).sum(-1)
    np.testing.assert_allclose(mass, 1.0, atol=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompts=[list(range(17))]), "prompt"),
    (dict(prompts=[[1, 32]]), "prompt"),
    (dict(prompts=[[-1]]), "prompt"),
    (dict(prompts=[[]]), "prompt"),
    (dict(prompts=[]), "prompt"),
    (dict(n=0), "n"),
    (dict(n=5000), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k_logprobs=33), "logprobs"),
    (dict(top_k_logprobs=-1), "logprobs"),
    (dict(max_new_tokens=17), "max_tokens"),
    (dict(max_new_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop_token_ids=[40]), "stop_token_ids"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-1), "seed"),
])
def test_bad_requests_raise_naming_the_field(engine, kwargs, field):
    kwargs = dict(kwargs)
    prompts = kwargs.pop("prompts", [[1, 2]])
    with pytest.raises(RequestError) as e:
        engine.generate(prompts, **kwargs)
    assert e.value.field == field and field in str(e.value)


def test_in_process_sampler_interface(engine, batch):
    s = InProcessSampler(engine)
    h = s.health()
    assert h["version"] == 3 and h["quantization"] == "none" and h["vocab_size"] == 32
    b = s.generate(PROMPTS, temperature=TAU, seed=11, **GEN)
    np.testing.assert_array_equal(b.completion_ids, batch.completion_ids)


def test_compute_dtype_choice():
    """auto: f32 for none and on CPU; bf16 for bf16/fp8 on accelerators; explicit values; bad ones named."""
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert resolve_compute_dtype("auto", "fp8", backend="cpu") == f32
    assert resolve_compute_dtype(None, "bf16", backend="cpu") == f32
    assert resolve_compute_dtype("auto", "fp8", backend="tpu") == bf16
    assert resolve_compute_dtype("auto", "int8", backend="tpu") == bf16
    assert resolve_compute_dtype("auto", "int4", backend="tpu") == bf16
    assert resolve_compute_dtype("auto", "bf16", backend="gpu") == bf16
    assert resolve_compute_dtype("auto", "none", backend="tpu") == f32
    assert resolve_compute_dtype("bfloat16", "fp8") == bf16 and resolve_compute_dtype(jnp.float32, "none") == f32
    with pytest.raises(ValueError, match=r"compute_dtype = 'float16': must be one of \('auto', 'float32'"):
        resolve_compute_dtype("float16", "fp8")
    with pytest.raises(ValueError, match="quantization"):
        resolve_compute_dtype("auto", "int3")
    if jax.default_backend() == "cpu":
        eng = make_engine(make_params(), quantization="fp8")
        assert eng.compute_dtype == f32 and eng.health()["compute_dtype"] == "float32"
        assert {x.dtype for x in jax.tree.leaves(eng.params)} == {f32}


@pytest.mark.parametrize("temperature", [0.0, TAU])
@pytest.mark.slow
def test_shared_prefill_equals_per_row_prefill(params, temperature):
    """n = 4 samples of 3 prompts: one prefill per prompt (its KV cache repeated) == every row prefilled;
    tokens exactly, log mu and top-K within 1e-5 (absolute + relative, f32: the prefill's batch size changes
    XLA's rounding, ~5e-6 relative after 12 decode steps), greedy and sampled; prefill rows counted."""
    prompts = PROMPTS + [[9, 10, 11, 12, 13, 14, 15]]
    gen = dict(n=4, max_new_tokens=12, top_k_logprobs=K, temperature=temperature, seed=3)
    shared, single = make_engine(params), make_engine(params, share_prefill=False)
    a, b = shared.generate(prompts, **gen), single.generate(prompts, **gen)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-5, rtol=1e-5)
    # 12 rows in a bucket of 16: 4 prefilled rows (3 prompts + 1 padding group) instead of 16
    assert (shared.prefill_rows, shared.prefill_rows_unshared) == (4, 16)
    assert single.prefill_rows == single.prefill_rows_unshared == 16
    # n = 3 does not divide the bucket of 8 rows: every row is prefilled, same results
    c, d = shared.generate(prompts[:2], **dict(gen, n=3)), single.generate(prompts[:2], **dict(gen, n=3))
    np.testing.assert_array_equal(c.completion_ids, d.completion_ids)
    assert shared.prefill_rows == 4 + 8


def _assert_same_rollouts(a, b):
    """Same tokens, masks, finish reasons and top-K ids; log mu and top-K log mu within 1e-5 (f32)."""
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    np.testing.assert_array_equal(a.finish_reason, b.finish_reason)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_per_row_cache_index_decode_equals_per_row_decodes(params):
    """model.decode with one cache index per row == each row decoded alone at its index (and a [B] index of
    equal values == the scalar index)."""
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    st = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    nnx.update(model, st)
    rng = np.random.default_rng(0)
    b, s = 3, 10
    cache = model.init_cache(b, s)
    cache = type(cache)(k=tuple(jnp.asarray(rng.normal(size=k.shape), jnp.float32) for k in cache.k),
                        v=tuple(jnp.asarray(rng.normal(size=v.shape), jnp.float32) for v in cache.v))
    ids, pos = jnp.array([[3], [7], [1]], jnp.int32), jnp.array([[4], [2], [8]], jnp.int32)
    index, mask = jnp.array([4, 2, 8], jnp.int32), jnp.asarray(rng.random((b, s)) < 0.8)
    decode = jit_method(model, "decode")  # one program per shape of the arguments, not op by op
    logits, new = decode(ids, pos, cache, index, mask)
    for r in range(b):
        row = type(cache)(k=tuple(k[r:r + 1] for k in cache.k), v=tuple(v[r:r + 1] for v in cache.v))
        lr, nr = decode(ids[r:r + 1], pos[r:r + 1], row, int(index[r]), mask[r:r + 1])
        np.testing.assert_allclose(logits[r:r + 1], lr, atol=1e-5, rtol=1e-5)
        # the [3]- and [1]-row programs compute the new k/v alike up to rounding (bit-equal at XLA's default opt level)
        np.testing.assert_allclose(new.k[0][r:r + 1], nr.k[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new.v[1][r:r + 1], nr.v[1], rtol=1e-5, atol=1e-5)
    same, _ = decode(ids, pos, cache, jnp.array([5, 5, 5]), mask)
    scalar, _ = decode(ids, pos, cache, 5, mask)
    np.testing.assert_array_equal(same, scalar)
    with pytest.raises(ValueError, match="cache_index"):
        model.decode(ids, pos, cache, jnp.array([5, 5]), mask)


@pytest.fixture(scope="module")
def continuous_pair(params):
    """A static and a continuous engine with 4 rows per chunk / 4 slots (shared prefill on in both)."""
    return make_engine(params, max_batch_size=4), make_engine(params, max_batch_size=4, batching="continuous")


def _same_as_static_with_and_without_stops(static, cont, gen, stop_at):
    """Generates 5 prompts with `gen` on both engines, first without stop ids, then with the tokens the static run
    sampled at the (row, position) pairs `stop_at` as stop ids; asserts equal rollouts both times and returns the
    stopped run's completion lengths [N] and finish reasons."""
    prompts = PROMPTS + [[9, 10], [3] * 10, [5]]
    base = static.generate(prompts, **gen)
    _assert_same_rollouts(base, cont.generate(prompts, **gen))
    stops = [int(base.completion_ids[r, t]) for r, t in stop_at]
    a, b = static.generate(prompts, stop_token_ids=stops, **gen), cont.generate(prompts, stop_token_ids=stops, **gen)
    _assert_same_rollouts(a, b)
    return a.completion_mask.sum(1), a.finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, TAU])
def test_continuous_batching_equals_static(continuous_pair, temperature):
    """5 prompts x n = 2 = 10 rows through 4 slots (refilled as rows stop; the tail compacted to 1 slot)
    == the static engine's 3 chunks: tokens, finish reasons, log mu and top-K (1e-5), greedy and sampled,
    with stop ids that end rows at different lengths, and without stop ids."""
    static, cont = continuous_pair
    lengths, reasons = _same_as_static_with_and_without_stops(
        static, cont, dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=temperature, seed=5), [(0, 3), (5, 1)])
    assert len(set(lengths.tolist())) >= 3 and "stop" in set(reasons), lengths
    # one program shape for both calls: (slots 4, queue 16, prompt store 8, P 16, T 16, K)
    assert cont.program_shapes == {("continuous", 4, 16, 8, 16, 16, K, "float32")}
    # it decoded fewer steps than a 4-slot engine running each chunk to its longest row
    assert cont.last_decode_steps < 3 * 11


@pytest.mark.slow
def test_continuous_prefill_in_chunks_equals_whole(params, continuous_pair):
    """The prompt store prefilled 2 or 3 prompts at a time (5 prompts in a store of 8 entries: 4 chunks of 2; 3 does
    not divide 8, so 2 again) == prefilled at once: the same rollouts (tokens, log mu, top-K), one program each."""
    _, whole = continuous_pair
    gen = dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=TAU, seed=5)
    prompts = PROMPTS + [[9, 10], [3] * 10, [5]]
    want = whole.generate(prompts, **gen)
    for chunk in (2, 3):
        chunked = make_engine(params, max_batch_size=4, batching="continuous", prefill_chunk=chunk)
        _assert_same_rollouts(want, chunked.generate(prompts, **gen))
        assert chunked.program_shapes == {("continuous", 4, 16, 8, 16, 16, K, "float32", ("prefill chunk", 2))}
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 0, got -1"):
        make_engine(params, batching="continuous", prefill_chunk=-1)


def test_unfiltered_requests_compile_no_filter(params):
    """Without top-p / top-k the program has no filter (``may_filter=False``): the same log mu bit for bit as the
    filter's no-op branch; a filtering request runs its own program (a distinct shape key) and filters."""
    z = jnp.asarray(np.random.default_rng(0).normal(size=(3, CFG.vocab_size)) * 4, jnp.float32)
    ones, zeros = jnp.ones(3), jnp.zeros(3, jnp.int32)
    np.testing.assert_array_equal(np.asarray(sampling_distribution(z, ones * TAU, ones, zeros, may_filter=False)),
                                  np.asarray(sampling_distribution(z, ones * TAU, ones, zeros)))
    cont = make_engine(params, max_batch_size=4, batching="continuous")
    gen = dict(n=2, max_new_tokens=8, top_k_logprobs=K, temperature=TAU, seed=3)
    cont.generate(PROMPTS, **gen)
    filtered = cont.generate(PROMPTS, top_k=2, **gen)
    assert len(cont.program_shapes) == 2
    assert [key[-1] == "top_p/top_k filter" for key in sorted(cont.program_shapes, key=len)] == [False, True]
    ids = filtered.topk_ids[filtered.completion_mask.astype(bool)]
    lps = filtered.topk_logprobs[filtered.completion_mask.astype(bool)]
    assert np.isfinite(lps[:, :2]).all() and np.isneginf(lps[:, 2:]).all(), (ids, lps)  # 2 ids kept per step


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, TAU])
def test_continuous_cache_phases_equal_static(params, continuous_pair, temperature):
    """The cache grown in phases (P + 4, P + 8, P + 16 slots: min_cache_phase 4) while rows are refilled, rows
    past the first phase parked while rows are pending (and with parking off): the static engine's tokens,
    finish reasons, log mu and top-K (1e-5), with and without stop ids."""
    static, _ = continuous_pair
    for park in (2, 0):
        cont = make_engine(params, max_batch_size=4, batching="continuous", park_rows=park)
        cont.min_cache_phase = 4
        lengths, _ = _same_as_static_with_and_without_stops(
            static, cont, dict(n=2, max_new_tokens=16, top_k_logprobs=K, temperature=temperature, seed=7),
            [(0, 5), (3, 9)])
        assert len(set(lengths.tolist())) >= 3 and lengths.max() > 8, lengths  # rows end in more than one phase
        assert (cont.parked_rows > 0) == (park > 0), cont.parked_rows
        assert all(key[-1] == (("min_phase", 4) if park else ("park", 0)) for key in cont.program_shapes)
    with pytest.raises(ValueError, match="park_rows must be an integer >= 0, got -1"):
        make_engine(params, batching="continuous", park_rows=-1)


@pytest.mark.slow
def test_continuous_without_shared_prefill_and_bad_mode(params, continuous_pair):
    """share_prefill=False (a store entry per row) gives the same rollouts; an unknown batching mode is named."""
    static, _ = continuous_pair
    cont = make_engine(params, max_batch_size=4, batching="continuous", share_prefill=False)
    gen = dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=TAU, seed=5)
    _assert_same_rollouts(static.generate(PROMPTS, **gen), cont.generate(PROMPTS, **gen))
    assert cont.prefill_rows == 4  # 4 rows, one entry each
    with pytest.raises(ValueError, match="batching must be one of"):
        make_engine(params, batching="paged")
    with pytest.raises(ValueError, match="max_slots"):
        make_engine(params, batching="continuous", max_slots=0)
