"""Token-level analysis: hand-checked bookkeeping, isolated step vs autodiff, fidelity, no effect on training."""

import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis import alignment as al
from pdm_jax.analysis import report
from pdm_jax.analysis.callback import AlignmentCallback, isolated_changes
from pdm_jax.metrics import read_metrics
from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.trainer import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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


def _tiny_model(seed=0):
    cfg = Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=32, tie_word_embeddings=True)
    return nnx.split(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)))


@pytest.mark.slow
def test_isolated_step_matches_autodiff_reference():
    """iso_first_order = −∇D·∇ℓ/‖∇ℓ‖ (independent grads), and the finite step ≈ ε × first order."""
    graphdef, params = _tiny_model()
    rng = np.random.default_rng(1)
    n, p, t, k = 2, 3, 4, 2
    prompt_ids = rng.integers(0, 8, size=(n, p)).astype(np.int32)
    prompt_mask = np.ones((n, p), bool)
    comp = rng.integers(0, 8, size=(n, t)).astype(np.int32)
    cmask = np.ones((n, t), bool)
    zq = rng.normal(size=(n, t, 8)).astype(np.float32)
    logmu = zq - np.log(np.exp(zq).sum(-1, keepdims=True))
    topk_ids = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    topk_lp = np.take_along_axis(logmu, topk_ids, -1)
    beh = np.take_along_axis(logmu, comp[..., None], -1)[..., 0]
    adv = np.array([1.0, -0.5], np.float32)
    cols = np.array([1, 3], np.int32)
    eps = 1e-3
    d, first, gnorm = jax.device_get(isolated_changes(graphdef, params, prompt_ids, prompt_mask, comp, cmask, beh,
                                                      topk_ids, topk_lp, adv, cols, temperature=1.0, tis_cap=5.0,
                                                      step_size=eps))
    for i in range(n):
        c = int(cols[i])

        def logits_at(prm):
            z = ts.completion_logits(graphdef, prm, prompt_ids[i:i + 1], prompt_mask[i:i + 1], comp[i:i + 1],
                                     cmask[i:i + 1])
            return z[0, c]

        def dfn(prm):
            return tr.topk_kl(logits_at(prm), comp[i, c], topk_ids[i, c], topk_lp[i, c], beh[i, c])

        def loss(prm):
            lp = jax.nn.log_softmax(logits_at(prm))[comp[i, c]]
            return -adv[i] * jax.lax.stop_gradient(jnp.minimum(jnp.exp(lp - beh[i, c]), 5.0)) * lp

        gd, gl = jax.grad(dfn)(params), jax.grad(loss)(params)
        dot = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gl)))
        norm = math.sqrt(sum(float(jnp.vdot(b, b)) for b in jax.tree.leaves(gl)))
        assert gnorm[i] == pytest.approx(norm, rel=1e-4)
        assert first[i] == pytest.approx(-dot / norm, rel=1e-3, abs=1e-7)
        assert d[i] == pytest.approx(eps * first[i], rel=0.05, abs=1e-7)


@pytest.mark.slow
def test_analysis_changes_nothing_in_training(tmp_path):
    """Two short in-process runs, with and without the callback: identical training metrics and weights."""
    from test_trainer import tiny_test_config  # a sibling test module (tests/ is put on sys.path above)

    overrides = {"sampler.mode": "in_process", "rl.steps": 2, "sft.steps": 4, "rl.num_iterations": 2,
                 "rl.max_staleness": 1, "trust_region.delta": 1e-4, "eval.num_prompts": 4,
                 "eval.samples_per_prompt": 1, "eval.greedy": False}
    cb = AlignmentCallback(full_mu=True, isolated_tokens=2)
    runs = {}
    for name, callbacks in (("plain", []), ("analysed", [cb])):
        wd = str(tmp_path / name)
        summary = Trainer(tiny_test_config(**overrides), wd, callbacks=callbacks).run()
        recs = [r for r in read_metrics(os.path.join(wd, "metrics.jsonl")) if r["phase"] in ("rl", "eval")]
        timing = {"step_seconds", "generate_seconds", "train_seconds", "sampler_tokens_per_second"}
        runs[name] = ([{k: v for k, v in r.items()  # times and compile counts (jit caches are warm) differ
                        if k not in timing and not k.startswith("time_") and "compile" not in k}
                       for r in recs], summary)
    assert runs["plain"][0] == runs["analysed"][0]
    assert runs["plain"][1]["final_accuracy"] == runs["analysed"][1]["final_accuracy"]
    # The callback saw every optimizer step (2 RL steps x 2 mini-batches x 2 iterations) and its "before"
    # logits are the trainer's: same mean top-K KL and outside fraction as the step's own metrics.
    assert len(cb.steps) == 8
    for st in cb.steps:
        assert st["mean_d_before"] == pytest.approx(st["trainer_mean_topk_kl"], rel=1e-4, abs=1e-7)
        assert st["num_outside"] / st["num_valid"] == pytest.approx(st["trainer_frac_outside"], abs=1e-6)
        assert st["behavior_logprob_max_err"] < 1e-3
        assert st["behavior_version_fallbacks"] == 0  # every row's version was kept (staleness <= 1)
    # The batch's weights_version names the sampler's version: with max_staleness 1 the batch of RL
    # step 2 may have been sampled by version 0 (lag 1) or 1 (lag 0), never anything else.
    assert [st["behavior_version_lag"] for st in cb.steps[:4]] == [0] * 4
    assert all(st["behavior_version_lag"] in (0, 1) for st in cb.steps[4:])
    rec = cb.token_records()
    assert len(rec["delta_d"]) > 0 and np.isfinite(rec["delta_d"]).all()
    assert np.isfinite(rec["iso_delta_d"]).any()
    assert cb.fidelity is not None and cb.fidelity["n"].sum() > 0
    # Ḋᵖ along each real update: its jvp saw the trainer's logits (same D), and it is recorded per token.
    assert all(st["param_jvp_d_max_err"] < 1e-5 for st in cb.steps)
    assert np.isfinite(rec["dir_param_jvp"]).all()
    np.testing.assert_array_equal(rec["keep_param_jvp"], rec["dir_param_jvp"] <= 0)
    # First order along a small real step predicts the realized sign well (measured 95.9% on this setting,
    # against 77.6-87.8% for the ratio test and the logit-space estimators); a flipped Δθ would give ~4%.
    rates = al.alignment_rates(al.alignment_counts(rec))
    assert rates["param_jvp"]["sign_agreement"] > 0.9


def _synthetic_seed(seed, rng):
    """Records where the predictive criteria mask the increased tokens that ratio keeps (by construction)."""
    n = 200
    dd = rng.normal(size=n)
    inc = dd > 0
    keep_ratio = rng.random(n) < 0.5
    keep_pred = keep_ratio & ~(inc & (rng.random(n) < 0.3))  # drop 30% of the unsafe keeps
    rec = dict(delta_d=dd, keep_ratio=keep_ratio, iso_delta_d=np.where(np.arange(n) < 50, dd, np.nan),
               iso_first_order=np.where(np.arange(n) < 50, dd, np.nan))
    for c in tr.CLOSED_FORM_ESTIMATORS:
        rec[f"keep_{c}"] = keep_pred
    rec["keep_param_jvp"] = np.where(rng.random(n) < 0.9, ~inc, inc)  # right on ~90% of the tokens
    steps = [dict(num_valid=400, num_outside=n, num_selected=n, behavior_logprob_max_err=1e-6,
                  behavior_version_lag=1)]
    fid = dict(bins=list(al.TAIL_MASS_BINS), n=[0, 0, 10, 0, 0, 0, 5], aggregated_tail=[0, 0, 9, 0, 0, 0, 3],
               uniform_tail=[0, 0, 10, 0, 0, 0, 4], bucket_exact=[0, 0, 10, 0, 0, 0, 5])
    return dict(seed=seed, records=rec, steps=steps, fidelity=fid, seconds=1.0,
                summary=dict(warmstart_accuracy=0.1, final_accuracy=0.2),
                settings=dict(config="configs/tiny.py", arg="delta=0.005", isolated_tokens=8, isolated_step=0.01))


def test_report_from_synthetic_seeds(tmp_path):
    rng = np.random.default_rng(0)
    seeds = [_synthetic_seed(s, rng) for s in range(4)]
    per_seed = report.seed_rates(seeds)
    summ = report.summarize(per_seed)
    # predictive keeps a subset of ratio's keeps, dropping only increased tokens: corrective identical,
    # unsafe-keep strictly lower in every seed.
    d_unsafe = summ["bucket_exact"]["diff_vs_ratio"]["unsafe_keep"]
    assert d_unsafe[0] < 0 and d_unsafe[2] == 4
    assert summ["bucket_exact"]["diff_vs_ratio"]["corrective"][0] == 0.0
    assert "unsafe-keep agrees with the paper's direction" in report.headline(summ)
    text = report.write_report(seeds, str(tmp_path))
    assert "Paper vs ours" in text and "delta=0.005" in text and "Estimator fidelity" in text
    # the parameter-space row and its sentence: ~90% sign agreement against ~50-65% for the logit-space ones
    assert "| parameter-space Ḋᵖ along Δθ (first-order oracle) |" in text
    sa = summ["param_jvp"]["sign_agreement"][0]
    best = max(summ[c]["sign_agreement"][0] for c in tr.CLOSED_FORM_ESTIMATORS)
    assert 0.85 < sa < 0.95 and best < 0.75
    assert f"Ḋᵖ minus that estimator {100 * (sa - best):+.1f} pts" in text
    for name in ("README.md", "paper_vs_ours.png", "differences.png", "estimator_fidelity.png",
                 "per_seed_bucket_exact.png"):
        assert os.path.getsize(tmp_path / name) > 0
    # the fidelity table pools the seeds: 4 x 10 tokens in the [1e-3, 1e-2) bin, 4 x 9 agree for aggregated.
    assert "| [1e-03, 1e-02) | 40 | 90.0% | 100.0% | 100.0% |" in text
    # disagreement set per seed, counted here by hand: tokens where keep_bucket_exact != keep_ratio
    counts = [int(np.sum(s["records"]["keep_bucket_exact"] != s["records"]["keep_ratio"])) for s in seeds]
    m, ci, _ = al.mean_ci95(counts)
    row = (f"| real | predictive, bucket exact | {m:.1f} ± {ci:.1f} | {np.median(counts):.0f} | "
           f"{min(counts)}–{max(counts)} | 200 ± 0 | ≈ 82 |")
    assert row in text and "Per seed (real step, bucket exact; seed: tokens): 0: " + str(counts[0]) + "," in text


def test_report_names_the_code_versions_of_pooled_seeds(tmp_path):
    rng = np.random.default_rng(1)
    seeds = [_synthetic_seed(s, rng) for s in range(5)]
    for s in seeds:
        s["settings"]["git_commit"] = "aaa" if s["seed"] in (0, 1, 3) else "bbb"
    text = report.write_report(seeds, str(tmp_path))
    assert "`aaa`: seeds 0–1, 3; `bbb`: seeds 2, 4." in text


def test_run_seed_refuses_an_unfinished_warmstart(tmp_path):
    from pdm_jax.analysis.run import run_seed

    (tmp_path / "warm").mkdir()
    with pytest.raises(ValueError, match="warmstart=.*no summary.json"):
        run_seed(None, str(tmp_path / "wd"), warmstart=str(tmp_path / "warm"))


def test_behavior_logits_follow_weights_version_with_counted_fallback():
    """Rows use the weights version the batch names; a version that is not kept falls back to the
    best log-μ match among the kept ones and is counted."""
    cfg = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    trainer = types.SimpleNamespace(
        model_config=cfg,
        config=types.SimpleNamespace(sampler=types.SimpleNamespace(quantization="none"),
                                     rl=types.SimpleNamespace(max_staleness=1)))
    cb = AlignmentCallback(full_mu=True)
    for version, seed in ((3, 0), (4, 1)):
        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))
        cb._snapshot_version(trainer, version, params)
    rng = np.random.default_rng(0)
    host = StepBatch(prompt_ids=rng.integers(0, 16, (4, 3)).astype(np.int32), prompt_mask=np.ones((4, 3), bool),
                     completion_ids=rng.integers(0, 16, (4, 5)).astype(np.int32),
                     completion_mask=np.ones((4, 5), bool))
    z3, lp3 = cb._version_logits(3, host, 1.0)
    z4, lp4 = cb._version_logits(4, host, 1.0)
    assert np.abs(lp3 - lp4).max() > 1e-3  # the two versions are distinguishable
    # rows 0-1 sampled by version 4, rows 2-3 by version 3
    host = host.replace(weights_version=np.array([4, 4, 3, 3], np.int32),
                        behavior_logprobs=np.concatenate([lp4[:2], lp3[2:]]))
    z, lag, err, fallbacks = cb._behavior_logits(trainer, host, 1.0, rl_step=5)
    np.testing.assert_array_equal(z[:2], z4[:2])
    np.testing.assert_array_equal(z[2:], z3[2:])
    assert (lag, fallbacks) == (1, 0) and err < 1e-6
    # rows 2-3 claim version 1 (not kept): matched to version 3 by log μ, counted
    host = host.replace(weights_version=np.array([4, 4, 1, 1], np.int32))
    z, lag, err, fallbacks = cb._behavior_logits(trainer, host, 1.0, rl_step=5)
    np.testing.assert_array_equal(z[2:], z3[2:])
    assert (lag, fallbacks) == (1, 2) and err < 1e-6


def test_one_seed_verdict_never_calls_a_difference_significant():
    """One seed has no confidence interval: the verdict says so, as the headline counts 0 significant."""
    rng = np.random.default_rng(0)
    summ = report.summarize(report.seed_rates([_synthetic_seed(0, rng)]))
    text = report.verdict(summ, "bucket_exact")
    assert "(significant)" not in text and "significance unknown (one seed" in text
    assert "0 of" in report.headline(summ)


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
    assert r["bucket_exact"]["unsafe_keep"] == pytest.approx(1 / 6) and r["bucket_exact"]["corrective"] == pytest.approx(2 / 4)
    assert r["ratio"]["youden_j"] == pytest.approx(0.0) and r["bucket_exact"]["youden_j"] == pytest.approx(2 / 4 - 1 / 6)
    # masking more lowers both keep rates (corrective keep unchanged here) but raises the corrective share
    summ = report.summarize([dict(seed=0, counts=al.alignment_counts(rec), rates=r)])
    text = report.headline(summ)
    assert "unsafe-keep agrees" in text and "corrective agrees" in text and "vs the paper's -2.7 pts" in text
    assert "P(kept | ΔD > 0) agrees" in report.headline(summ, reading="keep_rate")
    assert "vs the paper" not in report.headline(summ, reading="keep_rate")  # the paper gives no keep rates
