"""The sequence-chunked RL loss equals the unchunked one (values, gradients, statistics)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.rl import chunked_loss, train_step as ts, trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl.step_batch import StepBatch

VOCAB, P, T, K, B = 61, 3, 7, 4, 4


@functools.lru_cache(maxsize=1)
def _setup():
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    # Built in one compiled program (its initialisers not compiled one by one): the same random draws, the weights
    # equal to float rounding; every test compares two computations on these same weights.
    model = nnx.jit(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))()
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, VOCAB, (B, P)).astype(np.int32)
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[0, 0] = False  # left padding
    completion_ids = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    lengths = np.array([T, 5, 1, 6])
    completion_mask = np.arange(T)[None, :] < lengths[:, None]
    # Behaviour = the model's own (tempered) distribution plus noise of a per-token scale, so
    # that some tokens are inside the trust region and some are far outside.
    tau = 0.9
    logits = jax.jit(ts.completion_logits, static_argnums=0)(  # one program, not the forward op by op
        graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask) / tau
    scale = rng.choice([0.0, 0.05, 0.3, 2.0], size=(B, T, 1))
    mu_logits = np.asarray(logits) * 20.0 + scale * rng.standard_normal((B, T, VOCAB))  # sharpened: tail matters
    logmu = np.asarray(jax.nn.log_softmax(jnp.asarray(mu_logits), axis=-1))
    topk_ids = np.argsort(-logmu, axis=-1)[..., :K].astype(np.int32)
    batch = StepBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask,
        behavior_logprobs=np.take_along_axis(logmu, completion_ids[..., None], -1)[..., 0].astype(np.float32),
        topk_ids=topk_ids, topk_logprobs=np.take_along_axis(logmu, topk_ids, -1).astype(np.float32),
        advantages=np.array([1.0, -0.5, 0.7, -1.2], np.float32),
        ref_logprobs=(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), completion_ids[..., None], -1)[..., 0]
                      - 0.1).astype(np.float32),
    )
    return graphdef, params, jax.tree.map(jnp.asarray, batch), tau


def _loss_and_grads(tr_config, loss_config):
    graphdef, params, batch, _ = _setup()
    fn = jax.jit(jax.value_and_grad(ts.make_rl_loss(graphdef, tr_config, loss_config), has_aux=True))
    (loss, aux), grads = fn(params, batch)
    return float(loss), jax.device_get(aux), jax.device_get(grads)


_slow = pytest.mark.slow  # ~10-20 s each (three compiles of a loss + gradient)
CASES = [
    ("pdm_bucket_exact", dict(mask="pdm", estimator="bucket_exact"), {}, (3,)),
    ("dppo", dict(mask="dppo"), {}, (3,)),
    pytest.param("pdm_aggregated_tail", dict(mask="pdm", estimator="aggregated_tail"), {}, (3,), marks=_slow),
    pytest.param("pdm_uniform_tail", dict(mask="pdm", estimator="uniform_tail"), {}, (3,), marks=_slow),
    pytest.param("pdm_autodiff_tv", dict(mask="pdm", divergence="topk_tv", estimator="autodiff"), {}, (3,),
                 marks=_slow),
    pytest.param("ppo_clip", dict(mask="ppo"), dict(policy_loss="ppo_clip", dual_clip=3.0), (3,), marks=_slow),
    pytest.param("pdm_seqmean_kl", dict(mask="pdm", estimator="bucket_exact"),
                 dict(loss_aggregation="seq_mean_token_mean", kl_beta=0.1), (1, 8), marks=_slow),
]


@pytest.mark.parametrize("name,tr_kw,loss_kw,chunks", CASES)
@pytest.mark.slow
def test_chunked_equals_unchunked(name, tr_kw, loss_kw, chunks):
    _, _, _, tau = _setup()
    tr_config = trust_region.TrustRegionConfig(delta=0.02, **tr_kw)
    base = dict(temperature=tau, max_response_length=T, **loss_kw)
    loss0, aux0, g0 = _loss_and_grads(tr_config, PolicyLossConfig(**base))
    # The mask is not trivial: some valid tokens kept, some dropped.
    assert 0.0 < aux0["frac_masked"] < 0.9, aux0["frac_masked"]
    for chunk in chunks:  # 3 does not divide T = 7: the padded tail chunk is exercised; 8 > T
        loss1, aux1, g1 = _loss_and_grads(tr_config, PolicyLossConfig(logits_chunk_size=chunk, **base))
        np.testing.assert_allclose(loss1, loss0, rtol=1e-5, atol=1e-7)
        assert set(aux1) == set(aux0)
        for k in aux0:
            np.testing.assert_allclose(aux1[k], aux0[k], rtol=1e-5, atol=1e-6, err_msg=k)
        flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
        assert len(flat0) == len(flat1)
        scale = max(float(np.max(np.abs(x))) for x in flat0)
        assert scale > 0
        for a, b in zip(flat0, flat1):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale)


def test_hidden_states_then_head_equals_forward():
    graphdef, params, batch, _ = _setup()
    model = nnx.merge(graphdef, params)
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], 1)
    np.testing.assert_array_equal(model.logits_from_hidden(model.hidden_states(ids, attention_mask=mask)),
                                  model(ids, attention_mask=mask))


def test_chunk_size_validation():
    with pytest.raises(ValueError, match="logits_chunk_size"):
        PolicyLossConfig(logits_chunk_size=-1)
    with pytest.raises(ValueError, match="logits_chunk_size"):
        chunked_loss.make_chunked_rl_terms(None, trust_region.TrustRegionConfig(), PolicyLossConfig(), 0)


def _temp_bytes(t, chunk, vocab=16384, d=16):
    """Compiled temp memory of loss+grad w.r.t. (hidden states, head) for a [1,t,vocab] problem."""
    tr_config = trust_region.TrustRegionConfig(mask="pdm", estimator="bucket_exact")
    loss_config = PolicyLossConfig(logits_chunk_size=chunk)
    k = 8
    args = (jax.ShapeDtypeStruct((1, t, d), jnp.float32), jax.ShapeDtypeStruct((d, vocab), jnp.float32),
            StepBatch(prompt_ids=None, prompt_mask=None,
                      completion_ids=jax.ShapeDtypeStruct((1, t), jnp.int32),
                 completion_mask=jax.ShapeDtypeStruct((1, t), jnp.bool_),
                 behavior_logprobs=jax.ShapeDtypeStruct((1, t), jnp.float32),
                 topk_ids=jax.ShapeDtypeStruct((1, t, k), jnp.int32),
                 topk_logprobs=jax.ShapeDtypeStruct((1, t, k), jnp.float32),
                 advantages=jax.ShapeDtypeStruct((1,), jnp.float32)))

    def loss(h, w, batch):
        head = lambda x: jnp.einsum("bcd,dv->bcv", x, w)  # noqa: E731
        if chunk:
            per_token = chunked_loss.chunked_rl_terms(h, head, batch, tr_config, loss_config, chunk)["per_token"]
        else:
            logits = head(h)
            mask, logprobs, _ = trust_region.trust_region_mask_and_logprobs(
                logits, batch.completion_ids, batch.topk_ids, batch.topk_logprobs,
                batch.behavior_logprobs, batch.advantages, batch.completion_mask, tr_config)
            per_token = jnp.where(mask, -logprobs, 0.0)
        return jnp.sum(per_token)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_temp_memory_does_not_grow_with_length():
    full_256, full_512 = _temp_bytes(256, 0), _temp_bytes(512, 0)
    chunk_256, chunk_512 = _temp_bytes(256, 32), _temp_bytes(512, 32)
    logits_bytes_512 = 512 * 16384 * 4
    assert full_512 > 1.5 * full_256 and full_512 > logits_bytes_512  # unchunked: grows with T
    assert chunk_512 < 1.2 * chunk_256  # chunked: bounded by the chunk, not T
    assert chunk_512 < 0.25 * full_512
