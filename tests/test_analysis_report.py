"""`pdm_jax.analysis.report`: the report, its headline and verdicts from synthetic seeds."""

import os

import numpy as np

from pdm_jax.analysis import alignment as al
from pdm_jax.analysis import report
from pdm_jax.rl import trust_region as tr


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


def test_one_seed_verdict_never_calls_a_difference_significant():
    """One seed has no confidence interval: the verdict says so, as the headline counts 0 significant."""
    rng = np.random.default_rng(0)
    summ = report.summarize(report.seed_rates([_synthetic_seed(0, rng)]))
    text = report.verdict(summ, "bucket_exact")
    assert "(significant)" not in text and "significance unknown (one seed" in text
    assert "0 of" in report.headline(summ)


def test_topk_capture_pools_the_seeds_and_is_left_out_without_full_mu(tmp_path):
    """Σ top-K KL / Σ full KL, computed here by hand: pooled over every token, and the mean of the seeds' ratios."""
    rng = np.random.default_rng(2)
    seeds = [_synthetic_seed(s, rng) for s in range(3)]
    assert report.topk_capture(seeds) is None and "Top-K KL capture" not in report.write_report(seeds, str(tmp_path))
    sums = []
    for s in seeds:
        full = rng.uniform(0.05, 0.5, size=200)
        topk = full * rng.uniform(0.8, 1.0, size=200)
        topk[0] = np.nan  # a non-finite record is left out of both sums
        s["records"].update(d_before=topk, full_kl_before=full)
        sums.append((np.nansum(topk), full[1:].sum()))
    cap = report.topk_capture(seeds)
    assert cap["n"] == 3 * 199 and cap["seeds"] == 3
    assert abs(cap["pooled"] - sum(a for a, _ in sums) / sum(b for _, b in sums)) < 1e-12
    assert abs(cap["per_seed"][0] - np.mean([a / b for a, b in sums])) < 1e-12
    from pdm_jax.analysis.__main__ import report_spec

    text = report.write_report(seeds, str(tmp_path), spec=report_spec(seeds))  # the command line's RunSpec
    assert f"**{100 * cap['pooled']:.1f}%** pooled" in text and "the paper reports > 99%" in text
    assert "597 analysed out-of-region tokens of 3 seeds (K = 4;" in text  # configs/tiny.py's K
    assert "(K = 4; the full KL" not in report.write_report(seeds, str(tmp_path))  # no spec: "the run's K"


def test_disagreement_by_tail_mass_by_hand(tmp_path):
    """Per μ_T bin, pooled over seeds: tokens, and per criterion the tokens whose keep decision differs from the
    ratio test's and those where it is right; left out when a seed has no tail_mass."""
    rng = np.random.default_rng(3)
    seeds = [_synthetic_seed(s, rng) for s in range(2)]
    assert report.disagreement_by_tail_mass(seeds) is None and "Disagreement by tail mass" not in report.write_report(
        seeds, str(tmp_path))
    # four tokens per seed: mu_T 0.5 (heavy) twice, 0.02 and 0 (light)
    for s in seeds:
        s["records"] = dict(delta_d=np.array([1.0, -1.0, 1.0, -1.0]), keep_ratio=np.array([True, False, True, True]),
                            tail_mass=np.array([0.5, 0.5, 0.02, 0.0]))
        s["records"].update({f"keep_{c}": np.array([False, True, True, True]) for c in tr.CLOSED_FORM_ESTIMATORS})
        s["records"]["keep_uniform_tail"] = np.array([True, True, True, False])
    s["records"]["keep_bucket_exact"] = np.array([True, False, True, True])  # seed 1: agrees with ratio everywhere
    by = report.disagreement_by_tail_mass(seeds)
    assert list(by) == ["bins", "n", "no_tail_mass", "aggregated_tail", "uniform_tail", "bucket_exact"]
    assert by["n"].tolist() == [2, 0, 0, 2, 0, 0, 4]
    # aggregated_tail: token 0 (masked, dD > 0: right) and token 1 (kept, dD < 0: right) differ, in both seeds
    agg = by["aggregated_tail"]
    assert agg["disagree"].tolist() == [0, 0, 0, 0, 0, 0, 4] == agg["right"].tolist()
    # uniform_tail: token 1 (right) and token 3 (masked with dD < 0: wrong) differ
    assert by["uniform_tail"]["disagree"].tolist() == [2, 0, 0, 0, 0, 0, 2]
    assert by["uniform_tail"]["right"].tolist() == [0, 0, 0, 0, 0, 0, 2]
    assert by["bucket_exact"]["disagree"].tolist() == [0, 0, 0, 0, 0, 0, 2]  # seed 0 only
    text = report.write_report(seeds, str(tmp_path))
    assert "| [3e-01, 1e+00) | 4 (50.0%) | 100.0% (100.0%) | 50.0% (100.0%) | 50.0% (100.0%) |" in text
    assert "| [0e+00, 1e-04) | 2 (25.0%) | 0.0% | 100.0% (0.0%) | 0.0% |" in text
    assert "| all | 8 | 50.0% (100.0%) | 50.0% (50.0%) | 25.0% (100.0%) |" in text
    assert by["no_tail_mass"] == 0 and "without a finite" not in text
    seeds[0]["records"]["tail_mass"] = np.array([np.nan, 0.5, 0.02, 0.0])  # in no bin (NaN would digitize last)
    by = report.disagreement_by_tail_mass(seeds)
    assert by["no_tail_mass"] == 1 and by["n"].tolist() == [2, 0, 0, 2, 0, 0, 3]
    assert by["aggregated_tail"]["disagree"].tolist() == [0, 0, 0, 0, 0, 0, 3]
    assert "1 token without a finite μ_T is left out." in report.write_report(seeds, str(tmp_path))
