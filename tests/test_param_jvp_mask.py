"""trust_region.direction = "param_jvp": the PDM mask with Ḋᵖ along the unmasked update, inside the train step.

References are written here independently of pdm_jax.rl.loss / trust_region's mask: the unmasked and masked
truncated-IS losses by hand, Δθ from optax on jax.grad of the hand-written loss, and Ḋᵖ_t as the explicit
dot product <jax.jacrev(D)(θ)[t], Δθ> (one reverse-mode gradient per token, no jvp).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from pdm_jax import config as run_config
from pdm_jax import sharding as shd
from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.distributed import opt_state_shardings, put_global_batch
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl.step_batch import StepBatch

CFG = Qwen3Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
TAU, DELTA, CAP, LR = 0.7, 0.0015, 5.0, 1e-2
PARAM_JVP = tr.TrustRegionConfig(mask="pdm", delta=DELTA, direction="param_jvp")


@pytest.fixture(scope="module")
def setup():
    """A tiny Qwen3 and an off-policy mini-batch (μ = π of a perturbed model): many tokens out of the region."""
    graphdef, params = nnx.split(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0)))
    _, other = nnx.split(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)))
    behaviour_params = jax.tree.map(lambda a, b: a + 0.5 * (b - a), params, other)
    rng = np.random.default_rng(0)
    b, p, t, k = 4, 3, 5, 3
    batch = StepBatch(
        prompt_ids=rng.integers(0, 12, (b, p)).astype(np.int32), prompt_mask=np.ones((b, p), bool),
        completion_ids=rng.integers(0, 12, (b, t)).astype(np.int32),
        completion_mask=np.arange(t)[None, :] < np.array([5, 3, 4, 5])[:, None],
        advantages=np.array([1.0, -0.5, 0.75, -1.0], np.float32))
    logp = jax.nn.log_softmax(ts.completion_logits(graphdef, behaviour_params, batch.prompt_ids, batch.prompt_mask,
                                                   batch.completion_ids, batch.completion_mask) / TAU, -1)
    top_lp, top_ids = jax.lax.top_k(logp, k)
    batch = batch.replace(
        behavior_logprobs=np.asarray(jnp.take_along_axis(logp, batch.completion_ids[..., None], -1)[..., 0]),
        topk_ids=np.asarray(top_ids), topk_logprobs=np.asarray(top_lp))
    return graphdef, params, jax.tree.map(jnp.asarray, batch)


def _logits(graphdef, params, batch):
    return ts.completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                batch.completion_mask) / TAU


def _tis_loss(graphdef, params, batch, keep):
    """-Σ_valid A sg(min(r, C)) M log π(y) / #valid (token_mean), by hand."""
    logp = jax.nn.log_softmax(_logits(graphdef, params, batch), -1)
    lp = jnp.take_along_axis(logp, batch.completion_ids[..., None], -1)[..., 0]
    w = jax.lax.stop_gradient(jnp.minimum(jnp.exp(lp - batch.behavior_logprobs), CAP))
    valid = batch.completion_mask
    return -jnp.sum(jnp.where(valid & keep, batch.advantages[:, None] * w * lp, 0.0)) / valid.sum()


def _reference(graphdef, params, batch, tx):
    """(D, Ḋᵖ by explicit per-token gradients · Δθ, the keep mask, params after the masked step), as one compiled
    program (the same operations as run one by one, without building a program for each)."""
    return jax.jit(lambda p, b: _reference_ops(graphdef, p, b, tx))(params, batch)


def _reference_ops(graphdef, params, batch, tx):
    opt_state = tx.init(params)
    all_kept = jnp.ones(batch.completion_ids.shape, bool)
    grads_u = jax.grad(lambda p: _tis_loss(graphdef, p, batch, all_kept))(params)
    delta, _ = tx.update(grads_u, opt_state, params)

    def d_of(prm):
        return tr.topk_kl(_logits(graphdef, prm, batch), batch.completion_ids, batch.topk_ids,
                          batch.topk_logprobs, batch.behavior_logprobs)

    jac = jax.jacrev(d_of)(params)  # leaves [B,T, *leaf shape]
    d_dot = sum(jnp.tensordot(j, dl, axes=dl.ndim) for j, dl in zip(jax.tree.leaves(jac), jax.tree.leaves(delta)))
    d = d_of(params)
    keep = ~((d > DELTA) & (d_dot > 0))
    grads = jax.grad(lambda p: _tis_loss(graphdef, p, batch, keep))(params)
    updates, _ = tx.update(grads, opt_state, params)
    return d, d_dot, keep, optax.apply_updates(params, updates)


def _run(graphdef, params, batch, tx, tr_config, **loss_kw):
    lc = PolicyLossConfig(temperature=TAU, tis_cap=CAP, **loss_kw)
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    new_state, metrics = jax.jit(ts.make_rl_train_step(graphdef, tx, tr_config, lc))(state, batch)
    return jax.device_get(metrics), jax.device_get(new_state.params)


def _assert_params_close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.mark.slow  # ~30-60 s on the loaded 2-core CPU (jacrev over 20 tokens, three compiles)
def test_keep_decisions_and_step_equal_the_explicit_gradient_reference(setup):
    graphdef, params, batch = setup
    tx, _ = ts.make_optimizer(LR)  # the trainer's AdamW with global-norm clipping
    d, d_dot_ref, keep_ref, params_ref = _reference(graphdef, params, batch, tx)
    valid = np.asarray(batch.completion_mask)
    outside = valid & (np.asarray(d) > DELTA)
    # The test means something: tokens out of region with either sign of Ḋᵖ, none of them near 0.
    assert (outside & (np.asarray(d_dot_ref) > 0)).sum() >= 2 and (outside & (np.asarray(d_dot_ref) <= 0)).sum() >= 2
    scale = float(np.abs(np.asarray(d_dot_ref)[valid]).max())
    assert np.abs(np.asarray(d_dot_ref)[outside]).min() > 1e-3 * scale

    # Ḋᵖ of the step's pieces (one jvp along the optimizer's update of the unmasked gradient) = the reference.
    def unmasked_update(params, batch):
        loss = ts.make_rl_loss(graphdef, dataclasses.replace(PARAM_JVP, mask="none", direction="per_token"),
                               PolicyLossConfig(temperature=TAU, tis_cap=CAP))
        grads_u = jax.grad(lambda p: loss(p, batch)[0])(params)
        return tx.update(grads_u, tx.init(params), params)[0]

    delta = jax.jit(unmasked_update)(params, batch)
    divergence_fn = ts.make_token_divergence(graphdef, PARAM_JVP, PolicyLossConfig(temperature=TAU))
    d_dot = jax.jit(ts.param_direction_along, static_argnums=0)(divergence_fn, params, delta, batch)
    np.testing.assert_allclose(np.where(valid, d_dot, 0), np.where(valid, d_dot_ref, 0), rtol=1e-4, atol=1e-4 * scale)

    # The step's keep decisions: its masked fraction, kept-outside fraction and the step itself equal the reference.
    metrics, params_after = _run(graphdef, params, batch, tx, PARAM_JVP)
    masked_ref = valid & ~np.asarray(keep_ref)
    np.testing.assert_allclose(metrics["frac_masked"], masked_ref.sum() / valid.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_outside"], outside.sum() / valid.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_outside_kept"], (outside & np.asarray(keep_ref)).sum() / outside.sum(),
                               rtol=1e-6)
    _assert_params_close(params_after, params_ref)
    # ... and they differ from the logit-space PDM mask's here (the criterion is not a relabelled estimator).
    pdm_metrics, _ = _run(graphdef, params, batch, tx, dataclasses.replace(PARAM_JVP, direction="per_token"))
    assert "frac_outside_kept" not in pdm_metrics and "frac_direction_disagree" in metrics


@pytest.mark.slow  # ~40-80 s: two steps compiled per variant
@pytest.mark.parametrize("loss_kw", [dict(micro_batch_size=2), dict(logits_chunk_size=2),
                                     dict(micro_batch_size=1, logits_chunk_size=3,
                                          loss_aggregation="seq_mean_token_mean")])
def test_micro_batched_and_chunked_steps_equal_the_one_shot_step(setup, loss_kw):
    graphdef, params, batch = setup
    tx, _ = ts.make_optimizer(LR)
    one_kw = {k: v for k, v in loss_kw.items() if k == "loss_aggregation"}
    m0, p0 = _run(graphdef, params, batch, tx, PARAM_JVP, **one_kw)
    m1, p1 = _run(graphdef, params, batch, tx, PARAM_JVP, **loss_kw)
    assert set(m0) == set(m1) and 0.0 < m0["frac_outside_kept"] < 1.0
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    _assert_params_close(p1, p0)


@pytest.mark.slow  # ~30-60 s on the loaded 2-core CPU: two steps compiled
def test_huge_delta_is_the_unmasked_step(setup):
    """δ = 1e6: nothing is out of region, so the param_jvp step is exactly the mask="none" step."""
    graphdef, params, batch = setup
    tx = optax.sgd(1.0)
    m_jvp, p_jvp = _run(graphdef, params, batch, tx, dataclasses.replace(PARAM_JVP, delta=1e6))
    m_none, p_none = _run(graphdef, params, batch, tx, tr.TrustRegionConfig(mask="none", delta=1e6))
    assert m_jvp["frac_outside"] == 0.0 and m_jvp["frac_masked"] == 0.0 and m_jvp["frac_outside_kept"] == 0.0
    for k in ("loss", "policy_loss", "grad_norm", "mean_ratio", "mean_topk_kl", "entropy"):
        # Two programs fused differently: f32 rounding in other orders (mean_topk_kl, a mean of differences of
        # logs, differs by 7e-6 relative where XLA:CPU's fusion emitters are off, 1.5e-5 on an AVX-512 FP16 host).
        np.testing.assert_allclose(m_jvp[k], m_none[k], rtol=3e-5 if k == "mean_topk_kl" else 1e-5, err_msg=k)
    assert m_none["grad_norm"] > 1e-3
    _assert_params_close(p_jvp, p_none, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~30-60 s: the sharded and the unsharded step compiled
def test_sharded_step_equals_unsharded(setup):
    """Under a data x fsdp x tensor mesh of 8 CPU devices (the trainer's shardings) the step is unchanged."""
    graphdef, params, batch = setup
    tx, _ = ts.make_optimizer(LR)
    m0, p0 = _run(graphdef, params, batch, tx, PARAM_JVP, micro_batch_size=2)
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    s_params = jax.device_put(params, shd.param_shardings(params, mesh))
    opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, s_params, mesh))(s_params)
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=s_params, opt_state=opt_state)
    step = ts.make_rl_train_step(graphdef, tx, PARAM_JVP, PolicyLossConfig(temperature=TAU, tis_cap=CAP,
                                                                           micro_batch_size=2))
    with shd.activation_sharding(mesh):
        new_state, m1 = jax.jit(step)(state, put_global_batch(batch, mesh, batch_axes=("data", "fsdp")))
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    _assert_params_close(jax.device_get(new_state.params), p0, rtol=1e-5, atol=1e-6)


def test_config_errors():
    with pytest.raises(ValueError, match=r"TrustRegionConfig.direction must be one of \('per_token', 'param_jvp'\), "
                                         r"got 'jvp'"):
        tr.TrustRegionConfig(direction="jvp")
    for mask in ("none", "ppo", "dppo"):
        with pytest.raises(ValueError, match=f"needs mask='pdm'.*got mask='{mask}'"):
            tr.TrustRegionConfig(mask=mask, direction="param_jvp")
    # Any divergence works (the jvp does not need a closed form); the estimator is unused.
    assert tr.TrustRegionConfig(mask="pdm", divergence="topk_tv", estimator="bucket_exact",
                                direction="param_jvp").uses_param_direction
    assert tr.criterion_settings("param_jvp") == {"mask": "pdm", "direction": "param_jvp"}
    z = jnp.zeros((1, 2, 5))
    args = (z, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2, 2), jnp.int32), jnp.zeros((1, 2, 2)),
            jnp.zeros((1, 2)), jnp.ones((1,)), jnp.ones((1, 2), bool))
    with pytest.raises(ValueError, match="param_direction must be given iff .*param_direction missing"):
        tr.trust_region_mask(*args, PARAM_JVP)
    with pytest.raises(ValueError, match="param_direction must be given iff .*param_direction given"):
        tr.trust_region_mask(*args, tr.TrustRegionConfig(), param_direction=jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"token shape \(1, 2\), got \(2,\)"):
        tr.trust_region_mask(*args, PARAM_JVP, param_direction=jnp.zeros((2,)))
    # The run config: the field, its alias and the error naming the trust_region section.
    c = run_config.get_base_config()
    assert c.trust_region.direction == "per_token"
    run_config.apply_arg(c, "direction=param_jvp,mask=dppo")
    assert c.trust_region.direction == "param_jvp"
    with pytest.raises(ValueError, match="trust_region: TrustRegionConfig.direction='param_jvp'.*mask='dppo'"):
        run_config.step_configs(c)
    c.trust_region.mask = "pdm"
    assert run_config.step_configs(c).trust_region.direction == "param_jvp"
    assert isinstance(c, ml_collections.ConfigDict)


def test_mask_keeps_out_of_region_tokens_by_the_sign_of_the_given_direction():
    """trust_region_mask with param_direction: masked iff D > δ and Ḋᵖ > 0, whatever the advantage's sign."""
    rng = np.random.default_rng(3)
    b, t, v, k = 2, 6, 9, 3
    z = rng.normal(size=(b, t, v)).astype(np.float32) * 2
    zq = rng.normal(size=(b, t, v)).astype(np.float32) * 2
    logmu = np.asarray(jax.nn.log_softmax(zq, -1))
    top_ids = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    args = (z, tokens, top_ids, np.take_along_axis(logmu, top_ids, -1),
            np.take_along_axis(logmu, tokens[..., None], -1)[..., 0])
    d = np.asarray(tr.topk_kl(*args))
    delta = float(np.median(d))
    p_dir = rng.normal(size=(b, t)).astype(np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    valid = np.ones((b, t), bool)
    valid[1, -1] = False
    cfg = tr.TrustRegionConfig(mask="pdm", delta=delta, direction="param_jvp")
    mask, stats = tr.trust_region_mask(*args, adv, valid, cfg, param_direction=p_dir)
    want = valid & ~((d > delta) & (p_dir > 0))
    np.testing.assert_array_equal(np.asarray(mask), want)
    outside = valid & (d > delta)
    assert float(stats["num_outside"]) == outside.sum() > 0
    assert float(stats["num_outside_kept"]) == (outside & want).sum()
    # A NaN direction at a valid position is counted as non-finite and masked; at padding it is ignored.
    p_nan = p_dir.copy()
    p_nan[0, 0] = np.nan
    p_nan[1, -1] = np.nan
    mask2, stats2 = tr.trust_region_mask(*args, adv, valid, cfg, param_direction=p_nan)
    assert float(stats2["num_nonfinite"]) == 1.0 and not bool(mask2[0, 0])
