"""Tests of pdm_jax.rl.trust_region: closed forms vs autodiff, edge inputs, masks.

Every closed form is checked against ``jax.jvp`` of an independent dense
reference divergence written here (DESIGN.md section 2); numbers that could be
wrong are compared with float64 numpy references.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdm_jax.rl import trust_region as tr

ESTIMATORS = ("aggregated_tail", "uniform_tail", "bucket_exact")


# ----------------------------------------------------------------------------- helpers


def make_case(seed=0, B=2, T=3, V=12, K=4, scale=2.0, noise=0.7, sampled="any"):
    """Random trainer logits z, sampler logits zb, top-K of mu = softmax(zb), sampled tokens."""
    rng = np.random.default_rng(seed)
    z = (scale * rng.normal(size=(B, T, V))).astype(np.float32)
    zb = (z + noise * rng.normal(size=(B, T, V))).astype(np.float32)
    logmu = np.asarray(jax.nn.log_softmax(jnp.asarray(zb), axis=-1))
    order = np.argsort(-logmu, axis=-1)
    topk_ids = order[..., :K].astype(np.int32)
    if sampled == "inside":
        tokens = np.take_along_axis(order, rng.integers(0, K, size=(B, T, 1)), -1)[..., 0]
    elif sampled == "outside":
        assert K < V
        tokens = np.take_along_axis(order, rng.integers(K, V, size=(B, T, 1)), -1)[..., 0]
    else:
        tokens = rng.integers(0, V, size=(B, T))
    tokens = tokens.astype(np.int32)
    topk_lp = np.take_along_axis(logmu, topk_ids, -1).astype(np.float32)
    behavior_lp = np.take_along_axis(logmu, tokens[..., None], -1)[..., 0].astype(np.float32)
    return dict(z=z, zb=zb, logmu=logmu, tokens=tokens, topk_ids=topk_ids, topk_lp=topk_lp,
                behavior_lp=behavior_lp)


def args_of(c):
    return (c["tokens"], c["topk_ids"], c["topk_lp"], c["behavior_lp"])


def candidate_set(tokens, topk_ids, V):
    """Dense [B,T,V] bool membership of E = TopK ∪ {k} (numpy, independent of the module)."""
    E = np.zeros(tokens.shape + (V,), bool)
    np.put_along_axis(E, topk_ids, True, axis=-1)
    np.put_along_axis(E, tokens[..., None], True, axis=-1)
    return E


def dense_mu(c, V):
    """mu on E as a dense [B,T,V] f32 array (0 off E), from the top-K and behaviour log-probs."""
    mu = np.zeros(c["tokens"].shape + (V,), np.float32)
    np.put_along_axis(mu, c["tokens"][..., None], np.exp(c["behavior_lp"])[..., None], axis=-1)
    np.put_along_axis(mu, c["topk_ids"], np.exp(c["topk_lp"]), axis=-1)  # top-K value wins
    return mu


def ref_topk_kl(z, E, mu):
    """Dense reference of the top-K KL in jnp (differentiable in z): E [..,V] bool, mu on E."""
    logp = jax.nn.log_softmax(z, axis=-1)
    pi = jnp.exp(logp)
    pi_t = jnp.sum(jnp.where(E, 0.0, pi), axis=-1)
    mu_t = jnp.maximum(1.0 - jnp.sum(jnp.where(E, mu, 0.0), axis=-1), 0.0)
    mu_t = jnp.where(jnp.all(E, axis=-1), 0.0, mu_t)
    head = jnp.sum(jnp.where(E & (mu > 0), mu * (jnp.log(jnp.where(mu > 0, mu, 1.0)) - logp), 0.0), -1)
    safe = lambda x: jnp.where(mu_t > 0, x, 1.0)  # noqa: E731
    tail = jnp.where(mu_t > 0, mu_t * (jnp.log(safe(mu_t)) - jnp.log(safe(pi_t))), 0.0)
    return head + tail


@jax.jit
def ref_topk_kl_and_jvp(z, tokens, E, mu):
    """`ref_topk_kl` at z and its jvp along e_k - pi, [B,T] each: one compiled program for every test with the
    standard shape (E and mu are arguments, not constants of the program)."""
    v = onehot_minus(jax.nn.softmax(z, -1), tokens)
    return jax.jvp(lambda zz: ref_topk_kl(zz, E, mu), (z,), (v,))


def full_kl_ref(zeta, mu):
    """KL(mu || softmax zeta) over the last axis, mu a dense probability vector (0 log 0 = 0)."""
    logp = jax.nn.log_softmax(zeta, axis=-1)
    return jnp.sum(jnp.where(mu > 0, mu * (jnp.log(jnp.where(mu > 0, mu, 1.0)) - logp), 0.0), -1)


def onehot_minus(p, tokens):
    return jax.nn.one_hot(tokens, p.shape[-1], dtype=jnp.float32) - p


def jvp(f, z, v):
    """jax.jvp of f at z along v (jitted: tiny shapes compile faster than they dispatch op by op)."""
    return jax.jit(lambda zz, vv: jax.jvp(f, (zz,), (vv,))[1])(jnp.asarray(z, jnp.float32),
                                                               jnp.asarray(v, jnp.float32))


def close(a, b, atol=2e-6, rtol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=atol, rtol=rtol)


# The standard tiny shape shared by most tests (one compile of `evaluate` per shape).
STD = dict(B=4, T=6, V=12, K=4)
B_, T_ = STD["B"], STD["T"]

# Canonical configs, reused across tests so each (shape, config) compiles once.
CFG = {
    "none": tr.TrustRegionConfig(mask="none", delta=0.02),
    "ppo": tr.TrustRegionConfig(mask="ppo", clip_eps_low=0.2, clip_eps_high=0.28),
    "dppo_kl": tr.TrustRegionConfig(mask="dppo", divergence="topk_kl", delta=0.02, delta_low=0.05, delta_high=0.01),
    "dppo_bkl": tr.TrustRegionConfig(mask="dppo", divergence="binary_kl", delta=0.005),
    "dppo_btv": tr.TrustRegionConfig(mask="dppo", divergence="binary_tv", estimator="autodiff", delta=0.01),
    "pdm_btv": tr.TrustRegionConfig(mask="pdm", divergence="binary_tv", estimator="autodiff", delta=0.01),
    "pdm_agg": tr.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="aggregated_tail", delta=0.02),
    "pdm_unif": tr.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="uniform_tail", delta=0.02),
    "pdm_exact": tr.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="bucket_exact", delta=0.02,
                                      delta_low=0.01, delta_high=0.04),
    "pdm_tv": tr.TrustRegionConfig(mask="pdm", divergence="topk_tv", estimator="autodiff", delta=0.05),
}


@jax.jit
def evaluate(z, tokens, topk_ids, topk_lp, behavior_lp):
    """All module outputs for one case, in one compiled program."""
    a = (tokens, topk_ids, topk_lp, behavior_lp)
    z = z.astype(jnp.float32)
    v = onehot_minus(jax.nn.softmax(z, -1), tokens)
    out = {}
    for name, fn in tr.DIVERGENCE_FNS.items():
        out["D_" + name] = fn(z, *a)
        out["ad_" + name] = tr.autodiff_directional_derivative(fn, z, *a)
        out["grad_" + name] = jax.grad(lambda zz, fn=fn: jnp.sum(fn(zz, *a)))(z)
    for est in ESTIMATORS:
        out[est] = tr.kl_directional_derivative(z, *a, estimator=est)
    out["jvp_topk_kl"] = jax.jvp(lambda zz: tr.topk_kl(zz, *a), (z,), (v,))[1]
    tq = tr.token_quantities(jax.nn.log_softmax(z, -1), *a)
    out.update({"tq_" + k: val for k, val in tq._asdict().items()})
    out["logp_k"], out["ratio"] = tr.token_logprobs_and_ratio(z, tokens, behavior_lp)
    return out


def run(c):
    return {k: np.asarray(v) for k, v in evaluate(c["z"], *args_of(c)).items()}


# ----------------------------------------------------------------------------- closed forms vs jvp


@pytest.mark.parametrize("sampled", ["any", "inside", "outside"])
def test_bucket_exact_is_jvp_of_topk_kl(sampled):
    c = make_case(seed=1, sampled=sampled, **STD)
    o = run(c)
    V = STD["V"]
    # jvp of the module's own topk_kl, and the generic autodiff path
    close(o["bucket_exact"], o["jvp_topk_kl"])
    close(o["bucket_exact"], o["ad_topk_kl"])
    # jvp of the independent dense reference; and the divergences agree
    E, mu = candidate_set(c["tokens"], c["topk_ids"], V), dense_mu(c, V)
    ref_d, ref_jvp = ref_topk_kl_and_jvp(c["z"], c["tokens"], E, mu)
    close(o["bucket_exact"], ref_jvp)
    close(o["D_topk_kl"], ref_d)
    inside = (c["topk_ids"] == c["tokens"][..., None]).any(-1)
    assert {"inside": inside.all(), "outside": (~inside).all(), "any": True}[sampled]


def bucket_setup(c):
    """Bucket logits over V+1 slots (E ids, non-E ids at -inf, last slot = tail) and bucket mu."""
    V = c["z"].shape[-1]
    E, mu = candidate_set(c["tokens"], c["topk_ids"], V), dense_mu(c, V)
    logp = np.asarray(jax.nn.log_softmax(c["z"], -1), np.float64)
    pi = np.exp(logp)
    pi_t = np.where(E, 0.0, pi).sum(-1)
    mu_t = np.maximum(1.0 - np.where(E, mu, 0.0).sum(-1), 0.0)
    zeta = np.concatenate([np.where(E, logp, -np.inf), np.log(pi_t)[..., None]], -1)
    mu_b = np.concatenate([np.where(E, mu, 0.0), mu_t[..., None]], -1)
    return E, mu, pi, pi_t, mu_t, zeta, mu_b


def test_aggregated_tail_is_jvp_of_bucket_kl_under_bucket_softmax_step():
    c = make_case(seed=2, **STD)
    _, _, _, _, _, zeta, mu_b = bucket_setup(c)
    p_b = jax.nn.softmax(jnp.asarray(zeta, jnp.float32), -1)
    v_b = onehot_minus(p_b, c["tokens"])  # the sampled id is a bucket of its own (index < V)
    expected = jvp(lambda zz: full_kl_ref(zz, jnp.asarray(mu_b, jnp.float32)), zeta, v_b)
    close(run(c)["aggregated_tail"], expected)


def test_uniform_tail_is_jvp_of_uniformly_completed_full_kl():
    c = make_case(seed=3, **STD)
    E, mu, pi, pi_t, mu_t, _, _ = bucket_setup(c)
    n_t = (~E).sum(-1)
    pi_c = np.where(E, pi, (pi_t / n_t)[..., None])
    mu_c = np.where(E, mu, (mu_t / n_t)[..., None])
    v = onehot_minus(jnp.asarray(pi_c, jnp.float32), c["tokens"])
    expected = jvp(lambda zz: full_kl_ref(zz, jnp.asarray(mu_c, jnp.float32)), np.log(pi_c), v)
    close(run(c)["uniform_tail"], expected)


def test_full_kl_direction_is_jvp_and_grad_is_pi_minus_mu():
    c = make_case(seed=4, **STD)
    z, zb = jnp.asarray(c["z"]), jnp.asarray(c["zb"])
    pi, mu = jax.nn.softmax(z, -1), jax.nn.softmax(zb, -1)
    v = onehot_minus(pi, c["tokens"])
    ddot = tr.full_kl_directional_derivative(z, zb, c["tokens"])
    close(ddot, jvp(lambda zz: tr.full_kl(zz, zb), z, v))
    close(ddot, jvp(lambda zz: full_kl_ref(zz, mu), z, v))
    grad = jax.jit(jax.grad(lambda zz: jnp.sum(tr.full_kl(zz, zb))))(z)
    close(grad, pi - mu, atol=1e-6)
    lp = np.asarray(jax.nn.log_softmax(z), np.float64)
    lm = np.asarray(c["logmu"], np.float64)
    close(tr.full_kl(z, zb), (np.exp(lm) * (lm - lp)).sum(-1), atol=1e-5)
    # with the whole vocabulary as candidate set, the top-K machinery is the full KL
    zc = make_case(seed=4, B=2, T=3, V=12, K=12)
    o = run(zc)
    close(o["D_topk_kl"], tr.full_kl(zc["z"], zc["zb"]), atol=1e-6)
    close(o["bucket_exact"], tr.full_kl_directional_derivative(zc["z"], zc["zb"], zc["tokens"]), atol=1e-6)


def dense_reference_divergence(name, c):
    """Independent dense jnp reference of each top-K/binary divergence (a function of z)."""
    V = c["z"].shape[-1]
    Ej, muj = jnp.asarray(candidate_set(c["tokens"], c["topk_ids"], V)), jnp.asarray(dense_mu(c, V))
    mu_k = jnp.exp(jnp.asarray(c["behavior_lp"]))
    tokens = jnp.asarray(c["tokens"])

    def ref(zz):
        pi = jax.nn.softmax(zz, -1)
        pi_t = jnp.sum(jnp.where(Ej, 0.0, pi), -1)
        mu_t = jnp.maximum(1.0 - jnp.sum(muj, -1), 0.0)
        pk = jnp.take_along_axis(pi, tokens[..., None], -1)[..., 0]
        if name == "topk_kl":
            return ref_topk_kl(zz, Ej, muj)
        if name == "topk_tv":
            return 0.5 * (jnp.sum(jnp.where(Ej, jnp.abs(muj - pi), 0.0), -1) + jnp.abs(mu_t - pi_t))
        if name == "topk_reverse_kl":
            lm = jnp.log(jnp.maximum(muj, tr.REVERSE_KL_MIN_PROB))
            head = jnp.sum(jnp.where(Ej, pi * (jnp.log(pi) - lm), 0.0), -1)
            return head + pi_t * (jnp.log(pi_t) - jnp.log(jnp.maximum(mu_t, tr.REVERSE_KL_MIN_PROB)))
        if name == "binary_tv":
            return jnp.abs(mu_k - pk)
        return mu_k * jnp.log(mu_k / pk) + (1 - mu_k) * jnp.log((1 - mu_k) / (1 - pk))

    return ref


def test_every_divergence_and_its_autodiff_direction_match_dense_references():
    """Values and jvp along e_k - pi of topk_kl/tv/reverse_kl, binary tv/kl vs hand-written references."""
    c = make_case(seed=5, **STD)
    o = run(c)
    z = jnp.asarray(c["z"])
    v = onehot_minus(jax.nn.softmax(z, -1), c["tokens"])
    for name in tr.DIVERGENCE_FNS:
        ref = dense_reference_divergence(name, c)
        close(o["D_" + name], ref(z), atol=5e-6, rtol=1e-4)
        close(o["ad_" + name], jvp(ref, z, v), atol=5e-6, rtol=1e-4)
        # and jvp = <grad, e_k - pi> per token
        close(o["ad_" + name], (o["grad_" + name] * np.asarray(v)).sum(-1), atol=5e-6, rtol=1e-4)


def test_finite_step_changes_divergence_to_first_order():
    """D(z + eta (e_k - pi)) - D(z) = eta D' + O(eta^2): the remainder shrinks ~4x per halving."""
    c = make_case(seed=6, noise=1.0, **STD)
    o = run(c)
    z = jnp.asarray(c["z"])
    v = onehot_minus(jax.nn.softmax(z, -1), c["tokens"])
    d0, ddot = o["D_topk_kl"], o["bucket_exact"]
    errs = []
    for eta in (0.08, 0.04, 0.02):
        d1 = np.asarray(tr.topk_kl(z + eta * v, *args_of(c)))
        errs.append(np.abs((d1 - d0) - eta * ddot))
        big = np.abs(ddot) > 1e-2  # first order: the step moves D the way D' says
        assert np.all(np.sign(d1 - d0)[big] == np.sign(ddot)[big])
    errs = np.stack(errs)
    ok = errs[0] > 1e-6
    assert ok.sum() >= 3
    ratios = errs[:-1][:, ok] / errs[1:][:, ok]
    assert np.all((ratios > 2.5) & (ratios < 6.0)), ratios


def test_binary_tv_predictive_direction_equals_ratio_direction():
    c = make_case(seed=7, **STD)
    o = run(c)
    ratio, ddot = o["ratio"], o["ad_binary_tv"]
    nz = np.abs(ratio - 1) > 1e-6
    assert nz.sum() > 10
    assert np.all(np.sign(ddot)[nz] == np.sign(ratio - 1)[nz])
    # therefore the two masks coincide, with zero measured disagreement
    adv = np.random.default_rng(0).normal(size=(4,)).astype(np.float32)
    valid = np.ones((4, 6), bool)
    m_pdm, s_pdm = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, CFG["pdm_btv"])
    m_dppo, s_dppo = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, CFG["dppo_btv"])
    np.testing.assert_array_equal(np.asarray(m_pdm), np.asarray(m_dppo))
    assert float(s_pdm["frac_direction_disagree"]) == 0.0 == float(s_dppo["frac_direction_disagree"])
    assert 0 < float(s_pdm["frac_masked"]) < 1


@pytest.mark.parametrize("seed", [0, 1])
def test_bucket_exact_between_uniform_and_aggregated(seed):
    o = run(make_case(seed=10 + seed, scale=3.0, **STD))
    lo = np.minimum(o["uniform_tail"], o["aggregated_tail"]) - 1e-6
    hi = np.maximum(o["uniform_tail"], o["aggregated_tail"]) + 1e-6
    assert np.all((o["bucket_exact"] >= lo) & (o["bucket_exact"] <= hi))
    assert not np.allclose(o["uniform_tail"], o["aggregated_tail"])


def test_closed_forms_agree_with_design_formula_float64():
    """The DESIGN.md form (pi_k - mu_k) + sum_E pi(mu - pi) + tail term, in float64 numpy."""
    c = make_case(seed=8, **STD)
    o = run(c)
    V = STD["V"]
    E, mu = candidate_set(c["tokens"], c["topk_ids"], V), dense_mu(c, V).astype(np.float64)
    logp = np.asarray(c["z"], np.float64)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    pi = np.exp(logp)
    pi_t = np.where(E, 0, pi).sum(-1)
    mu_t = 1 - np.where(E, mu, 0).sum(-1)
    pk = np.take_along_axis(pi, c["tokens"][..., None], -1)[..., 0]
    mk = np.take_along_axis(mu, c["tokens"][..., None], -1)[..., 0]
    base = pk - mk + np.where(E, pi * (mu - pi), 0).sum(-1)
    tails = {"aggregated_tail": pi_t * (mu_t - pi_t),
             "uniform_tail": pi_t * (mu_t - pi_t) / (~E).sum(-1),
             "bucket_exact": np.where(E, 0, pi ** 2).sum(-1) * (mu_t - pi_t) / pi_t}
    for est, tail in tails.items():
        close(o[est], base + tail, atol=1e-6)
    kl = np.where(E & (mu > 0), mu * (np.log(np.where(mu > 0, mu, 1)) - logp), 0).sum(-1) + mu_t * np.log(mu_t / pi_t)
    close(o["D_topk_kl"], kl, atol=2e-6)
    close(o["tq_pi_t"], pi_t, rtol=1e-5)
    close(o["tq_mu_t"], mu_t, atol=1e-6)


# ----------------------------------------------------------------------------- edge inputs


def test_duplicate_topk_ids_validate_and_first_occurrence_semantics():
    c = make_case(seed=20, **STD)
    V = STD["V"]
    d = dict(c, topk_ids=c["topk_ids"].copy(), topk_lp=c["topk_lp"].copy())
    d["topk_ids"][1, 0, 3] = d["topk_ids"][1, 0, 1]  # position (1, 0): id repeated at slot 3
    d["topk_lp"][1, 0, 3] = -0.01  # garbage log-prob on the copy: must be ignored
    with pytest.raises(ValueError, match=r"position \(1, 0\).*id %d" % d["topk_ids"][1, 0, 1]):
        tr.validate_topk(d["topk_ids"], vocab_size=V)
    tr.validate_topk(c["topk_ids"], vocab_size=V)
    tr.validate_topk(d["topk_ids"], vocab_size=V, valid_mask=np.arange(B_ * T_).reshape(B_, T_) != T_)
    bad = c["topk_ids"].copy()
    bad[0, 1, 2] = V
    with pytest.raises(ValueError, match=r"position \(0, 1\).*outside \[0, 12\)"):
        tr.validate_topk(bad, vocab_size=V)
    # jitted math: the copy is dropped, i.e. E and mu are those of the first occurrence
    E = candidate_set(d["tokens"], d["topk_ids"], V)
    mu = dense_mu(c, V)
    mu[1, 0] = np.where(E[1, 0], mu[1, 0], 0.0)  # slot 3's original id left E at (1, 0)
    o = run(d)
    ref_d, ref_jvp = ref_topk_kl_and_jvp(c["z"], c["tokens"], E, mu)
    close(o["D_topk_kl"], ref_d)
    close(o["bucket_exact"], ref_jvp)
    close(o["bucket_exact"], o["jvp_topk_kl"])
    assert o["tq_member"][1, 0].sum() == len(set(d["topk_ids"][1, 0].tolist()) | {int(d["tokens"][1, 0])})


def test_topk_covers_whole_vocabulary_empty_tail():
    c = make_case(seed=21, B=2, T=3, V=12, K=12)
    o = run(c)
    for k in ("tq_pi_t", "tq_mu_t", "tq_tail_size", "tq_tail_sq_over_pi_t"):
        np.testing.assert_array_equal(o[k], 0.0)
    close(o["aggregated_tail"], o["uniform_tail"], atol=0, rtol=0)
    close(o["aggregated_tail"], o["bucket_exact"], atol=0, rtol=0)
    close(o["bucket_exact"], o["jvp_topk_kl"])
    for name in tr.DIVERGENCE_FNS:
        for prefix in ("D_", "ad_", "grad_"):
            assert np.all(np.isfinite(o[prefix + name])), prefix + name


def test_topk_mass_above_one_by_rounding_clamps_tail():
    c = make_case(seed=22, scale=4.0, sampled="inside", **STD)
    lse = np.log(np.exp(c["topk_lp"].astype(np.float64)).sum(-1))
    d = dict(c, topk_lp=(c["topk_lp"] - lse[..., None] + 2e-6).astype(np.float32),  # top-K mass 1 + 2e-6
             behavior_lp=(c["behavior_lp"] - lse + 2e-6).astype(np.float32))
    o = run(d)
    assert np.all(o["tq_mu_e"].sum(-1) > 1.0)
    np.testing.assert_array_equal(o["tq_mu_t"], 0.0)
    for k in ESTIMATORS + ("D_topk_kl",):
        assert np.all(np.isfinite(o[k])), k
    close(o["bucket_exact"], o["jvp_topk_kl"])  # exact even with S = sum mu != 1


def test_tiny_policy_tail_mass_is_exact():
    """pi_T ~ 1e-13: complement log-sum-exp keeps relative precision (1 - sum would be 0 or noise)."""
    B, T, V, K = STD["B"], STD["T"], STD["V"], STD["K"]
    z = np.full((B, T, V), -30.0, np.float32)
    z[..., :K] = [2.0, 1.0, 0.5, 0.0]
    tokens = np.zeros((B, T), np.int32)
    tokens[:, 1] = 7  # sampled from the tail
    topk_ids = np.broadcast_to(np.arange(K, dtype=np.int32), (B, T, K)).copy()
    mu = np.array([0.6, 0.2, 0.1, 0.05], np.float64)
    topk_lp = np.broadcast_to(np.log(mu).astype(np.float32), (B, T, K)).copy()
    behavior_lp = np.where(tokens == 0, np.log(0.6), np.log(0.01)).astype(np.float32)
    c = dict(z=z, tokens=tokens, topk_ids=topk_ids, topk_lp=topk_lp, behavior_lp=behavior_lp)
    o = run(c)
    z64 = z.astype(np.float64)
    p64 = np.exp(z64 - np.log(np.exp(z64).sum(-1, keepdims=True)))
    pi_t0 = p64[0, 0, K:].sum()
    assert pi_t0 < 1e-9
    np.testing.assert_allclose(o["tq_pi_t"][0, 0], pi_t0, rtol=1e-5)
    np.testing.assert_allclose(o["tq_log_pi_t"][0, 0], np.log(pi_t0), rtol=1e-6)
    mu_t = 1 - mu.sum()
    kl0 = (mu * np.log(mu / p64[0, 0, :K])).sum() + mu_t * np.log(mu_t / pi_t0)
    np.testing.assert_allclose(o["D_topk_kl"][0, 0], kl0, rtol=1e-5)
    for k in ESTIMATORS:
        assert np.all(np.isfinite(o[k])), k
    close(o["bucket_exact"], o["jvp_topk_kl"])
    # extreme: tail mass ~ e^-200 underflows f32, but log pi_T stays finite and exact
    z2 = z.copy()
    z2[..., K:] = -200.0
    o2 = run(dict(c, z=z2))
    lse = np.log(np.exp(z2[0, 0, :K].astype(np.float64)).sum())
    np.testing.assert_allclose(o2["tq_log_pi_t"][0, 0], -200.0 + np.log(V - K) - lse, rtol=1e-5)
    for k in ESTIMATORS + ("D_topk_kl", "D_binary_kl", "D_topk_reverse_kl"):
        assert np.all(np.isfinite(o2[k])), k


def test_minus_inf_behaviour_logprobs_are_zero_probabilities():
    c = make_case(seed=23, sampled="inside", **STD)
    lp = c["topk_lp"].copy()
    lp[..., -1] = -np.inf  # last top-K slot has zero behaviour probability
    blp = np.where(c["tokens"] == c["topk_ids"][..., -1], -np.inf, c["behavior_lp"]).astype(np.float32)
    d = dict(c, topk_lp=lp, behavior_lp=blp)
    o = run(d)
    for name in tr.DIVERGENCE_FNS:
        for prefix in ("D_", "ad_", "grad_"):
            assert np.all(np.isfinite(o[prefix + name])), prefix + name
    V = STD["V"]
    E, mu = candidate_set(c["tokens"], c["topk_ids"], V), dense_mu(d, V)
    ref_d, ref_jvp = ref_topk_kl_and_jvp(c["z"], c["tokens"], E, mu)
    close(o["D_topk_kl"], ref_d)
    close(o["bucket_exact"], ref_jvp)


def test_bf16_inputs_compute_in_f32():
    c = make_case(seed=24, **STD)
    b16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    out = tr.topk_kl(b16(c["z"]), c["tokens"], c["topk_ids"], b16(c["topk_lp"]), b16(c["behavior_lp"]))
    assert out.dtype == jnp.float32
    f32 = lambda x: np.asarray(b16(x).astype(jnp.float32))  # noqa: E731
    ref = run(dict(c, z=f32(c["z"]), topk_lp=f32(c["topk_lp"]), behavior_lp=f32(c["behavior_lp"])))
    close(out, ref["D_topk_kl"], atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("field,value", [
    ("mask", "clip"), ("divergence", "kl"), ("estimator", "exact"), ("delta", 0.0), ("delta", float("nan")),
    ("delta_low", -0.1), ("delta_high", float("inf")), ("clip_eps_low", 1.0), ("clip_eps_high", -0.1),
    ("nonfinite", "ignore"), ("direction_stats", 1)])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"{field}.*{value!r}" if not isinstance(value, float)
                       or math.isfinite(value) else field):
        tr.TrustRegionConfig(**{field: value})


def test_config_pdm_non_kl_needs_autodiff_and_is_hashable():
    with pytest.raises(ValueError, match="estimator"):
        tr.TrustRegionConfig(mask="pdm", divergence="topk_tv")
    tr.TrustRegionConfig(mask="pdm", divergence="topk_tv", estimator="autodiff")
    tr.TrustRegionConfig(mask="dppo", divergence="binary_tv")  # estimator only matters for pdm
    a, b = tr.TrustRegionConfig(delta=0.1), tr.TrustRegionConfig(delta=0.1)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(Exception):
        a.delta = 0.2  # frozen


# ----------------------------------------------------------------------------- masks


def reference_mask(c, adv_bt, valid, cfg):
    """Numpy restatement of the mask semantics, using the module's per-token D and D'."""
    o = run(c)
    D = o["D_" + cfg.divergence].astype(np.float64)
    if cfg.estimator == "autodiff" or cfg.divergence != "topk_kl":
        pred = o["ad_" + cfg.divergence]
    else:
        pred = o[cfg.estimator]
    logp = np.asarray(jax.nn.log_softmax(c["z"]), np.float64)
    r = np.exp(np.take_along_axis(logp, c["tokens"][..., None], -1)[..., 0] - c["behavior_lp"])
    radius = np.where(adv_bt < 0, cfg.radius_low, np.where(adv_bt > 0, cfg.radius_high, cfg.delta))
    if cfg.mask == "ppo":
        outside = (r < 1 - cfg.clip_eps_low) | (r > 1 + cfg.clip_eps_high)
    else:
        outside = D > radius
    keep_ratio = ~(outside & (adv_bt * (r - 1) > 0))
    keep_pred = ~(outside & (adv_bt * pred > 0))
    keep = {"none": np.ones_like(keep_ratio), "ppo": keep_ratio, "dppo": keep_ratio, "pdm": keep_pred}[cfg.mask]
    n = valid.sum()
    stats = dict(frac_outside=(outside & valid).sum() / n, frac_masked=(~(keep & valid) & valid).sum() / n,
                 frac_direction_disagree=((keep_ratio != keep_pred) & valid).sum() / n,
                 mean_divergence=D[valid].mean(), num_valid=float(n), num_nonfinite=0.0)
    return keep & valid, stats


MASK_CONFIGS = [CFG[k] for k in ("none", "ppo", "dppo_kl", "dppo_bkl", "pdm_agg", "pdm_unif", "pdm_exact", "pdm_tv")]


@functools.partial(jax.jit, static_argnames="configs")
def _masks_of_every_config(z, tokens, topk_ids, topk_lp, behavior_lp, adv_b, adv_bt, valid, configs):
    """[(mask and stats with [B] advantages, mask with [B,T] advantages) for each config]: the mask test's calls for
    every config in one compiled program, which its parametrizations share (the same inputs), instead of two
    programs per config."""
    a = (tokens, topk_ids, topk_lp, behavior_lp)
    return [(tr.trust_region_mask(z, *a, adv_b, valid, cfg), tr.trust_region_mask(z, *a, adv_bt, valid, cfg)[0])
            for cfg in configs]


@pytest.mark.parametrize("cfg", MASK_CONFIGS, ids=lambda c: f"{c.mask}-{c.divergence}-{c.estimator}")
def test_mask_matches_reference_semantics(cfg):
    c = make_case(seed=30, scale=1.5, noise=0.8, **STD)
    rng = np.random.default_rng(31)
    adv_b = rng.normal(size=(4,)).astype(np.float32)
    adv_b[0] = 0.0
    adv_bt = np.broadcast_to(adv_b[:, None], (4, 6))
    valid = np.ones((4, 6), bool)
    valid[1, 4:] = False
    valid[3, 2:] = False
    (mask, stats), mask2 = _masks_of_every_config(c["z"], *args_of(c), adv_b, adv_bt, valid,
                                                  configs=tuple(MASK_CONFIGS))[MASK_CONFIGS.index(cfg)]
    exp_mask, exp_stats = reference_mask(c, adv_bt, valid, cfg)
    np.testing.assert_array_equal(np.asarray(mask), exp_mask)
    if not (cfg.mask == "pdm" or cfg.defines_predictive_direction):
        assert "frac_direction_disagree" not in stats  # e.g. binary_kl with a closed-form estimator
        del exp_stats["frac_direction_disagree"]
    for k, v in exp_stats.items():
        np.testing.assert_allclose(float(stats[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert all(v.dtype == jnp.float32 and v.shape == () for v in stats.values())
    # [B,T] advantages give the same result
    np.testing.assert_array_equal(np.asarray(mask2), exp_mask)
    if cfg.mask != "none":
        assert 0 < float(stats["frac_masked"]) < 1


def test_pdm_and_dppo_masks_differ_somewhere():
    c = make_case(seed=32, scale=1.0, noise=1.0, **STD)
    adv = np.random.default_rng(33).normal(size=(4,)).astype(np.float32)
    valid = np.ones((4, 6), bool)
    _, s = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, CFG["pdm_exact"])
    assert float(s["frac_direction_disagree"]) > 0


def test_trust_region_radius_by_advantage_sign():
    """delta_low where A < 0, delta_high where A > 0, delta where A = 0 (or NaN); None means delta."""
    adv = np.array([[-2.0, 0.0, 3.0], [-1e-30, -0.0, 1e-30], [np.nan, -np.inf, np.inf]], np.float32)
    want = np.array([[0.02, 0.05, 0.1], [0.02, 0.05, 0.1], [0.05, 0.02, 0.1]], np.float32)
    got = tr.trust_region_radius(adv, 0.05, delta_low=0.02, delta_high=0.1)
    assert got.dtype == jnp.float32 and got.shape == adv.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(tr.trust_region_radius(adv, 0.05)), np.full(adv.shape, 0.05, np.float32))
    only_low = np.asarray(tr.trust_region_radius(adv[0], 0.05, delta_low=0.02))  # [B] advantages, delta_high = delta
    np.testing.assert_array_equal(only_low, np.array([0.02, 0.05, 0.05], np.float32))
    only_high = np.asarray(tr.trust_region_radius(jnp.asarray(adv[0], jnp.bfloat16), 0.05, delta_high=0.1))
    np.testing.assert_array_equal(only_high, np.array([0.05, 0.05, 0.1], np.float32))  # f32 radius for bf16 A
    jitted = jax.jit(tr.trust_region_radius, static_argnums=(1, 2, 3))(adv, 0.05, 0.02, 0.1)
    np.testing.assert_array_equal(np.asarray(jitted), want)
    # The config's per-sign radii are the same rule.
    cfg = CFG["dppo_kl"]
    np.testing.assert_array_equal(
        np.asarray(tr.trust_region_radius(np.array([-1.0, 0.0, 1.0]), cfg.delta, cfg.delta_low, cfg.delta_high)),
        np.array([cfg.radius_low, cfg.delta, cfg.radius_high], np.float32))


def test_direction_criteria_settings_build_valid_configs():
    assert tr.DIRECTION_CRITERIA == ("ratio",) + tr.CLOSED_FORM_ESTIMATORS == ("ratio",) + ESTIMATORS
    assert tr.criterion_settings("ratio") == {"mask": "dppo"}
    for est in ESTIMATORS:
        assert list(tr.criterion_settings(est).items()) == [("mask", "pdm"), ("estimator", est)]
    for name in tr.DIRECTION_CRITERIA:
        cfg = tr.TrustRegionConfig(divergence="topk_kl", delta=0.1, **tr.criterion_settings(name))
        assert cfg.mask == ("dppo" if name == "ratio" else "pdm")
    for bad in ("autodiff", "full", "pdm_bucket_exact", "ppo"):
        with pytest.raises(ValueError, match="direction criterion must be one of"):
            tr.criterion_settings(bad)


def corrupt_padding(c, valid):
    """NaN / inf / out-of-range garbage in every input at the padded positions."""
    c = {k: np.array(v) for k, v in c.items()}
    pad = ~valid
    c["z"][pad] = np.nan
    c["z"][pad, 0] = np.inf
    c["tokens"][pad] = -7
    c["topk_ids"][pad] = 10 ** 6
    c["topk_lp"][pad] = np.nan
    c["behavior_lp"][pad] = np.inf
    return c


@pytest.mark.parametrize("mode", ["pdm_exact", "ppo"])
def test_nan_in_padded_positions_never_reaches_outputs_or_gradients(mode):
    B, T = B_, T_
    c = make_case(seed=40, **STD)
    valid = np.ones((B, T), bool)
    valid[0, 2:] = False
    valid[2, 1:] = False
    adv = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    adv_bt = np.broadcast_to(adv[:, None], (B, T)).copy()
    adv_bt[~valid] = np.nan
    cfg = CFG[mode]
    clean_mask, clean_stats = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, cfg)
    d = corrupt_padding(c, valid)

    def loss(z):
        mask, logprobs, stats = tr.trust_region_mask_and_logprobs(
            z, d["tokens"], d["topk_ids"], d["topk_lp"], d["behavior_lp"], adv_bt, valid, cfg)
        safe = tr.sanitize_inputs(z, d["tokens"], d["topk_ids"], d["topk_lp"], d["behavior_lp"], valid)
        div = tr.topk_kl(*safe)
        ddot = tr.kl_directional_derivative(*safe, estimator="bucket_exact")
        pg = -jnp.sum(jnp.where(mask, jnp.asarray(np.nan_to_num(adv_bt)) * logprobs, 0.0))
        return pg + jnp.sum(jnp.where(valid, div + 0.1 * ddot, 0.0)), (mask, stats)

    (val, (mask, stats)), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(d["z"]))
    assert np.isfinite(float(val))
    g = np.asarray(grad)
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[~valid], 0.0)
    assert np.any(g[valid] != 0)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(clean_mask))
    for k, v in clean_stats.items():
        assert np.isfinite(float(stats[k])), k
        np.testing.assert_allclose(float(stats[k]), float(v), rtol=1e-6, err_msg=k)
    assert float(stats["num_nonfinite"]) == 0 and float(stats["num_bad_ids"]) == 0


def test_nonfinite_valid_positions_are_counted_and_masked():
    B, T = B_, T_
    c = make_case(seed=41, **STD)
    valid = np.ones((B, T), bool)
    adv = np.array([1.0, -1.0, 0.3, -2.0], np.float32)
    cfg = CFG["pdm_exact"]
    clean_mask, _ = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, cfg)
    d = {k: np.array(v) for k, v in c.items()}
    d["z"][0, 1, 3] = np.nan
    d["z"][1, 2, 0] = np.inf
    d["behavior_lp"][1, 0] = np.nan
    d["topk_lp"][0, 2, 1] = np.inf
    bad = np.zeros((B, T), bool)
    bad[0, 1] = bad[1, 2] = bad[1, 0] = bad[0, 2] = True

    def loss(z):
        mask, logprobs, stats = tr.trust_region_mask_and_logprobs(z, *args_of(d), adv, valid, cfg)
        return -jnp.sum(jnp.where(mask, logprobs, 0.0)), (mask, stats)

    (val, (mask, stats)), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(d["z"]))
    assert float(stats["num_nonfinite"]) == 4
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(grad)))
    mask = np.asarray(mask)
    assert not mask[bad].any()
    np.testing.assert_array_equal(mask[~bad], np.asarray(clean_mask)[~bad])
    for k, v in stats.items():
        assert np.isfinite(float(v)), k
    # out-of-range ids in a valid position: counted separately, masked
    e = {k: np.array(v) for k, v in c.items()}
    e["topk_ids"][1, 1, 0] = 99
    m2, s2 = tr.trust_region_mask(e["z"], *args_of(e), adv, valid, cfg)
    assert float(s2["num_bad_ids"]) == 1 and not bool(m2[1, 1])


def test_nonfinite_error_policy_raises_naming_position():
    c = make_case(seed=42, **STD)
    valid = np.ones((B_, T_), bool)
    cfg = tr.TrustRegionConfig(nonfinite="error")
    adv = np.ones((B_,), np.float32)
    tr.trust_region_mask(c["z"], *args_of(c), adv, valid, cfg)  # clean input: no error
    d = {k: np.array(v) for k, v in c.items()}
    d["behavior_lp"][1, 2] = np.nan
    with pytest.raises(ValueError, match=r"position \(1, 2\)"):
        tr.trust_region_mask(d["z"], *args_of(d), adv, valid, cfg)
    with pytest.raises(Exception, match=r"non-finite.*position \(1, 2\)"):
        out = jax.jit(tr.trust_region_mask, static_argnames="config")(d["z"], *args_of(d), adv, valid, config=cfg)
        jax.block_until_ready(out)
    # a NaN in a padded position is not an error
    valid2 = valid.copy()
    valid2[1, 2] = False
    mask, stats = tr.trust_region_mask(d["z"], *args_of(d), adv, valid2, cfg)
    assert float(stats["num_nonfinite"]) == 0


def test_identical_weights_at_temperature_give_ratio_one_and_zero_divergence():
    tau = 0.6
    B, T, V, K = STD["B"], STD["T"], STD["V"], STD["K"]
    rng = np.random.default_rng(50)
    raw = (3.0 * rng.normal(size=(B, T, V))).astype(np.float32)
    logits = raw / tau  # trainer: the same weights, logits divided by tau
    logmu = np.asarray(jax.nn.log_softmax(jnp.asarray(raw) / tau, axis=-1))  # sampler at temperature tau
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    topk_ids = np.argsort(-logmu, -1)[..., :K].astype(np.int32)
    c = dict(z=logits, tokens=tokens, topk_ids=topk_ids, topk_lp=np.take_along_axis(logmu, topk_ids, -1),
             behavior_lp=np.take_along_axis(logmu, tokens[..., None], -1)[..., 0])
    o = run(c)
    close(o["ratio"], 1.0, atol=1e-6, rtol=0)
    for name in tr.DIVERGENCE_FNS:
        close(o["D_" + name], 0.0, atol=2e-6, rtol=0)
    for est in ESTIMATORS:
        close(o[est], 0.0, atol=1e-6, rtol=0)
    # the untempered logits are NOT the sampler's distribution: ratio != 1 there
    assert np.abs(run(dict(c, z=raw))["ratio"] - 1).max() > 0.1
    adv = rng.normal(size=(B,)).astype(np.float32)
    for cfg in (CFG["pdm_exact"], CFG["dppo_kl"], CFG["ppo"]):
        mask, stats = tr.trust_region_mask(logits, *args_of(c), adv, np.ones((B, T), bool), cfg)
        assert bool(jnp.all(mask)) and float(stats["frac_outside"]) == 0.0


def test_token_logprobs_valid_mask_double_where():
    c = make_case(seed=51, **STD)
    valid = np.random.default_rng(5).random((B_, T_)) < 0.6
    z = np.array(c["z"])
    z[~valid] = np.nan
    lp_ref = np.take_along_axis(np.asarray(jax.nn.log_softmax(jnp.asarray(c["z"]))), c["tokens"][..., None], -1)[..., 0]
    lp = tr.token_logprobs(z, c["tokens"], valid)
    close(np.asarray(lp)[valid], lp_ref[valid])
    np.testing.assert_array_equal(np.asarray(lp)[~valid], 0.0)
    g = jax.grad(lambda zz: jnp.sum(tr.token_logprobs(zz, c["tokens"], valid)))(jnp.asarray(z))
    assert np.all(np.isfinite(np.asarray(g)))
    logp, ratio = tr.token_logprobs_and_ratio(c["z"], c["tokens"], c["behavior_lp"])
    close(ratio, np.exp(lp_ref - c["behavior_lp"]), rtol=1e-5)


def test_single_log_softmax_shared_by_mask_and_logprobs():
    """The differentiable log-probs from the mask function equal token_logprobs, gradient included."""
    c = make_case(seed=52, **STD)
    valid = np.ones(c["tokens"].shape, bool)
    cfg = CFG["pdm_exact"]
    adv = np.ones((c["tokens"].shape[0],), np.float32)
    f1 = lambda z: jnp.sum(tr.trust_region_mask_and_logprobs(z, *args_of(c), adv, valid, cfg)[1])  # noqa: E731
    f2 = lambda z: jnp.sum(tr.token_logprobs(z, c["tokens"]))  # noqa: E731
    z = jnp.asarray(c["z"])
    close(f1(z), f2(z))
    close(jax.grad(f1)(z), jax.grad(f2)(z))


# ----------------------------------------------------------------------------- property tests (hypothesis)


PROP_V = 6


@jax.jit
def _props(z, tokens, topk_ids, topk_lp, behavior_lp):
    a = (tokens, topk_ids, topk_lp, behavior_lp)
    v = onehot_minus(jax.nn.softmax(z, -1), tokens)
    out = {est: tr.kl_directional_derivative(z, *a, estimator=est) for est in ESTIMATORS}
    out["D"], out["jvp"] = jax.jvp(lambda zz: tr.topk_kl(zz, *a), (z,), (v,))
    out["tv"] = tr.topk_tv(z, *a)
    out["grad"] = jax.grad(lambda zz: jnp.sum(tr.topk_kl(zz, *a)))(z)
    return out


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), k=st.integers(1, PROP_V),
       scale=st.sampled_from([0.05, 1.0, 4.0, 12.0]), noise=st.sampled_from([0.0, 0.3, 2.0]),
       sampled=st.sampled_from(["any", "inside", "outside"]))
def test_properties_over_peaked_and_flat_logits(seed, k, scale, noise, sampled):
    if sampled == "outside" and k == PROP_V:
        sampled = "inside"
    c = make_case(seed=seed, B=2, T=2, V=PROP_V, K=k, scale=scale, noise=noise, sampled=sampled)
    o = {key: np.asarray(val, np.float64) for key, val in _props(c["z"], *args_of(c)).items()}
    for key, val in o.items():
        assert np.all(np.isfinite(val)), key
    # bucket_exact is the exact derivative of topk_kl (tolerance scaled by the terms' size)
    close(o["bucket_exact"], o["jvp"], atol=5e-6, rtol=1e-4)
    # between the paper's two estimators
    lo = np.minimum(o["uniform_tail"], o["aggregated_tail"]) - 1e-6
    hi = np.maximum(o["uniform_tail"], o["aggregated_tail"]) + 1e-6
    assert np.all((o["bucket_exact"] >= lo) & (o["bucket_exact"] <= hi))
    # divergences in range; KL = 0 and direction = 0 when mu = pi
    assert np.all(o["D"] >= -1e-6)
    assert np.all((o["tv"] >= -1e-6) & (o["tv"] <= 1 + 1e-6))
    if noise == 0.0:
        close(o["D"], 0.0, atol=2e-6, rtol=0)
        for est in ESTIMATORS:
            close(o[est], 0.0, atol=2e-6, rtol=0)
    # float64 restatement of the closed forms (DESIGN.md section 2 table)
    E = candidate_set(c["tokens"], c["topk_ids"], PROP_V)
    mu = dense_mu(c, PROP_V).astype(np.float64)
    logp = np.asarray(c["z"], np.float64)
    top = logp.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp - top).sum(-1, keepdims=True)) - top
    pi = np.exp(logp)
    pi_t = np.where(E, 0, pi).sum(-1)
    n_t = (~E).sum(-1)
    mu_t = np.where(n_t > 0, np.maximum(1 - np.where(E, mu, 0).sum(-1), 0), 0)
    s = np.where(E, mu, 0).sum(-1) + mu_t
    pk = np.take_along_axis(pi, c["tokens"][..., None], -1)[..., 0]
    mk = np.take_along_axis(mu, c["tokens"][..., None], -1)[..., 0]
    head = s * (pk - np.where(E, pi ** 2, 0).sum(-1)) - mk + np.where(E, mu * pi, 0).sum(-1)
    q = {"aggregated_tail": pi_t, "uniform_tail": pi_t / np.maximum(n_t, 1),
         "bucket_exact": np.where(pi_t > 0, np.where(E, 0, pi ** 2).sum(-1) / np.where(pi_t > 0, pi_t, 1), 0)}
    for est in ESTIMATORS:
        close(o[est], head + q[est] * (mu_t - s * pi_t), atol=5e-6, rtol=1e-4)
    # grad of topk_kl along e_k - pi is the jvp
    v = np.asarray(onehot_minus(jnp.asarray(pi, jnp.float32), c["tokens"]), np.float64)
    close((o["grad"] * v).sum(-1), o["jvp"], atol=5e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- zero-mass tails (issue 15)

TAIL_SHAPE = dict(B=4, T=8, V=16)


def masked_tail_case(seed, k, scale, noise, tail_drop):
    """Trainer logits z and sampler logits zb = z + noise, with the same random subset of the tail (ids
    outside the sampler's top-K) at -inf in both; each row drops each tail id with probability tail_drop
    (1.0: the whole tail, as a truncated vocabulary). The sampled token is one of mu's finite ids."""
    B, T, V = TAIL_SHAPE["B"], TAIL_SHAPE["T"], TAIL_SHAPE["V"]
    rng = np.random.default_rng(seed)
    z = (scale * rng.normal(size=(B, T, V))).astype(np.float32)
    zb = (z + noise * rng.normal(size=z.shape)).astype(np.float32)
    topk_ids = np.argsort(-zb, -1)[..., :k].astype(np.int32)
    in_topk = np.zeros((B, T, V), bool)
    np.put_along_axis(in_topk, topk_ids, True, -1)
    drop = ~in_topk & (rng.random((B, T, V)) < tail_drop)
    z, zb = np.where(drop, -np.inf, z).astype(np.float32), np.where(drop, -np.inf, zb).astype(np.float32)
    logmu = np.asarray(jax.nn.log_softmax(jnp.asarray(zb), -1))
    keys = np.where(drop, -1.0, rng.random((B, T, V)))  # uniform over the finite ids
    tokens = np.argmax(keys, -1).astype(np.int32)
    c = dict(z=z, zb=zb, logmu=logmu, tokens=tokens, topk_ids=topk_ids,
             topk_lp=np.take_along_axis(logmu, topk_ids, -1).astype(np.float32),
             behavior_lp=np.take_along_axis(logmu, tokens[..., None], -1)[..., 0].astype(np.float32))
    return c, drop


@jax.jit
def _tail_outputs(z, tokens, topk_ids, topk_lp, behavior_lp):
    a = (tokens, topk_ids, topk_lp, behavior_lp)
    out = {est: tr.kl_directional_derivative(z, *a, estimator=est) for est in ESTIMATORS}
    out["D"] = tr.topk_kl(z, *a)
    out["tv"] = tr.topk_tv(z, *a)
    out["rkl"] = tr.topk_reverse_kl(z, *a)
    out["ad"] = tr.autodiff_directional_derivative(tr.topk_kl, z, *a)
    tq = tr.token_quantities(jax.nn.log_softmax(z, -1), *a)
    out["mu_t"], out["pi_t"] = tq.mu_t, tq.pi_t
    return out


def f64_topk_kl(c):
    """Float64 top-K KL from the same f32 inputs, the behaviour tail taken exactly from zb: (D, mu_T, pi_T)."""
    V = c["z"].shape[-1]
    E = candidate_set(c["tokens"], c["topk_ids"], V)
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = c["z"].astype(np.float64)
        lp = lp - lp.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        lmu = c["zb"].astype(np.float64)
        lmu = lmu - lmu.max(-1, keepdims=True)
        lmu = lmu - np.log(np.exp(lmu).sum(-1, keepdims=True))
        mu_e = np.where(E, dense_mu(c, V).astype(np.float64), 0)  # mu on E from the f32 log-probs
        head = np.where(E & (mu_e > 0), mu_e * (np.log(mu_e) - lp), 0).sum(-1)
        mu_t, pi_t = np.where(E, 0, np.exp(lmu)).sum(-1), np.where(E, 0, np.exp(lp)).sum(-1)
        tail = np.where(mu_t > 0, mu_t * np.log(mu_t / pi_t), 0)
    return head + tail, mu_t, pi_t


def test_zero_mass_tails_give_zero_topk_kl_not_inf():
    """Issue 15: every logit outside the top-K at -inf (a truncated vocabulary) and mu = pi: before, f32
    rounding left mu_T = 1 - sum_E mu ~ 6e-8 > 0 = pi_T, so D = +inf and the token was masked as
    non-finite (about 1 row in 5). D is 0, every direction finite, and the mask keeps every token."""
    c, drop = masked_tail_case(seed=7, k=4, scale=3.0, noise=0.0, tail_drop=1.0)
    assert drop.sum(-1).min() == TAIL_SHAPE["V"] - 4  # the whole tail is -inf
    residue = 1.0 - np.exp(c["topk_lp"]).sum(-1, dtype=np.float32)
    assert (residue > 0).any()  # the rounding that used to give +inf is present in these inputs
    o = {k: np.asarray(v) for k, v in _tail_outputs(c["z"], *args_of(c)).items()}
    np.testing.assert_array_equal(o["mu_t"], 0.0)
    np.testing.assert_array_equal(o["pi_t"], 0.0)
    close(o["D"], 0.0, atol=1e-6, rtol=0)
    for key, val in o.items():
        assert np.all(np.isfinite(val)), key
    adv = np.linspace(-1, 1, TAIL_SHAPE["B"]).astype(np.float32)
    valid = np.ones(c["tokens"].shape, bool)
    for cfg in (CFG["pdm_exact"], CFG["dppo_kl"]):
        mask, stats = tr.trust_region_mask(c["z"], *args_of(c), adv, valid, cfg)
        assert float(stats["num_nonfinite"]) == 0.0 and bool(jnp.all(mask))


def test_tail_mass_tolerance_values():
    eps = float(np.finfo(np.float32).eps)
    assert tr.tail_mass_tolerance(2) == pytest.approx(6 * eps)  # K = 1
    assert tr.tail_mass_tolerance(5) == pytest.approx(9 * eps)  # K = 4: 1.07e-6
    assert tr.tail_mass_tolerance(21) == pytest.approx(2.98e-6, rel=1e-3)
    with pytest.raises(ValueError, match="num_candidates"):
        tr.tail_mass_tolerance(0)


def test_resolved_behaviour_tail_is_left_as_computed():
    """A mu_T above the tolerance is exactly max(0, 1 - sum_E mu) in f32, as before the rounding rule."""
    c = make_case(seed=60, scale=1.0, **STD)
    o = run(c)
    assert o["tq_mu_t"].min() > 100 * tr.tail_mass_tolerance(STD["K"] + 1)
    expected = np.maximum(1.0 - np.asarray(jnp.sum(jnp.asarray(o["tq_mu_e"]), -1)), 0.0)
    np.testing.assert_array_equal(o["tq_mu_t"], expected)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), k=st.sampled_from([1, 4, 8]), scale=st.sampled_from([0.5, 3.0, 10.0]),
       tail_drop=st.sampled_from([0.0, 0.5, 0.9, 1.0]), noise=st.sampled_from([0.0, 0.05, 1.0]))
def test_topk_kl_with_masked_tails_property(seed, k, scale, tail_drop, noise):
    """Random logits with an arbitrary subset of the tail at -inf (the same subset for mu and pi, so the
    divergence is finite): D(mu, mu) = 0 to 1e-6; D finite and >= 0; and D equals the float64 top-K KL up
    to the rounding of mu_T (sensitivity 1 + |log(mu_T / pi_T)| per unit of mu_T, tolerance each)."""
    c, _ = masked_tail_case(seed, k, scale, noise, tail_drop)
    o = {key: np.asarray(val, np.float64) for key, val in _tail_outputs(c["z"], *args_of(c)).items()}
    for key, val in o.items():
        assert np.all(np.isfinite(val)), key
    assert np.all(o["D"] >= -1e-6)
    if noise == 0.0:
        close(o["D"], 0.0, atol=1e-6, rtol=0)
        for est in ESTIMATORS:
            close(o[est], 0.0, atol=2e-6, rtol=0)
    ref, mu_t, pi_t = f64_topk_kl(c)
    tol = tr.tail_mass_tolerance(k + 1)
    with np.errstate(divide="ignore"):
        sensitivity = np.where(mu_t > 0, 2.0 + np.abs(np.log(np.maximum(mu_t, tol) / pi_t)), 2.0)
    assert np.all(np.abs(o["D"] - ref) <= 1e-5 * ref + tol * sensitivity + 1e-7)
