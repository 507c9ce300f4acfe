"""The jitted RL loss of pdm_jax.rl.train_step on a tiny Qwen3: values against a direct computation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import assert_same_step
from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl.step_batch import StepBatch

CFG = Qwen3Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
TAU = 0.7


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    B, P, T, K = 4, 3, 5, 3
    batch = StepBatch(
        prompt_ids=rng.integers(0, 12, (B, P)).astype(np.int32),
        prompt_mask=np.ones((B, P), bool),
        completion_ids=rng.integers(0, 12, (B, T)).astype(np.int32),
        completion_mask=np.arange(T)[None, :] < np.array([5, 3, 1, 4])[:, None],
        advantages=np.array([1.0, -0.5, 0.25, -1.0], np.float32),
    )
    logits = ts.completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask,
                                  batch.completion_ids, batch.completion_mask) / TAU
    logp = jax.nn.log_softmax(logits, -1)
    top_lp, top_ids = jax.lax.top_k(logp, K)
    batch = batch.replace(
        behavior_logprobs=np.asarray(jnp.take_along_axis(logp, batch.completion_ids[..., None], -1)[..., 0]),
        topk_ids=np.asarray(top_ids), topk_logprobs=np.asarray(top_lp))
    return graphdef, params, batch


def _loss(graphdef, params, batch, mask="pdm"):
    loss_fn = ts.make_rl_loss(graphdef, trust_region.TrustRegionConfig(mask=mask, delta=0.05),
                              PolicyLossConfig(temperature=TAU))
    return jax.jit(loss_fn)(params, batch)


def test_on_policy_loss_is_the_policy_gradient_surrogate(setup):
    """Sampler = trainer (ratio 1, D = 0): loss = -sum(A log pi) / #valid tokens, nothing masked."""
    graphdef, params, batch = setup
    loss, aux = _loss(graphdef, params, batch)
    valid = batch.completion_mask
    want = -np.sum(batch.advantages[:, None] * batch.behavior_logprobs * valid) / valid.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    assert float(aux["frac_masked"]) == 0.0 and float(aux["frac_outside"]) == 0.0
    np.testing.assert_allclose(float(aux["mean_ratio"]), 1.0, atol=1e-5)
    np.testing.assert_allclose(float(aux["mean_topk_kl"]), 0.0, atol=1e-6)


@pytest.mark.slow
def test_padding_garbage_and_empty_batches_stay_finite(setup):
    graphdef, params, batch = setup
    pad = ~batch.completion_mask
    bad = batch.replace(behavior_logprobs=np.where(pad, np.nan, batch.behavior_logprobs).astype(np.float32),
                        topk_logprobs=np.where(pad[..., None], np.inf, batch.topk_logprobs).astype(np.float32))
    loss_ref, _ = _loss(graphdef, params, batch)
    loss_bad, _ = _loss(graphdef, params, bad)
    np.testing.assert_allclose(float(loss_bad), float(loss_ref), rtol=1e-6)
    empty = bad.replace(completion_mask=np.zeros_like(batch.completion_mask))
    for mask in ("pdm", "ppo"):
        grads = jax.grad(lambda p: _loss(graphdef, p, empty, mask)[0])(params)
        assert float(_loss(graphdef, params, empty, mask)[0]) == 0.0
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_off_policy_tokens_outside_the_region_are_masked_by_direction(setup):
    """Shift mu away from pi: the PDM mask drops exactly the tokens with D > delta and A * D' > 0."""
    graphdef, params, batch = setup
    off = batch.replace(behavior_logprobs=batch.behavior_logprobs - 1.0,  # mu(y) = pi(y) / e
                        topk_logprobs=batch.topk_logprobs - 1.0)
    _, aux = _loss(graphdef, params, off)
    logits = ts.completion_logits(graphdef, params, off.prompt_ids, off.prompt_mask,
                                  off.completion_ids, off.completion_mask) / TAU
    args = (logits, off.completion_ids, off.topk_ids, off.topk_logprobs, off.behavior_logprobs)
    d = np.asarray(trust_region.topk_kl(*args))
    dd = np.asarray(trust_region.kl_directional_derivative(*args, estimator="bucket_exact"))
    valid = off.completion_mask
    masked = valid & (d > 0.05) & (off.advantages[:, None] * dd > 0)
    assert masked.sum() > 0
    np.testing.assert_allclose(float(aux["frac_masked"]), masked.sum() / valid.sum(), rtol=1e-6)


@pytest.mark.parametrize("loss_kw, micro", [
    (dict(), 2),
    (dict(loss_aggregation="seq_mean_token_mean", kl_beta=0.1), 1),
    (dict(loss_aggregation="seq_mean_token_sum_norm", max_response_length=8, logits_chunk_size=2), 2),
])
@pytest.mark.slow
def test_micro_batched_step_equals_one_shot(setup, loss_kw, micro):
    """rl.micro_batch_size: loss, every metric and the gradient (one SGD step) equal the one-shot step's."""
    graphdef, params, batch = setup
    off = batch.replace(behavior_logprobs=batch.behavior_logprobs - 0.7, topk_logprobs=batch.topk_logprobs - 0.7,
                        ref_logprobs=batch.behavior_logprobs - 0.3)  # off-policy: some tokens masked
    tr = trust_region.TrustRegionConfig(mask="pdm", delta=0.05)
    tx = optax.sgd(1.0)  # params_after = params - grad

    def run(micro_batch_size):
        lc = PolicyLossConfig(temperature=TAU, micro_batch_size=micro_batch_size, **loss_kw)
        step = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, lc))
        state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
        new_state, metrics = step(state, jax.tree.map(jnp.asarray, off))
        return jax.device_get(metrics), jax.device_get(new_state.params)

    m0, p0 = run(0)
    m1, p1 = run(micro)
    assert 0.0 < m0["frac_masked"] < 1.0
    assert set(m0) == set(m1)
    assert_same_step(m1, p1, m0, p0, params)


def test_micro_batch_size_must_divide_the_mini_batch(setup):
    graphdef, params, batch = setup
    tx = optax.sgd(1.0)
    step = ts.make_rl_train_step(graphdef, tx, trust_region.TrustRegionConfig(),
                                 PolicyLossConfig(temperature=TAU, micro_batch_size=3))
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    with pytest.raises(ValueError, match="rl.micro_batch_size = 3 must divide the mini-batch of 4 sequences"):
        step(state, batch)
