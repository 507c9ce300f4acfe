"""Parameter-space predictive direction Ḋᵖ = ⟨∇_θ D_t, Δθ⟩: finite differences, identity-map reduction, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis.param_direction import param_directional_change, param_jvp_topk_kl, parameter_update
from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM


def _behaviour(rng, shape, vocab, k):
    """A behaviour top-K view (ids, log μ, log μ(y_t)) of a random μ, and sampled tokens drawn from μ."""
    zq = rng.normal(size=shape + (vocab,)) * 1.5
    logmu = zq - np.log(np.exp(zq).sum(-1, keepdims=True))
    topk_ids = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    topk_lp = np.take_along_axis(logmu, topk_ids, -1).astype(np.float32)
    u = rng.random(shape + (1,))
    tokens = np.minimum((np.cumsum(np.exp(logmu), -1) < u).sum(-1), vocab - 1).astype(np.int32)
    beh = np.take_along_axis(logmu, tokens[..., None], -1)[..., 0].astype(np.float32)
    return tokens, topk_ids, topk_lp, beh


def test_identity_map_reduces_to_the_logit_space_closed_form():
    """θ = z (the model is the identity) and Δθ = e_k − π: Ḋᵖ is the bucket_exact Ḋ the PDM mask uses."""
    rng = np.random.default_rng(0)
    b, t, v, k = 3, 5, 12, 3
    tokens, topk_ids, topk_lp, beh = _behaviour(rng, (b, t), v, k)
    z = jnp.asarray(rng.normal(size=(b, t, v)) * 2, jnp.float32)
    direction = tr.policy_gradient_direction(z, tokens)
    d, d_dot = jax.jit(lambda zz, dz: param_directional_change(lambda p: p, zz, dz, tokens, topk_ids, topk_lp,
                                                                beh))(z, direction)
    closed = tr.kl_directional_derivative(z, tokens, topk_ids, topk_lp, beh, estimator="bucket_exact")
    np.testing.assert_allclose(d, tr.topk_kl(z, tokens, topk_ids, topk_lp, beh), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(d_dot, closed, rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(closed)).max() > 1e-2  # not a vacuous 0 = 0
    # Linear in Δθ: a scaled and sign-flipped step scales Ḋᵖ.
    _, d_dot2 = param_directional_change(lambda p: p, z, -2.5 * direction, tokens, topk_ids, topk_lp, beh)
    np.testing.assert_allclose(d_dot2, -2.5 * np.asarray(d_dot), rtol=1e-5, atol=1e-6)


def _tiny_qwen3():
    cfg = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return nnx.split(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.slow  # model init, the AdamW step, the jvp and the difference quotient's program
def test_equals_finite_difference_along_an_adamw_update_on_tiny_qwen3():
    """Ḋᵖ (one jvp through the model) = d/dε D_t(θ + εΔθ) by a 6th-order central difference, 1e-4 relative, f32.

    Δθ is an actual AdamW update (optax) of a policy-gradient-like loss on the same batch, so the
    step moves every token's logits through shared parameters (not along e_k − π).
    """
    graphdef, params = _tiny_qwen3()
    rng = np.random.default_rng(1)
    b, p, t, v, k, tau = 2, 3, 4, 16, 3, 0.8
    prompt_ids = jnp.asarray(rng.integers(0, v, size=(b, p)), jnp.int32)
    prompt_mask = jnp.ones((b, p), bool)
    tokens, topk_ids, topk_lp, beh = _behaviour(rng, (b, t), v, k)
    cmask = jnp.ones((b, t), bool)
    adv = jnp.asarray([[1.0], [-0.7]], jnp.float32)

    def logits_fn(prm):
        return ts.completion_logits(graphdef, prm, prompt_ids, prompt_mask, tokens, cmask) / tau

    def loss(prm):
        return -jnp.mean(adv * tr.token_logprobs(logits_fn(prm), tokens))

    opt = optax.adamw(1e-3)

    @jax.jit  # each stage one compiled program (op by op, the tree's leaves compile one by one)
    def adamw_update(prm):
        updates, _ = opt.update(jax.grad(loss)(prm), opt.init(prm), prm)
        return parameter_update(prm, optax.apply_updates(prm, updates))

    delta = adamw_update(params)
    d, d_dot = jax.jit(lambda prm, dlt: param_jvp_topk_kl(graphdef, prm, dlt, prompt_ids, prompt_mask, tokens, cmask,
                                                          topk_ids, topk_lp, beh, temperature=tau))(params, delta)

    d_of = jax.jit(lambda eps: tr.topk_kl(logits_fn(jax.tree.map(lambda a, s: a + eps * s, params, delta)),
                                          tokens, topk_ids, topk_lp, beh))
    # 6th-order central difference: f32 rounding of D limits a plain central difference to ~1e-3 here
    # (the AdamW step is strongly curved at h >= 0.3 and rounding-limited at h <= 0.1).
    h = 0.2
    f = {m: np.asarray(d_of(m * h), np.float64) for m in (-3, -2, -1, 1, 2, 3)}
    fd = (45 * (f[1] - f[-1]) - 9 * (f[2] - f[-2]) + (f[3] - f[-3])) / (60 * h)
    np.testing.assert_allclose(d, d_of(0.0), rtol=1e-6, atol=1e-8)
    scale = float(np.abs(np.asarray(d_dot)).max())
    assert scale > 1e-4  # the step moves the divergences measurably
    np.testing.assert_allclose(d_dot, fd, rtol=1e-4, atol=1e-4 * scale)
    # The realized change of the whole step: same sign on every token, first order within 15% of the
    # largest change (the rest is the step's curvature; measured 11% here).
    realized = np.asarray(d_of(1.0) - d_of(0.0))
    np.testing.assert_array_equal(np.sign(realized), np.sign(np.asarray(d_dot)))
    np.testing.assert_allclose(realized, d_dot, rtol=0, atol=0.15 * scale)

def test_bad_update_trees_are_refused_with_the_leaf_named():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))}
    with pytest.raises(ValueError, match="tree structure"):
        parameter_update(params, {"w": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\)"):
        param_directional_change(lambda p: p["w"], params, {"w": jnp.ones((2, 3)), "b": jnp.ones((4,))},
                                 jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1)),
                                 jnp.zeros((2,)))
    with pytest.raises(ValueError, match=r"params\['n'\] has dtype int32"):
        parameter_update({"n": jnp.ones((2,), jnp.int32)}, {"n": jnp.ones((2,), jnp.int32)})
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        param_jvp_topk_kl(None, params, params, *([jnp.zeros((1, 1), jnp.int32)] * 4), jnp.zeros((1, 1, 1), jnp.int32),
                          jnp.zeros((1, 1, 1)), jnp.zeros((1, 1)), temperature=0.0)
    # bf16 parameters give a bf16 tangent (jvp needs the primal dtype); the difference is exact here.
    before = {"w": jnp.asarray([1.0, 2.0], jnp.bfloat16)}
    delta = parameter_update(before, {"w": jnp.asarray([1.5, 1.0], jnp.bfloat16)})
    assert delta["w"].dtype == jnp.bfloat16 and list(np.asarray(delta["w"], np.float32)) == [0.5, -1.0]
