"""Tests for pdm_jax.rl.objectives: advantages, TIS / PPO-clip losses, KL penalty, aggregation.

Closed forms are checked against jax.grad, PPO against an independent per-element
numpy reference, and aggregation against a full-batch computation under
micro-batching (1-token and 99-token chunks; sequence-aligned splits).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdm_jax.rl import loss as pl
from pdm_jax.rl import objectives as obj

RNG = np.random.default_rng(0)


def _token_logprobs(logits_BxTxV, tokens_BxT):
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens_BxT[..., None], axis=-1)[..., 0]


# --------------------------------------------------------------------------- #
# Advantages
# --------------------------------------------------------------------------- #


def test_group_advantages_mean_and_std_match_numpy():
    rewards = RNG.normal(size=12).astype(np.float32)
    g = 4
    r = rewards.reshape(-1, g)
    centred = r - r.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(obj.group_advantages(rewards, g), centred.reshape(-1), atol=1e-6)
    expected_std = centred / (r.std(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(
        obj.group_advantages(rewards, g, normalize_std=True), expected_std.reshape(-1), rtol=1e-5, atol=1e-6
    )
    # jit (traced rewards, static group size) gives the same numbers.
    jitted = jax.jit(lambda x: obj.group_advantages(x, g, normalize_std=True))
    np.testing.assert_allclose(jitted(rewards), expected_std.reshape(-1), rtol=1e-5, atol=1e-6)
    # Per-group advantages sum to 0 (mean baseline), rows prompt-major.
    np.testing.assert_allclose(np.asarray(obj.group_advantages(rewards, g)).reshape(-1, g).sum(1), 0, atol=1e-6)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_all_equal_group_gives_exact_zero(normalize_std):
    # 0.1 is not representable: the f32 group mean differs from 0.1 by rounding,
    # which 1/(std + eps) would amplify without the all-equal guard.
    rewards = np.array([0.1, 0.1, 0.1, 0.0, 1.0, 1.0, 7.3, 7.3, 7.3], np.float32)
    for fn in (lambda x: obj.group_advantages(x, 3, normalize_std=normalize_std),
               jax.jit(lambda x: obj.group_advantages(x, 3, normalize_std=normalize_std))):
        adv = np.asarray(fn(rewards))
        assert np.all(np.isfinite(adv))
        assert np.all(adv[:3] == 0.0) and np.all(adv[6:] == 0.0)
        assert np.all(adv[3:6] != 0.0)


def test_nan_reward_error_names_sample_and_group():
    rewards = np.zeros(8, np.float32)
    rewards[5] = np.nan
    with pytest.raises(ValueError, match=r"sample index 5 \(group 1, sample 1"):
        obj.group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="sample index 5"):
        obj.validate_rewards(rewards)
    rewards[5] = 0.0
    rewards[2] = -np.inf
    with pytest.raises(ValueError, match=r"-inf.*sample index 2 \(group 0"):
        obj.validate_rewards(rewards, group_size=4)


def test_group_size_errors_name_both_numbers():
    with pytest.raises(ValueError, match=r"N=10.*group_size=4"):
        obj.group_advantages(np.zeros(10, np.float32), 4)
    with pytest.raises(ValueError, match=r"N=10.*group_size=3"):
        obj.validate_rewards(np.zeros(10), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        obj.group_advantages(np.zeros(4, np.float32), 0)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        obj.group_advantages(np.zeros((2, 2), np.float32), 2)


# --------------------------------------------------------------------------- #
# Truncated-IS loss
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_tis_gradient_equals_closed_form_on_softmax_logits():
    b, t, v, cap = 3, 5, 7, 1.5
    logits = jnp.asarray(RNG.normal(size=(b, t, v)) * 1.5, jnp.float32)
    behavior_logits = logits + jnp.asarray(RNG.normal(size=(b, t, v)), jnp.float32)
    tokens = jnp.asarray(RNG.integers(0, v, size=(b, t)), jnp.int32)
    advantages = jnp.asarray([1.3, -0.7, 0.4], jnp.float32)
    mask = jnp.asarray(RNG.random((b, t)) > 0.3)

    @jax.jit  # the gradient, the closed form's pieces and the loss's value as one program (not ~40 op by op)
    def parts(logits, behavior_logits):
        behavior_logprobs = _token_logprobs(behavior_logits, tokens)

        def loss_fn(z):
            lp = _token_logprobs(z, tokens)
            return jnp.sum(obj.tis_policy_loss(lp, behavior_logprobs, advantages, mask, tis_cap=cap))

        lp = _token_logprobs(logits, tokens)
        return (jax.grad(loss_fn)(logits), jax.nn.softmax(logits, axis=-1), lp, behavior_logprobs,
                jax.nn.one_hot(tokens, v), obj.tis_policy_loss(lp, behavior_logprobs, advantages, mask, tis_cap=cap))

    grad, pi, lp, behavior_logprobs, onehot, value = parts(logits, behavior_logits)
    ratio = np.exp(np.asarray(lp - behavior_logprobs))
    c = np.minimum(ratio, cap)
    assert np.any(ratio > cap) and np.any(ratio < cap), "test should exercise the truncation"
    expected = -(np.asarray(advantages)[:, None] * c * np.asarray(mask))[..., None] * (onehot - pi)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)

    # Value: -A * min(r, C) * M * log pi(k).
    expected_value = -np.asarray(advantages)[:, None] * c * np.asarray(mask) * np.asarray(lp)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5, atol=1e-6)


def test_tis_ratio_is_finite_for_zero_behaviour_probability():
    lp = jnp.asarray([[-0.5, -2.0, -1.0]])
    blp = jnp.asarray([[-jnp.inf, -100.0, -1.0]])
    adv = jnp.asarray([[1.0, -1.0, 2.0]])
    mask = jnp.ones((1, 3), bool)
    loss = obj.tis_policy_loss(lp, blp, adv, mask, tis_cap=4.0)
    # r = inf -> C; r = e^98 -> C; r = 1 -> 1.
    np.testing.assert_allclose(loss, [[4.0 * 0.5, -4.0 * 2.0, 2.0]], rtol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(obj.tis_policy_loss(x, blp, adv, mask, tis_cap=4.0))))(lp)
    np.testing.assert_allclose(g, [[-4.0, 4.0, -2.0]], rtol=1e-6)


# --------------------------------------------------------------------------- #
# PPO clip
# --------------------------------------------------------------------------- #


def _ppo_reference(ratio, adv, eps_low, eps_high, dual_clip):
    """Per-element textbook PPO (+ dual clip for A < 0), written with branches."""
    out = np.zeros_like(ratio, dtype=np.float64)
    for idx in np.ndindex(ratio.shape):
        r, a = float(ratio[idx]), float(adv[idx])
        unclipped = r * a
        clipped = min(max(r, 1 - eps_low), 1 + eps_high) * a
        objective = min(unclipped, clipped)
        if dual_clip is not None and a < 0:
            objective = max(objective, dual_clip * a)
        out[idx] = -objective
    return out


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_matches_numpy_reference(dual_clip):
    ratios = np.array([0.01, 0.5, 0.79, 0.8, 0.95, 1.0, 1.1, 1.27, 1.29, 2.0, 3.5, 10.0, 1e4], np.float64)
    advs = np.array([-2.0, -0.3, 0.0, 0.5, 1.7])
    r_grid, a_grid = np.meshgrid(ratios, advs, indexing="ij")
    behavior = RNG.normal(size=r_grid.shape) - 1.0
    logp = behavior + np.log(r_grid)
    loss = obj.ppo_clip_policy_loss(
        jnp.asarray(logp, jnp.float32), jnp.asarray(behavior, jnp.float32), jnp.asarray(a_grid, jnp.float32),
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
    )
    expected = _ppo_reference(r_grid, a_grid, 0.2, 0.28, dual_clip)
    np.testing.assert_allclose(loss, expected, rtol=2e-5, atol=1e-5)

    # Spot checks that distinguish the variants.
    i_big, i_pos, i_neg = list(ratios).index(1e4), list(advs).index(1.7), list(advs).index(-2.0)
    # A > 0, r huge: clip-higher caps at (1 + eps_high) A, never dual-clipped.
    np.testing.assert_allclose(loss[i_big, i_pos], -1.28 * 1.7, rtol=1e-5)
    # A < 0, r huge: unbounded (-A r) without dual clip, c |A| with it.
    want = 2.0 * 1e4 if dual_clip is None else 3.0 * 2.0
    np.testing.assert_allclose(loss[i_big, i_neg], want, rtol=1e-4)
    # clip-higher is asymmetric: r=1.27 unclipped for A>0, r=0.79 clipped for A<0 only if r<0.8.
    i127, i079 = list(ratios).index(1.27), list(ratios).index(0.79)
    np.testing.assert_allclose(loss[i127, i_pos], -1.27 * 1.7, rtol=1e-5)
    np.testing.assert_allclose(loss[i079, i_neg], 0.8 * 2.0, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    log_ratio=st.lists(st.floats(-3.0, 3.0), min_size=6, max_size=6),
    adv=st.lists(st.floats(-5.0, 5.0), min_size=6, max_size=6),
    eps_low=st.floats(0.0, 0.5),
    eps_extra=st.floats(0.0, 0.5),
    dual_clip=st.one_of(st.none(), st.floats(1.01, 10.0)),
)
def test_ppo_clip_property_matches_reference(log_ratio, adv, eps_low, eps_extra, dual_clip):
    lr = np.asarray(log_ratio, np.float32).reshape(2, 3)
    a = np.asarray(adv, np.float32).reshape(2, 3)
    behavior = np.full_like(lr, -2.0)
    loss = obj.ppo_clip_policy_loss(jnp.asarray(behavior + lr), jnp.asarray(behavior), jnp.asarray(a),
                                    clip_eps_low=eps_low, clip_eps_high=eps_low + eps_extra, dual_clip=dual_clip)
    ratio = np.exp((behavior + lr).astype(np.float64) - behavior)
    expected = _ppo_reference(ratio, a, eps_low, eps_low + eps_extra, dual_clip)
    np.testing.assert_allclose(loss, expected, rtol=1e-4, atol=1e-4)
    # The clipped surrogate is never below the unclipped one (pessimistic bound), except
    # where the dual clip caps a negative-advantage token.
    unclipped = -ratio * a
    capped = (a < 0) & (dual_clip is not None) & (unclipped > (-(dual_clip or 0) * a))
    assert np.all((np.asarray(loss) >= unclipped - 1e-4) | capped)


def test_ppo_clip_gradient_zero_where_clipped():
    behavior = jnp.zeros((1, 4))
    logp = jnp.log(jnp.asarray([[1.5, 1.5, 0.5, 0.5]]))
    adv = jnp.asarray([[1.0, -1.0, 1.0, -1.0]])
    g = jax.jit(jax.grad(lambda x: jnp.sum(obj.ppo_clip_policy_loss(x, behavior, adv, clip_eps_low=0.2,
                                                                    clip_eps_high=0.2))))(logp)
    # d(-A r)/d log pi = -A r where unclipped; 0 where the clip is active.
    np.testing.assert_allclose(g, [[0.0, 1.5, -0.5, 0.0]], rtol=1e-6)


def test_advantages_broadcast_b_equals_bt():
    logp = jnp.asarray(RNG.normal(size=(2, 3)) - 1, jnp.float32)
    blp = jnp.asarray(RNG.normal(size=(2, 3)) - 1, jnp.float32)
    adv_b = jnp.asarray([0.5, -1.0])
    adv_bt = jnp.broadcast_to(adv_b[:, None], (2, 3))
    m = jnp.ones((2, 3), bool)
    np.testing.assert_array_equal(
        obj.tis_policy_loss(logp, blp, adv_b, m, tis_cap=2.0), obj.tis_policy_loss(logp, blp, adv_bt, m, tis_cap=2.0)
    )
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=2.0)
    np.testing.assert_array_equal(
        obj.ppo_clip_policy_loss(logp, blp, adv_b, **kw), obj.ppo_clip_policy_loss(logp, blp, adv_bt, **kw)
    )
    with pytest.raises(ValueError, match="advantages"):
        obj.tis_policy_loss(logp, blp, jnp.zeros(3), m, tis_cap=2.0)


# --------------------------------------------------------------------------- #
# KL penalty
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_kl_estimators_expectation_is_exact_kl(kind):
    # E_{y ~ pi}[k(y)] = KL(pi || ref) exactly for k1 and k3 (enumerate the vocabulary).
    v = 11
    logp = jax.nn.log_softmax(jnp.asarray(RNG.normal(size=v), jnp.float32))
    ref = jax.nn.log_softmax(jnp.asarray(RNG.normal(size=v), jnp.float32))
    per_token = obj.kl_penalty(logp[None], ref[None], kind)[0]
    expectation = jnp.sum(jnp.exp(logp) * per_token)
    exact = jnp.sum(jnp.exp(logp) * (logp - ref))
    np.testing.assert_allclose(expectation, exact, rtol=1e-5, atol=1e-6)
    if kind == "k3":
        assert np.all(np.asarray(per_token) >= 0)


def _kl_case(seed, v=7):
    """Logits z of pi, log pi_ref and log mu over a small vocabulary (its own draw: independent of test order)."""
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=v), jnp.float32)
    ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=v), jnp.float32))
    mu = jax.nn.log_softmax(z + jnp.asarray(rng.normal(scale=0.7, size=v), jnp.float32))
    return z, ref, mu


def _reverse_kl(z, ref):
    logp = jax.nn.log_softmax(z)
    return jnp.sum(jnp.exp(logp) * (logp - ref))


_reverse_kl_grad = jax.jit(jax.grad(_reverse_kl))


@functools.partial(jax.jit, static_argnames="is_cap")
def _expected_penalties(z, ref, sampler, is_cap):
    """`_expected_penalty` of every kind, one compiled program (the kinds' tests share it: the same z, ref, sampler
    and cap give a cached program, instead of each kind's vmapped gradients built op by op)."""
    v = z.shape[0]
    out = {}
    for kind in obj.KL_KINDS:
        def penalty(z, y):
            logp = jax.nn.log_softmax(z)[y]
            extra = {} if sampler is None else dict(behavior_logprobs=sampler[y].reshape(1, 1), is_cap=is_cap)
            return obj.kl_penalty(logp.reshape(1, 1), ref[y].reshape(1, 1), kind, **extra)[0, 0]

        values, grads = jax.vmap(jax.value_and_grad(penalty), in_axes=(None, 0))(z, jnp.arange(v))
        probs = jnp.exp(jax.nn.log_softmax(z) if sampler is None else sampler)
        out[kind] = (jnp.sum(probs * values), jnp.sum(probs[:, None] * grads, axis=0))
    return out


def _expected_penalty(z, ref, kind, sampler=None, is_cap=None):
    """Exact E_{y ~ sampler}[value] and E[grad_z] of the per-token penalty, by enumerating y (sampler: log mu, or
    None for pi itself; its probabilities are the sampling weights, not differentiated; is_cap: kl_penalty's)."""
    return _expected_penalties(z, ref, sampler, is_cap)[kind]


@jax.jit
def _per_token_grads(z, ref):
    """grad_z, for each token y of the vocabulary, of k1 = log pi(y) - log ref(y) and k3 = exp(-d) - 1 + d (the
    estimators' own values, d = log pi(y) - log ref(y)) and of k2 = d^2 / 2: {name: [V, V]} (one program)."""
    own = {"k1": lambda x, y: x - y, "k3": lambda x, y: jnp.expm1(y - x) - (y - x),
           "k2": lambda x, y: 0.5 * (x - y) ** 2}
    return {name: jax.vmap(lambda y: jax.grad(lambda zz: f(jax.nn.log_softmax(zz)[y], ref[y]))(z))(
        jnp.arange(z.shape[0])) for name, f in own.items()}


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_expected_gradient_is_the_reverse_kl_gradient(kind):
    # As a loss, every estimator's expected gradient over y ~ pi is grad_z KL(pi || pi_ref), the exact full-vocabulary
    # gradient (jax.grad); its value keeps the estimator's mean (KL itself for the unbiased k1 and k3).
    z, ref, _ = _kl_case(1)
    exact_grad = _reverse_kl_grad(z, ref)
    value, grad = _expected_penalty(z, ref, kind)
    np.testing.assert_allclose(grad, exact_grad, rtol=1e-5, atol=1e-6)
    if kind != "k2":
        np.testing.assert_allclose(value, _reverse_kl(z, ref), rtol=1e-5, atol=1e-6)
    # The estimators' own gradients are not it (the reports this fixes): E[grad k1] = 0 and E[grad k3] = pi - pi_ref,
    # the gradient of the forward KL(pi_ref || pi); the test above tells them apart.
    pi = jax.nn.softmax(z)
    if kind != "k2":
        grads = _per_token_grads(z, ref)[kind]
        naive = jnp.sum(pi[:, None] * grads, axis=0)
        np.testing.assert_allclose(naive, jnp.zeros(7) if kind == "k1" else pi - jnp.exp(ref), atol=1e-6)
        assert float(jnp.max(jnp.abs(naive - exact_grad))) > 1e-2


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_off_policy_weight_is_exact_under_mu(kind):
    # Tokens drawn from mu != pi: weighted by sg(min(pi/mu, C)) with C above every ratio, the penalty's expectation
    # under mu is E_pi of the estimator (exactly KL(pi || pi_ref) for k1, k3) and its expected gradient is the exact
    # reverse-KL gradient. Unweighted, both are biased.
    z, ref, mu = _kl_case(2)
    ratio = jnp.exp(jax.nn.log_softmax(z) - mu)
    cap = float(jnp.max(ratio)) * 1.5
    exact_grad = _reverse_kl_grad(z, ref)
    on_policy_value, _ = _expected_penalty(z, ref, kind)
    value, grad = _expected_penalty(z, ref, kind, sampler=mu, is_cap=cap)
    np.testing.assert_allclose(grad, exact_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, on_policy_value, rtol=1e-5, atol=1e-6)
    if kind != "k2":
        np.testing.assert_allclose(value, _reverse_kl(z, ref), rtol=1e-5, atol=1e-6)
    biased_value = jnp.sum(jnp.exp(mu) * obj.kl_penalty(jax.nn.log_softmax(z)[None], ref[None], kind)[0])
    assert abs(float(biased_value - value)) > 1e-3
    # Truncation active (C = 1 < max pi/mu): token y counts min(pi(y), C mu(y)) instead of pi(y), in value and gradient.
    cap = 1.0
    assert float(jnp.max(ratio)) > cap
    value, grad = _expected_penalty(z, ref, kind, sampler=mu, is_cap=cap)
    logp = jax.nn.log_softmax(z)
    weight = jnp.minimum(jnp.exp(logp), cap * jnp.exp(mu))
    per_token = obj.kl_penalty(logp[None], ref[None], kind)[0]
    np.testing.assert_allclose(value, jnp.sum(weight * per_token), rtol=1e-5, atol=1e-6)
    k2_grads = _per_token_grads(z, ref)["k2"]
    np.testing.assert_allclose(grad, jnp.sum(weight[:, None] * k2_grads, axis=0), rtol=1e-5, atol=1e-6)


def test_kl_penalty_in_the_policy_loss_is_weighted():
    # per_token_policy_loss adds kl_beta * w * k3 with w = min(pi/mu, rl.tis_cap); its kl (-> kl_to_ref) is w * k3.
    logp = jnp.asarray([[-1.0, -2.0, -0.3]])
    ref = jnp.asarray([[-1.5, -1.0, -0.3]])
    blp = jnp.asarray([[-1.2, -0.2, -0.3]])
    m = jnp.ones((1, 3), bool)
    lc = pl.PolicyLossConfig(kl_beta=0.5, tis_cap=2.0)
    per_token, kl = pl.per_token_policy_loss(logp, blp, jnp.zeros(1), m, m, lc, ref_logprobs=ref)
    d = np.asarray(ref - logp)
    w = np.minimum(np.exp(np.asarray(logp - blp)), 2.0)
    np.testing.assert_allclose(kl, w * (np.exp(d) - d - 1), rtol=1e-6)
    np.testing.assert_allclose(per_token, 0.5 * w * (np.exp(d) - d - 1), rtol=1e-6)
    with pytest.raises(ValueError, match="is_cap"):
        obj.kl_penalty(logp, ref, "k3", behavior_logprobs=blp)


def test_kl_values_and_kind_validation():
    logp = jnp.asarray([[-1.0, -2.0]])
    ref = jnp.asarray([[-1.5, -1.0]])
    d = np.array([[-0.5, 1.0]])
    np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k1"), -d, rtol=1e-6)
    np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k2"), 0.5 * d**2, rtol=1e-6)
    np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k3"), np.exp(d) - d - 1, rtol=1e-6)
    with pytest.raises(ValueError, match="kl kind.*'k4'"):
        obj.kl_penalty(logp, ref, "k4")


# --------------------------------------------------------------------------- #
# Aggregation
# --------------------------------------------------------------------------- #


def test_aggregation_values_match_numpy():
    # Its own draw (not the module's RNG, whose state depends on which tests ran before); the sums are f32,
    # the references f64: equal to 1e-6 of the summands' scale (a mean near 0 has no relative precision).
    loss = np.random.default_rng(20).normal(size=(4, 6)).astype(np.float32)
    lengths = np.array([6, 2, 0, 4])
    valid = np.arange(6)[None, :] < lengths[:, None]
    loss_with_nan_pads = np.where(valid, loss, np.nan)
    s, d = obj.aggregate_loss(loss_with_nan_pads, valid, "token_mean")
    np.testing.assert_allclose(s / d, loss[valid].mean(), rtol=1e-6, atol=1e-6)
    s, d = obj.aggregate_loss(loss_with_nan_pads, valid, "seq_mean_token_mean")
    per_seq = [loss[i, : lengths[i]].mean() for i in range(4) if lengths[i] > 0]
    assert float(d) == 3.0  # the all-pad row is not a sequence
    np.testing.assert_allclose(s / d, np.mean(per_seq), rtol=1e-6, atol=1e-6)
    s, d = obj.aggregate_loss(loss_with_nan_pads, valid, "seq_mean_token_sum_norm", max_response_length=10)
    np.testing.assert_allclose(s / d, loss[valid].sum() / (3 * 10), rtol=1e-6, atol=1e-6)
    s, d = obj.aggregate_loss(loss_with_nan_pads, valid, "seq_mean_token_sum_norm")
    assert float(d) == 3 * 6  # default max_response_length = T
    # Everything masked: 0, not NaN.
    s, d = obj.aggregate_loss(loss_with_nan_pads, np.zeros_like(valid), "token_mean")
    assert float(obj.combine([s], [d])) == 0.0


def test_aggregation_and_loss_validation_names_the_field():
    x = jnp.zeros((2, 3))
    m = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match="aggregation mode.*'seq_mean'"):
        obj.aggregate_loss(x, m, "seq_mean")
    with pytest.raises(ValueError, match="max_response_length"):
        obj.aggregate_loss(x, m, "seq_mean_token_sum_norm", max_response_length=0)
    with pytest.raises(ValueError, match="tis_cap"):
        obj.tis_policy_loss(x, x, x, m, tis_cap=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        obj.ppo_clip_policy_loss(x, x, x, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_eps_low"):
        obj.ppo_clip_policy_loss(x, x, x, clip_eps_low=1.2, clip_eps_high=0.2)
    with pytest.raises(ValueError, match="behavior_logprobs shape"):
        obj.tis_policy_loss(x, jnp.zeros((2, 4)), x, m, tis_cap=2.0)
    with pytest.raises(ValueError, match="rl.policy_loss = 'grpo'"):
        pl.PolicyLossConfig(policy_loss="grpo")
    with pytest.raises(ValueError, match="rl.kl_beta = 0.1 > 0 needs the batch's ref_logprobs"):
        pl.per_token_policy_loss(x, x, x, m, m, pl.PolicyLossConfig(kl_beta=0.1))


# --------------------------------------------------------------------------- #
# Micro-batching is exact
# --------------------------------------------------------------------------- #

B, T, D, V = 4, 50, 6, 9


@jax.jit  # one program per batch shape, not the log-softmax's operations one by one
def _linear_policy_logprobs(x, w, tokens):
    return _token_logprobs(jnp.einsum("btd,dv->btv", x, w), tokens)


def _problem(num_rows=B, all_pad_row=None):
    """A tiny linear 'policy' logits = x @ W with padding (NaN behaviour logprobs on pads)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(num_rows, T, D)).astype(np.float32)
    w = (rng.normal(size=(D, V)) * 0.7).astype(np.float32)
    tokens = rng.integers(0, V, size=(num_rows, T)).astype(np.int32)
    lengths = rng.integers(1, T + 1, size=num_rows)
    if all_pad_row is not None:
        lengths[all_pad_row] = 0
    valid = np.arange(T)[None, :] < lengths[:, None]
    logp = np.asarray(_linear_policy_logprobs(x, w, tokens))
    behavior = logp + rng.normal(size=(num_rows, T)).astype(np.float32) * 0.5
    behavior = np.where(valid, behavior, np.nan).astype(np.float32)
    adv = np.broadcast_to(rng.normal(size=(num_rows, 1)), (num_rows, T)).astype(np.float32)
    adv = np.where(valid, adv, np.nan).astype(np.float32)
    trust = (rng.random((num_rows, T)) > 0.2) & valid
    return dict(x=x, tokens=tokens, behavior=behavior, adv=adv, trust=trust, valid=valid), w


def _policy_loss(logp, behavior, adv, trust, valid, loss_type, mode, max_len=None, ref=None, kl_beta=0.0):
    """The trainer's loss (rl.loss.per_token_policy_loss, then objectives.aggregate_loss): (sum, denominator)."""
    valid = jnp.asarray(valid).astype(bool)
    config = pl.PolicyLossConfig(policy_loss=loss_type, loss_aggregation=mode, tis_cap=2.0, clip_eps_low=0.2,
                                 clip_eps_high=0.28, dual_clip=3.0, kl_beta=kl_beta)
    per_token, _ = pl.per_token_policy_loss(logp, behavior, adv, jnp.asarray(trust) & valid, valid, config,
                                            ref_logprobs=ref)
    return obj.aggregate_loss(per_token, valid, mode, max_response_length=max_len)


def _loss_parts(w, batch, loss_type, mode, max_len):
    logits = jnp.einsum("btd,dv->btv", batch["x"], w)
    logp = _token_logprobs(logits, batch["tokens"])
    return _policy_loss(logp, batch["behavior"], batch["adv"], batch["trust"], batch["valid"], loss_type, mode,
                        max_len)


_value_and_grad_sum = jax.jit(
    jax.value_and_grad(_loss_parts, has_aux=True), static_argnames=("loss_type", "mode", "max_len")
)


_loss_parts_jit = jax.jit(_loss_parts, static_argnames=("loss_type", "mode", "max_len"))


def _full(w, batch, loss_type, mode, max_len=None):
    def f(w_):
        s, d = _loss_parts(w_, batch, loss_type, mode, max_len)
        return obj.combine([s], [d])

    return jax.jit(jax.value_and_grad(f))(w)


def _accumulate(w, chunks, loss_type, mode, max_len=None):
    sums, denoms, grad = [], [], jnp.zeros_like(w)
    for chunk in chunks:
        (s, d), g = _value_and_grad_sum(w, chunk, loss_type, mode, max_len)
        sums.append(s)
        denoms.append(d)
        grad = grad + g
    total_denom = jnp.sum(jnp.stack(denoms))
    return obj.combine(sums, denoms), grad / total_denom


def _token_chunks(batch, size):
    """Flatten [B,T] to one row of B*T tokens and cut it into [1, size] chunks (last one padded)."""
    flat = {k: v.reshape(1, -1, *v.shape[2:]) for k, v in batch.items()}
    n = flat["tokens"].shape[1]
    n_pad = (-n) % size
    pad_values = dict(x=0.0, tokens=0, behavior=np.nan, adv=np.nan, trust=False, valid=False)
    for k, v in flat.items():
        widths = [(0, 0), (0, n_pad)] + [(0, 0)] * (v.ndim - 2)
        flat[k] = np.pad(v, widths, constant_values=pad_values[k])
    return [{k: v[:, i : i + size] for k, v in flat.items()} for i in range(0, n + n_pad, size)]


@pytest.mark.parametrize("loss_type", ["tis", "ppo_clip"])
@pytest.mark.slow
def test_token_mean_exact_under_token_micro_batches(loss_type):
    batch, w = _problem()
    full_loss, full_grad = _full(w, batch, loss_type, "token_mean")
    assert np.isfinite(full_loss) and np.all(np.isfinite(full_grad))
    for size in (1, 99):
        chunks = _token_chunks(batch, size)
        assert len(chunks) == math.ceil(B * T / size)
        loss, grad = _accumulate(w, chunks, loss_type, "token_mean")
        np.testing.assert_allclose(loss, full_loss, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-6)
    # A mean of per-micro-batch means would be wrong (sanity check that the test can fail).
    chunks = _token_chunks(batch, 99)
    means = [float(obj.combine(*[[p] for p in _loss_parts_jit(w, c, loss_type, "token_mean", None)])) for c in chunks]
    assert abs(np.mean(means) - float(full_loss)) > 1e-4


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_modes_exact_under_sequence_micro_batches(mode):
    batch, w = _problem(num_rows=6, all_pad_row=4)
    max_len = 64 if mode == "seq_mean_token_sum_norm" else None
    full_loss, full_grad = _full(w, batch, "tis", mode, max_len)
    assert np.isfinite(full_loss) and np.all(np.isfinite(full_grad))
    for rows in (1, 3):
        chunks = [{k: v[i : i + rows] for k, v in batch.items()} for i in range(0, 6, rows)]
        loss, grad = _accumulate(w, chunks, "tis", mode, max_len)
        np.testing.assert_allclose(loss, full_loss, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- #
# NaN in padded positions
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_nan_pads_never_reach_loss_or_gradient():
    valid = jnp.asarray([[True, True, False, False], [True, False, False, False]])
    nan = jnp.nan
    logp = jnp.asarray([[-1.0, -2.0, nan, -jnp.inf], [-0.5, nan, jnp.inf, nan]])
    blp = jnp.asarray([[-1.2, -1.5, nan, nan], [-0.7, -jnp.inf, nan, nan]])
    adv = jnp.asarray([[0.5, 0.5, nan, nan], [-1.0, nan, nan, nan]])
    ref = jnp.asarray([[-1.1, -2.1, nan, nan], [-0.6, nan, nan, nan]])

    def total(lp, loss_type, mode):
        s, d = _policy_loss(lp, blp, adv, valid, valid, loss_type, mode, ref=ref, kl_beta=0.1)
        return obj.combine([s], [d]), d

    tokens = jnp.zeros((2, 4), jnp.int32)
    logits = jnp.asarray(RNG.normal(size=(2, 4, 5)), jnp.float32)

    @jax.jit  # every loss type x mode, and the gradient through the log-softmax, as one program (not op by op)
    def all_cases(logp, logits):
        cases = {f"{loss_type}/{mode}": jax.value_and_grad(total, has_aux=True)(logp, loss_type, mode)
                 for loss_type in obj.LOSS_TYPES for mode in obj.AGGREGATION_MODES}
        return cases, jax.grad(lambda z: total(_token_logprobs(z, tokens), "tis", "token_mean")[0])(logits)

    cases, logit_grad = all_cases(logp, logits)
    for loss_type in obj.LOSS_TYPES:
        for mode in obj.AGGREGATION_MODES:
            (value, denom), g = cases[f"{loss_type}/{mode}"]
            assert np.isfinite(value) and np.isfinite(denom), (loss_type, mode)
            assert np.all(np.isfinite(g)), (loss_type, mode, g)
            np.testing.assert_array_equal(np.asarray(g)[~np.asarray(valid)], 0.0)
            assert np.all(np.asarray(g)[np.asarray(valid)] != 0.0)

    # Through the log-softmax: finite logits everywhere, NaN behaviour data on pads.
    g = logit_grad
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(np.asarray(g)[~np.asarray(valid)], 0.0)
