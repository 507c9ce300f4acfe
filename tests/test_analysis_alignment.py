"""`pdm_jax.analysis.alignment`: the token-level bookkeeping by hand (realized change, the criteria's counts and
rates, both readings), confidence intervals, estimator fidelity. The callback that collects the records, the
report and one seed's run: tests/test_analysis_callback.py, test_analysis_report.py, test_analysis_run.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis import alignment as al
from pdm_jax.analysis import report
from pdm_jax.rl.step_batch import StepBatch


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _hand_topk_kl(z, mu_e: dict, token):
    """Top-K KL by hand: E = the ids in mu_e (top-K ∪ {token}); one tail bucket for the rest."""
    pi = _softmax(np.asarray(z, np.float64))
    d = sum(m * math.log(m / pi[i]) for i, m in mu_e.items())
    mu_t = 1.0 - sum(mu_e.values())
    pi_t = 1.0 - sum(pi[i] for i in mu_e)
    return d + mu_t * math.log(mu_t / pi_t)


def _hand_ddot_aggregated(z, mu_e: dict, token):
    """DESIGN.md §2: (π_k − μ_k) + Σ_E π_i(μ_i − π_i) + π_T(μ_T − π_T)."""
    pi = _softmax(np.asarray(z, np.float64))
    mu_t = 1.0 - sum(mu_e.values())
    pi_t = 1.0 - sum(pi[i] for i in mu_e)
    return (pi[token] - mu_e[token]) + sum(pi[i] * (m - pi[i]) for i, m in mu_e.items()) + pi_t * (mu_t - pi_t)


def _batch_one_position(tokens, topk_ids, topk_mu, mu_k, adv):
    """Train-step batch of B sequences with one completion token each (V = 4, K = 1)."""
    b = len(tokens)
    return StepBatch(
        prompt_ids=None, prompt_mask=None,
        completion_ids=jnp.asarray(np.array(tokens, np.int32)[:, None]),
        completion_mask=jnp.ones((b, 1), bool),
        behavior_logprobs=jnp.asarray(np.log(np.array(mu_k, np.float32))[:, None]),
        topk_ids=jnp.asarray(np.array(topk_ids, np.int32)[:, None, None]),
        topk_logprobs=jnp.asarray(np.log(np.array(topk_mu, np.float32))[:, None, None]),
        advantages=jnp.asarray(np.array(adv, np.float32)),
    )


def test_realized_change_bookkeeping_by_hand():
    # Three tokens, V = 4, K = 1. mu puts 0.7 on id 0 (the top-1) in every row.
    #  row 0: sampled id 0 (in the top-K), A = +1, pi moved away from mu -> outside; the update moves
    #         the logits back towards mu (D decreases).
    #  row 1: sampled id 2 (not in the top-K, mu(2) = 0.1), A = -1, outside; the update pushes further (D up).
    #  row 2: sampled id 0, A = +1 but inside the region (pi = mu up to 1e-3 in the logits).
    mu = np.array([0.7, 0.1, 0.1, 0.1])
    zmu = np.log(mu)
    before = np.stack([zmu + np.array([-0.8, 0.3, 0.0, 0.0]), zmu + np.array([0.0, 0.0, 0.9, -0.4]),
                       zmu + np.array([1e-3, 0.0, 0.0, 0.0])])
    after = np.stack([zmu + np.array([-0.5, 0.2, 0.0, 0.0]), zmu + np.array([0.0, 0.0, 1.3, -0.4]),
                      zmu + np.array([2e-3, 0.0, 0.0, 0.0])])
    batch = _batch_one_position(tokens=[0, 2, 0], topk_ids=[0, 0, 0], topk_mu=[0.7] * 3, mu_k=[0.7, 0.1, 0.7],
                                adv=[1.0, -1.0, 1.0])
    delta = 0.01
    a = jax.device_get(al.token_analysis(jnp.asarray(before[:, None], jnp.float32),
                                         jnp.asarray(after[:, None], jnp.float32), batch, delta=delta))
    mu_e = [{0: 0.7}, {0: 0.7, 2: 0.1}, {0: 0.7}]
    tokens = [0, 2, 0]
    for r in range(3):
        d0 = _hand_topk_kl(before[r], mu_e[r], tokens[r])
        d1 = _hand_topk_kl(after[r], mu_e[r], tokens[r])
        np.testing.assert_allclose(a["d_before"][r, 0], d0, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(a["d_after"][r, 0], d1, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(a["delta_d"][r, 0], d1 - d0, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(a["dir_aggregated_tail"][r, 0], _hand_ddot_aggregated(before[r], mu_e[r], tokens[r]),
                                   rtol=1e-4, atol=1e-6)
    assert a["delta_d"][0, 0] < 0 < a["delta_d"][1, 0]
    assert list(a["outside"][:, 0]) == [True, True, False]
    # ratio keep: masked iff outside and A (log pi(k) - log mu(k)) > 0.
    #  row 0: log r = -0.8 - log Z < 0 (pi(0) < 0.7), A = +1 -> A log r < 0 -> kept.
    #  row 1: pi(2) > 0.1 -> log r > 0, A = -1 -> kept.
    pi0 = _softmax(before[0])[0]
    pi1 = _softmax(before[1])[2]
    assert pi0 < 0.7 and pi1 > 0.1
    assert list(a["keep_ratio"][:, 0]) == [True, True, True]
    # predictive (aggregated tail): masked iff A * Ddot > 0.
    for r in range(2):
        ddot = _hand_ddot_aggregated(before[r], mu_e[r], tokens[r])
        assert bool(a["keep_aggregated_tail"][r, 0]) == (not (batch.advantages[r] * ddot > 0))
    # Selection drops the inside token; counts follow from the hand-known signs and keeps.
    rec = al.select_tokens(a)
    assert list(rec["row"]) == [0, 1]
    c = al.alignment_counts(rec)
    assert (c["n"], c["n_increase"], c["n_decrease"]) == (2, 1, 1)
    assert c["ratio"] == dict(kept_increase=1, kept_decrease=1, agree=1, disagree_with_ratio=0,
                              right_on_disagreement=0)
    rates = al.alignment_rates(c)
    assert rates["ratio"]["unsafe_keep"] == 1.0 and rates["ratio"]["corrective"] == 1.0
    assert rates["ratio"]["sign_agreement"] == 0.5


def test_alignment_counts_by_hand():
    # 6 tokens: ΔD signs + + + - - 0; ratio keeps K K M K M K; predictive keeps M K M K K K.
    rec = dict(delta_d=np.array([0.1, 0.2, 0.3, -0.1, -0.2, 0.0]),
               keep_ratio=np.array([1, 1, 0, 1, 0, 1], bool),
               keep_bucket_exact=np.array([0, 1, 0, 1, 1, 1], bool))
    c = al.alignment_counts(rec)
    assert (c["n"], c["n_increase"], c["n_decrease"], c["n_tie"]) == (6, 3, 2, 1)
    r = al.alignment_rates(c)
    assert r["ratio"]["unsafe_keep"] == pytest.approx(2 / 3)
    assert r["ratio"]["corrective"] == pytest.approx(1 / 2)
    assert r["bucket_exact"]["unsafe_keep"] == pytest.approx(1 / 3)
    assert r["bucket_exact"]["corrective"] == pytest.approx(2 / 2)
    # agreement: predicted increase = masked. ratio right on tokens 2 (masked, +) and 3 (kept, -): 2/5.
    assert r["ratio"]["sign_agreement"] == pytest.approx(2 / 5)
    # predictive right on 0 (M,+), 2 (M,+), 3 (K,-), 4 (K,-): 4/5.
    assert r["bucket_exact"]["sign_agreement"] == pytest.approx(4 / 5)
    # disagreement with ratio: tokens 0 and 4 (token 5 ties, keeps equal) -> 2 of 6; predictive right on both.
    assert r["bucket_exact"]["disagreement_n"] == 2
    assert r["bucket_exact"]["disagreement_frac"] == pytest.approx(2 / 6)
    assert r["bucket_exact"]["right_on_disagreement"] == 1.0
    assert math.isnan(al.alignment_rates(al.alignment_counts(dict(delta_d=np.array([0.1]),
                                                                  keep_ratio=np.array([True]))))["ratio"]["corrective"])


def test_param_jvp_criterion_counts_by_hand():
    """param_jvp keeps iff Ḋᵖ <= 0 on the real step; on the isolated step it is the sign of iso_first_order,
    and it has no row against iso_first_order itself (it would agree with itself by construction)."""
    d_dot = np.array([0.3, -0.1, 0.2, -0.4, 0.05, np.nan])
    outside = np.array([True, True, True, True, False, True])
    keep = al.param_keep(d_dot, outside)
    assert list(keep) == [False, True, False, True, True, True]  # inside (index 4) and NaN (index 5) keep
    rec = dict(delta_d=np.array([0.1, -0.2, -0.3, -0.1, 0.2, 0.5]), keep_ratio=np.ones(6, bool),
               keep_param_jvp=keep, iso_delta_d=np.array([0.1, 0.1, -0.1, -0.1, 0.1, 0.1]),
               iso_first_order=np.array([1.0, -1.0, -1.0, 1.0, 1.0, 1.0]))
    r = al.alignment_rates(al.alignment_counts(rec))["param_jvp"]
    # real step: right on 0 (M,+), 1 (K,-), 3 (K,-), wrong on 2 (M,-), 4 (K,+), 5 (K,+).
    assert r["sign_agreement"] == pytest.approx(3 / 6)
    assert r["unsafe_keep"] == pytest.approx(2 / 3) and r["corrective"] == pytest.approx(2 / 3)
    assert r["disagreement_n"] == 2  # ratio keeps everything; param_jvp masks 0 and 2
    iso = al.alignment_rates(al.alignment_counts(rec, change_key="iso_delta_d"))["param_jvp"]
    # isolated: keep = first order <= 0 -> M K K M M M; ΔD signs + + - - + +: right on 0, 2, 4, 5.
    assert iso["sign_agreement"] == pytest.approx(4 / 6)
    assert "param_jvp" not in al.alignment_counts(rec, change_key="iso_first_order")
    assert al.criteria_in({k: v for k, v in rec.items() if k != "keep_param_jvp"}) == ["ratio"]


def test_mean_ci95_against_scipy_free_reference():
    xs = [0.3, 0.5, 0.4, 0.6]
    m, half, n = al.mean_ci95(xs + [float("nan")])
    sd = np.std(xs, ddof=1)
    assert n == 4 and m == pytest.approx(0.45)
    assert half == pytest.approx(3.182446305284263 * sd / 2.0, rel=1e-6)  # t_{0.975, 3}
    assert math.isnan(al.mean_ci95([0.2])[1])


def test_fidelity_exact_when_the_tail_has_at_most_one_token():
    # V = 5, K = 4: E = TopK ∪ {y} covers >= 4 ids, so |T| <= 1 and every estimator is the exact
    # full-vocabulary derivative (uniform = aggregated = bucket_exact): agreement must be 100%.
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(3, 7, 5)) * 2, jnp.float32)
    zq = z + jnp.asarray(rng.normal(size=(3, 7, 5)) * 0.3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 5, size=(3, 7)), jnp.int32)
    f = jax.device_get(al.fidelity_analysis(z, zq, tokens, jnp.ones((3, 7), bool), k=4))
    for name in tr.CLOSED_FORM_ESTIMATORS:
        np.testing.assert_allclose(f[f"dir_{name}"], f["dir_full"], rtol=2e-4, atol=2e-6)
        assert f[f"agree_{name}"].all()
    counts = al.fidelity_counts(f)
    assert counts["n"].sum() == 21 and all(counts[e].sum() == 21 for e in tr.CLOSED_FORM_ESTIMATORS)


def test_fidelity_bins_count_tail_mass():
    fid = dict(valid=np.array([True, True, True, False]), tail_mass=np.array([5e-5, 0.05, 0.5, 0.5]),
               agree_aggregated_tail=np.array([True, False, True, True]),
               agree_uniform_tail=np.array([True, True, False, True]),
               agree_bucket_exact=np.array([True, True, True, True]))
    c = al.fidelity_counts(fid)
    assert list(c["n"]) == [1, 0, 0, 0, 1, 0, 1]
    assert list(c["aggregated_tail"]) == [1, 0, 0, 0, 0, 0, 1]
    assert list(c["uniform_tail"]) == [1, 0, 0, 0, 1, 0, 0]
    total = al.add_fidelity_counts(al.add_fidelity_counts(None, c), c)
    assert list(total["n"]) == [2, 0, 0, 0, 2, 0, 2]
    fid["tail_mass"] = np.array([5e-5, 0.05, np.nan, 0.5])  # a valid token without a finite tail mass: no bin
    assert list(al.fidelity_counts(fid)["n"]) == [1, 0, 0, 0, 1, 0, 0]


def test_both_readings_and_youden_j_by_hand():
    """10 out-of-region tokens, ΔD > 0 on 6, < 0 on 4; ratio keeps 3 increased + 2 decreased, bucket_exact
    keeps 1 increased + 2 decreased. Precision reading (the paper's): P(ΔD>0 | kept), P(ΔD<0 | kept), which
    add up to 1; keep-rate reading: P(kept | ΔD>0), P(kept | ΔD<0); J = the second minus the first."""
    dd = np.array([1, 1, 1, 1, 1, 1, -1, -1, -1, -1], np.float32)
    keep_ratio = np.array([1, 1, 1, 0, 0, 0, 1, 1, 0, 0], bool)
    keep_be = np.array([1, 0, 0, 0, 0, 0, 1, 1, 0, 0], bool)
    rec = dict(delta_d=dd, keep_ratio=keep_ratio, keep_bucket_exact=keep_be)
    r = al.alignment_rates(al.alignment_counts(rec))
    assert r["ratio"]["unsafe_share"] == pytest.approx(3 / 5) and r["ratio"]["corrective_share"] == pytest.approx(2 / 5)
    assert r["bucket_exact"]["unsafe_share"] == pytest.approx(1 / 3)
    assert r["bucket_exact"]["corrective_share"] == pytest.approx(2 / 3)
    assert r["ratio"]["unsafe_keep"] == pytest.approx(3 / 6) and r["ratio"]["corrective"] == pytest.approx(2 / 4)
    be = r["bucket_exact"]
    assert be["unsafe_keep"] == pytest.approx(1 / 6) and be["corrective"] == pytest.approx(2 / 4)
    assert r["ratio"]["youden_j"] == pytest.approx(0.0) and be["youden_j"] == pytest.approx(2 / 4 - 1 / 6)
    # masking more lowers both keep rates (corrective keep unchanged here) but raises the corrective share
    summ = report.summarize([dict(seed=0, counts=al.alignment_counts(rec), rates=r)])
    text = report.headline(summ)
    assert "unsafe-keep agrees" in text and "corrective agrees" in text and "vs the paper's -2.7 pts" in text
    assert "P(kept | ΔD > 0) agrees" in report.headline(summ, reading="keep_rate")
    assert "vs the paper" not in report.headline(summ, reading="keep_rate")  # the paper gives no keep rates
