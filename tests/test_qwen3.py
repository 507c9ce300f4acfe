"""Qwen3 NNX model: parity with transformers' PyTorch Qwen3, KV-cache decode, config (the presets:
tests/test_models_presets.py)."""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models import (KVCache, Qwen3Config, Qwen3ForCausalLM, from_pretrained,
                            save_pretrained)

from conftest import jit_method

REF_DIR = os.path.join(os.path.dirname(__file__), "data", "qwen3_reference")
CASES = ("gqa_untied", "mqa_tied", "sharded")

TINY = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   rope_theta=10_000.0)


def _scaled_model(config: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    """Random model with O(1) logits (the 0.02 init gives near-uniform attention). The structure comes from an
    abstract init (an eager one builds a few dozen small programs, and the draws replace its values anyway); the
    draws are one program per config."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))))
    leaves, treedef = jax.tree.flatten(abstract)
    new = _draw(tuple(x.shape for x in leaves), jax.random.key(seed + 1))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new))


@functools.partial(jax.jit, static_argnums=0)
def _draw(shapes, key):  # one program for all the draws
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, shape) * (1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[0]))
            + (1.0 if len(shape) == 1 else 0.0) for k, shape in zip(keys, shapes)]


def forward(model, ids, positions=None, attention_mask=None):
    """Jitted full forward (`conftest.jit_method`: one compile instead of op-by-op eager dispatch)."""
    return jit_method(model)(ids, positions=positions, attention_mask=attention_mask)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", CASES)
def test_committed_reference_parity(case):
    """Our from_pretrained + forward vs transformers' logits (padded batch, positions > 0)."""
    path = os.path.join(REF_DIR, case)
    ref = np.load(os.path.join(path, "reference.npz"))
    model = from_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert model.config.tie_word_embeddings == hf["tie_word_embeddings"]
    assert model.config.rope_theta == hf["rope_parameters"]["rope_theta"]
    logits = forward(model, ref["input_ids"], positions=ref["position_ids"],
                     attention_mask=ref["attention_mask"])
    assert logits.dtype == jnp.float32 and logits.shape == ref["logits"].shape
    real = ref["attention_mask"].astype(bool)
    err = np.abs(np.asarray(logits) - ref["logits"])[real].max()
    assert err <= 1e-4, err
    assert np.abs(ref["logits"][real]).max() > 1.0  # the reference is not trivially flat
    assert np.isfinite(np.asarray(logits)).all()  # pure-padding queries stay finite


@pytest.mark.parametrize("case", ["gqa_untied", "mqa_tied"])
def test_committed_reference_parity_blockwise_attention(case):
    """The blockwise attention kernel (tiles 3 x 5, not dividing T) vs transformers' logits."""
    path = os.path.join(REF_DIR, case)
    ref = np.load(os.path.join(path, "reference.npz"))
    model = from_pretrained(path).set_compute_options(attention="blockwise", attention_block_q=3,
                                                      attention_block_kv=5)
    logits = forward(model, ref["input_ids"], positions=ref["position_ids"],
                     attention_mask=ref["attention_mask"])
    real = ref["attention_mask"].astype(bool)
    assert np.abs(np.asarray(logits) - ref["logits"])[real].max() <= 1e-4
    assert np.isfinite(np.asarray(logits)).all()


def test_positions_matter():
    """Row 2 of the reference uses stride-2 positions: arange positions must disagree."""
    path = os.path.join(REF_DIR, "gqa_untied")
    ref = np.load(os.path.join(path, "reference.npz"))
    model = from_pretrained(path)
    logits = forward(model, ref["input_ids"][2:], attention_mask=ref["attention_mask"][2:])
    assert np.abs(np.asarray(logits[0]) - ref["logits"][2]).max() > 1e-2


def test_live_torch_parity(tmp_path):
    """transformers model -> HF save -> our load, and our save -> transformers load."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    hf_config = transformers.Qwen3Config(
        vocab_size=40, hidden_size=24, intermediate_size=36, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 2_000.0},
        tie_word_embeddings=False, attn_implementation="eager")
    hf_model = transformers.Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.ndim == 2 else 1.0)
                    + (1.0 if p.ndim == 1 else 0.0))
    hf_model.save_pretrained(tmp_path / "hf")
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 40, (2, 11))
    mask = np.ones((2, 11), np.int64)
    mask[0, :4] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0) + 17
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(positions)).logits.numpy()
    ours = from_pretrained(str(tmp_path / "hf"))
    got = np.asarray(forward(ours, ids, positions=positions, attention_mask=mask))
    assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-4
    # Our writer produces a directory transformers loads to the same function.
    save_pretrained(ours, str(tmp_path / "ours"), max_shard_size="4KB")
    back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        again = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.numpy()
    assert np.abs(again - want)[mask.astype(bool)].max() <= 1e-5


# ----------------------------------------------------------------------------- KV cache


def _left_padded_batch(rng, vocab, prompt_lens, total_len):
    B = len(prompt_lens)
    P = max(prompt_lens)
    ids = rng.randint(0, vocab, (B, total_len)).astype(np.int32)
    mask = np.ones((B, total_len), bool)
    for b, n in enumerate(prompt_lens):
        mask[b, : P - n] = False
    return ids, mask, P


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.slow
def test_decode_matches_full_forward(tied):
    """Prefill a left-padded prompt batch, then decode one token at a time (positions up to
    22, past the prefill chunk); every step's logits equal the full forward's."""
    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = _scaled_model(config, seed=3)
    rng = np.random.RandomState(1)
    total, max_len = 16, 20
    ids, mask, P = _left_padded_batch(rng, config.vocab_size, [5, 2, 7], total)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32) + 7  # positions > 0
    full = np.asarray(forward(model, ids, positions=positions, attention_mask=mask))

    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, pos, cache, index, kv_mask):
        return nnx.merge(graphdef, state).decode(ids, pos, cache, index, kv_mask)

    kv_mask = np.zeros((3, max_len), bool)
    kv_mask[:, :P] = mask[:, :P]
    cache = model.init_cache(3, max_len)
    assert isinstance(cache, KVCache) and cache.max_length == max_len
    assert [k.shape for k in cache.k] == [(3, 2, 8, max_len)] * 2  # [B, K, H, S] per layer
    assert [v.shape for v in cache.v] == [(3, 2, max_len, 8)] * 2  # [B, K, S, H] per layer
    logits, cache = step(state, ids[:, :P], positions[:, :P], cache, jnp.int32(0), kv_mask)
    real = mask[:, :P]
    np.testing.assert_allclose(np.asarray(logits)[real], full[:, :P][real], atol=2e-5)
    for t in range(P, total):
        kv_mask[:, t] = True
        logits, cache = step(state, ids[:, t:t + 1], positions[:, t:t + 1], cache,
                             jnp.int32(t), kv_mask)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=2e-5,
                                   err_msg=f"step {t}")


def test_chunked_prefill_and_stale_slots():
    """Prefill in two chunks (T > 1 at cache_index > 0); garbage in unmasked-out future
    slots and in masked slots must not leak into the logits."""
    model = _scaled_model(TINY, seed=5)
    rng = np.random.RandomState(2)
    ids, mask, _ = _left_padded_batch(rng, TINY.vocab_size, [9, 6], 9)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    full = np.asarray(forward(model, ids, positions=positions, attention_mask=mask))
    cache = model.init_cache(2, 12)
    cache = KVCache(k=tuple(k + 5.0 for k in cache.k),
                    v=tuple(v - 3.0 for v in cache.v))  # stale values everywhere
    kv_mask = np.zeros((2, 12), bool)
    kv_mask[:, :9] = mask
    graphdef, state = nnx.split(model)
    decode = jax.jit(lambda st, *a: nnx.merge(graphdef, st).decode(*a))
    l1, cache = decode(state, ids[:, :4], positions[:, :4], cache, jnp.int32(0), kv_mask)
    l2, cache = decode(state, ids[:, 4:], positions[:, 4:], cache, jnp.int32(4), kv_mask)
    got = np.concatenate([np.asarray(l1), np.asarray(l2)], axis=1)
    np.testing.assert_allclose(got[mask], full[mask], atol=2e-5)


def test_out_of_range_pad_ids_do_not_leak():
    """Padding ids -1 or >= V at masked positions leave the real logits unchanged (no NaN)."""
    model = _scaled_model(TINY, seed=6)
    ids = np.random.RandomState(3).randint(0, TINY.vocab_size, (2, 6)).astype(np.int32)
    mask = np.ones((2, 6), bool)
    mask[0, :2] = False
    mask[1, -1] = False
    fwd = jit_method(model)  # one program for the three calls
    want = np.asarray(fwd(ids, attention_mask=mask))
    for pad in (-1, TINY.vocab_size + 5):
        got = np.asarray(fwd(np.where(mask, ids, pad), attention_mask=mask))
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[mask], want[mask])


def test_bf16_forward_close_to_f32():
    model = _scaled_model(TINY, seed=4)
    ids = np.random.RandomState(0).randint(0, TINY.vocab_size, (2, 6))
    want = np.asarray(forward(model, ids))
    state = nnx.state(model, nnx.Param)
    bf_graphdef, _ = nnx.split(nnx.eval_shape(  # the structure only (the values come from the f32 model)
        lambda: Qwen3ForCausalLM(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)))
    bf = nnx.merge(bf_graphdef, jax.jit(lambda s: jax.tree.map(lambda x: x.astype(jnp.bfloat16), s))(state))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(bf, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    got = forward(bf, ids)
    assert got.dtype == jnp.float32
    assert np.abs(np.asarray(got) - want).max() < 0.1 * np.abs(want).max()


def test_model_holds_only_params_and_grads_are_finite():
    model = _scaled_model(TINY)
    graphdef, state = nnx.split(model)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert variables and all(type(v) is nnx.Param for v in variables)
    ids = np.arange(12).reshape(2, 6) % TINY.vocab_size

    def loss(state):
        logits = nnx.merge(graphdef, state)(ids)
        return -jax.nn.log_softmax(logits)[..., 0].mean()

    grads = jax.jit(jax.grad(loss))(state)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_bad_inputs():
    model = _scaled_model(TINY)
    with pytest.raises(ValueError, match="positions"):
        model(np.zeros((2, 3), np.int32), positions=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        model(np.zeros((2, 3), np.int32), attention_mask=np.ones((2, 2)))
    with pytest.raises(ValueError, match="input_ids"):
        model(np.zeros((3,), np.int32))
    cache = model.init_cache(2, 5)
    with pytest.raises(ValueError, match="kv_mask"):
        model.decode(np.zeros((2, 1), np.int32), np.zeros((2, 1), np.int32), cache, 0,
                     np.ones((2, 4), bool))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 0, "hidden_size"),
    ("num_key_value_heads", 3, "divisible"),
    ("head_dim", 7, "head_dim"),
    ("rope_theta", -1.0, "rope_theta"),
    ("vocab_size", 2.5, "vocab_size"),
    ("tie_word_embeddings", 1, "tie_word_embeddings"),
])
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **{field: value})


def test_hf_dict_round_trip_and_transformers_accepts_it():
    d = TINY.to_hf_dict()
    assert d["model_type"] == "qwen3" and d["architectures"] == ["Qwen3ForCausalLM"]
    assert Qwen3Config.from_hf_dict(d) == TINY
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(**d)
    assert Qwen3Config.from_hf_dict(hf.to_dict()) == TINY  # 5.x layout (rope_parameters)


@pytest.mark.parametrize("update,field", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 128}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts": 8}, "num_experts"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
])
def test_from_hf_dict_rejects_unsupported(update, field):
    d = {**TINY.to_hf_dict(), **update}
    with pytest.raises(ValueError, match=field):
        Qwen3Config.from_hf_dict(d)


def test_from_hf_dict_missing_field():
    d = TINY.to_hf_dict()
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        Qwen3Config.from_hf_dict(d)


def test_kv_cache_grow_keeps_slots_and_appends_zeros():
    model = _scaled_model(TINY, seed=7)
    cache = model.init_cache(2, 4)
    cache = jax.tree.map(lambda x: x + 1.0, cache)
    grown = cache.grow(3)
    assert grown.max_length == 7 and grown.num_layers == cache.num_layers
    for old, new in zip(cache.k, grown.k):
        np.testing.assert_array_equal(np.asarray(new[..., :4]), np.asarray(old))
        assert not np.asarray(new[..., 4:]).any()
    for old, new in zip(cache.v, grown.v):
        np.testing.assert_array_equal(np.asarray(new[:, :, :4]), np.asarray(old))
        assert not np.asarray(new[:, :, 4:]).any()
    with pytest.raises(ValueError, match="extra"):
        cache.grow(-1)


@pytest.mark.slow
def test_decode_rejects_mismatched_cache_and_out_of_range_index():
    """A cache of the wrong structure or a cache_index leaving the cache is a named error, never a
    silently shorter model or a clamped write (dynamic_update_slice clamps its start)."""
    model = _scaled_model(TINY, seed=8)
    ids = np.ones((2, 3), np.int32)
    pos = np.tile(np.arange(3, dtype=np.int32), (2, 1))
    kv_mask = np.ones((2, 10), bool)
    cache = model.init_cache(2, 10)
    with pytest.raises(ValueError, match="1 value arrays"):
        model.decode(ids, pos, KVCache(k=cache.k, v=cache.v[:1]), 0, kv_mask)
    with pytest.raises(ValueError, match="cache layer 0"):
        model.decode(ids, pos, model.init_cache(3, 10), 0, kv_mask)  # cache batch 3 != 2
    with pytest.raises(ValueError, match="cache layer 1"):
        bad = KVCache(k=cache.k[:1] + (cache.k[1][..., :9],), v=cache.v)
        model.decode(ids, pos, bad, 0, kv_mask)
    for index in (-1, 8, 10):
        with pytest.raises(ValueError, match=f"cache_index {index} with T = 3"):
            model.decode(ids, pos, cache, index, kv_mask)
    with pytest.raises(ValueError, match="1 <= T <= S"):
        model.decode(np.ones((2, 0), np.int32), np.ones((2, 0), np.int32), cache, 0, kv_mask)
    # The last legal start (a static index: the check runs at trace time; one compiled program).
    logits, _ = jit_method(model, "decode", cache_index=7)(ids, pos, cache, kv_mask=kv_mask)
    assert logits.shape == (2, 3, TINY.vocab_size)
    for extra in (2.5, True, -1):
        with pytest.raises(ValueError, match="static int"):
            cache.grow(extra)


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_config_rejects_infinite_floats(field):
    with pytest.raises(ValueError, match=f"Qwen3Config.{field}"):
        dataclasses.replace(TINY, **{field: float("inf")})


def test_decode_kv_window_reads_only_the_window():
    """``decode(kv_window=(i, widths))`` gives, bit for bit, the logits and written slots of a decode over a cache
    physically cut to widths[i] (the continuous engine's cache phases); slots past the width are never read (NaN
    there leaves the result finite, while a decode of the whole cache turns NaN); bad widths are named errors."""
    model = _scaled_model(TINY, seed=9)
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(3)
    B, P, S = 3, 6, 24
    ids, mask, _ = _left_padded_batch(rng, TINY.vocab_size, [6, 3, 5], P)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    kv_mask = np.zeros((B, S), bool)
    kv_mask[:, :P] = mask
    kv_mask[:, P:] = True  # generated slots: hidden past each row's own index by causality
    _, cache = jit_method(model, "decode")(ids, positions, model.init_cache(B, S), 0, kv_mask)
    index = np.array([P, P + 2, P + 3], np.int32)  # each row at its own slot (continuous batching)
    tok = rng.randint(0, TINY.vocab_size, size=(B, 1)).astype(np.int32)
    pos = (positions[:, -1:] + 1 + index[:, None] - P).astype(np.int32)

    @jax.jit  # one program for every width (the width is an argument)
    def nan_tail(c, w):
        return KVCache(k=tuple(jnp.where(jnp.arange(S) >= w, jnp.nan, k) for k in c.k),  # k: [B, K, H, S]
                       v=tuple(jnp.where(jnp.arange(S)[:, None] >= w, jnp.nan, v) for v in c.v))  # v: [B, K, S, H]

    def cut(c, w):
        return KVCache(k=tuple(k[..., :w] for k in c.k), v=tuple(v[:, :, :w] for v in c.v))

    @jax.jit
    def windowed(state, cache, phase):
        return nnx.merge(graphdef, state).decode(tok, pos, cache, index, kv_mask, kv_window=(phase, (10, 16, S)))

    @functools.partial(jax.jit, static_argnums=2)
    def plain(state, cache, width):  # a decode over the cache physically cut to width slots
        return nnx.merge(graphdef, state).decode(tok, pos, cut(cache, width), index, kv_mask[:, :width])

    for phase, width in enumerate((10, 16, S)):
        got, got_cache = windowed(state, nan_tail(cache, width), jnp.int32(phase))
        want, want_cache = plain(state, cache, width)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        got_cache = jax.device_get(got_cache)
        for a, b in zip(cut(got_cache, width).k + cut(got_cache, width).v, want_cache.k + want_cache.v):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if width < S:
            assert np.isnan(np.asarray(plain(state, nan_tail(cache, width), S)[0])).any()
    for widths in ((), (0,), (10, S + 1), (10.0,), (True,)):
        with pytest.raises(ValueError, match="kv_window widths must be static ints in"):
            model.decode(tok, pos, cache, index, kv_mask, kv_window=(0, widths))
    for bad in (-1, 3, np.array([0, 1])):
        with pytest.raises(ValueError, match=r"kv_window index must be a scalar in \[0, 3\)"):
            model.decode(tok, pos, cache, index, kv_mask, kv_window=(bad, (10, 16, S)))
