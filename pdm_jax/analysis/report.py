"""Aggregate per-seed analysis results into a markdown report with matplotlib figures.

Each seed's rates pool its recorded tokens; the report gives the mean over seeds with a 95% Student-t interval
(`alignment.mean_ci95`; seeds with an empty denominator drop out, n shown), and paired differences (criterion −
ratio) per seed, averaged alike. The headline is the precision reading (``unsafe_share`` / ``corrective_share``),
beside the PDM paper's numbers (arXiv 2607.10848, 61 seeds: unsafe-keep 34.2% predictive vs 36.9% ratio, corrective
65.1% vs 62.9%); the keep-rate reading, Youden's J, sign agreement and the ``param_jvp`` row (docs/analysis.md)
follow."""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np

from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis import alignment as al

#: The paper's disagreement set (tokens where the predictive and the ratio criterion decide differently) has
#: about 82 tokens per seed (as quoted in issue 16).
PAPER_DISAGREEMENT_PER_SEED = 82
#: The paper's share of the full KL its top-K KL captures at K = 20 ("> 99%").
PAPER_TOPK_CAPTURE_PCT = 99
#: The paper's rates: the precision reading (`alignment.alignment_rates`), P(ΔD > 0 | kept) and P(ΔD < 0 | kept).
PAPER = dict(seeds=61, unsafe_share=dict(predictive=0.342, ratio=0.369),
             corrective_share=dict(predictive=0.651, ratio=0.629))
METRICS = ("unsafe_share", "corrective_share", "unsafe_keep", "corrective", "youden_j", "sign_agreement",
           "disagreement_frac", "right_on_disagreement")
#: Metrics whose paired difference (criterion − ratio) is reported.
DIFF_METRICS = ("unsafe_share", "corrective_share", "unsafe_keep", "corrective", "youden_j", "sign_agreement")
#: reading -> (unsafe metric, corrective metric, their names in sentences). The precision reading is the paper's.
READINGS = {"precision": ("unsafe_share", "corrective_share", "unsafe-keep", "corrective"),
            "keep_rate": ("unsafe_keep", "corrective", "P(kept | ΔD > 0)", "P(kept | ΔD < 0)")}
LABELS = {"ratio": "ratio (DPPO)", "aggregated_tail": "predictive, aggregated tail",
          "uniform_tail": "predictive, uniform tail", "bucket_exact": "predictive, bucket exact",
          "full": "predictive, full μ (oracle)", "param_jvp": "parameter-space Ḋᵖ along Δθ (first-order oracle)"}


def seed_rates(seeds: Sequence[dict], change_key: str = "delta_d") -> list:
    """Per seed: ``{"seed", "counts", "rates"}`` from its token records (isolated: ``iso_delta_d``)."""
    out = []
    for s in seeds:
        rec = s["records"]
        if change_key != "delta_d" and change_key in rec:
            keep = np.isfinite(rec[change_key])
            rec = {k: np.asarray(v)[keep] for k, v in rec.items()}
        counts = al.alignment_counts(rec, change_key=change_key)
        out.append(dict(seed=s["seed"], counts=counts, rates=al.alignment_rates(counts)))
    return out


def summarize(per_seed: list) -> dict:
    """criterion -> metric -> (mean, ci95, n) over seeds, plus ``diff_vs_ratio`` for unsafe_keep/corrective."""
    crits = []
    for p in per_seed:
        for c in p["rates"]:
            if c not in crits:
                crits.append(c)
    out = {}
    for c in crits:
        out[c] = {m: al.mean_ci95([p["rates"][c][m] for p in per_seed if c in p["rates"]]) for m in METRICS}
        if c != "ratio":
            out[c]["diff_vs_ratio"] = {
                m: al.mean_ci95([p["rates"][c][m] - p["rates"]["ratio"][m] for p in per_seed
                                 if c in p["rates"] and "ratio" in p["rates"]])
                for m in DIFF_METRICS}
    out["_totals"] = dict(
        tokens=int(sum(p["counts"]["n"] for p in per_seed)),
        increase=int(sum(p["counts"]["n_increase"] for p in per_seed)),
        decrease=int(sum(p["counts"]["n_decrease"] for p in per_seed)),
        tie=int(sum(p["counts"]["n_tie"] for p in per_seed)), seeds=len(per_seed))
    return out


def _pct(mc, digits=1) -> str:
    m, ci, n = mc
    if not math.isfinite(m):
        return "–"
    s = f"{100 * m:.{digits}f}%"
    return s + (f" ± {100 * ci:.{digits}f}" if math.isfinite(ci) else "")


def _pts(mc) -> str:
    m, ci, n = mc
    if not math.isfinite(m):
        return "–"
    interval = f" (95% CI {100 * (m - ci):+.1f} to {100 * (m + ci):+.1f})" if math.isfinite(ci) else ""
    return f"{100 * m:+.1f} pts" + interval


def _paper_diff(metric: str) -> Optional[float]:
    """The paper's predictive − ratio difference of `metric` (a fraction), None where the paper gives none."""
    return PAPER[metric]["predictive"] - PAPER[metric]["ratio"] if metric in PAPER else None


def verdict(summary: dict, criterion: str, reading: str = "precision") -> str:
    """One honest sentence comparing `criterion` with the ratio direction against the paper's direction, under `reading`
    ("precision", the paper's, or "keep_rate"; `READINGS`)."""
    d = summary.get(criterion, {}).get("diff_vs_ratio")
    if not d:
        return f"No {criterion} results."
    mu, mc, nu, nc = READINGS[reading]
    du, dc = d[mu], d[mc]

    def judge(mc, want_sign):  # significant only with a finite 95% CI that excludes 0, as `headline` counts
        m, ci, _ = mc
        if not math.isfinite(m):
            return "undetermined"
        side = "same direction as the paper" if m * want_sign > 0 else (
            "opposite direction to the paper" if m * want_sign < 0 else "no difference")
        if not math.isfinite(ci):
            return side if m * want_sign == 0 else f"{side}, significance unknown (one seed: no confidence interval)"
        if abs(m) <= ci:
            return "same direction as the paper but not significant" if m * want_sign > 0 else (
                "opposite direction to the paper but not significant" if m * want_sign < 0 else "no difference")
        return "same direction as the paper (significant)" if m * want_sign > 0 else (
            "opposite direction to the paper (significant)" if m * want_sign < 0 else "no difference")

    def paper(metric):
        p = _paper_diff(metric)
        return "" if p is None else f" (paper {100 * p:+.1f} pts)"

    return (f"{LABELS.get(criterion, criterion)} vs ratio: {nu} {_pts(du)}{paper(mu)} — {judge(du, -1)}; "
            f"{nc} {_pts(dc)}{paper(mc)} — {judge(dc, +1)}.")


def param_direction_sentence(summary: dict, label: str = "real optimizer step") -> Optional[str]:
    """How the parameter-space Ḋᵖ's sign agreement compares with the ratio test and the logit-space estimators.

    Returns None when `summary` has no ``param_jvp`` row.
    """
    if "param_jvp" not in summary:
        return None
    sa = {c: summary[c]["sign_agreement"] for c in al.ALL_CRITERIA if c in summary}
    logit = [c for c in tr.CLOSED_FORM_ESTIMATORS + (al.ORACLE,) if c in sa and math.isfinite(sa[c][0])]
    best = max(logit, key=lambda c: sa[c][0]) if logit else None
    p = sa["param_jvp"][0]
    text = (f"On the {label}, the parameter-space first-order change Ḋᵖ has the sign of the realized ΔD on "
            f"{_pct(sa['param_jvp'])} of the analysed tokens (ratio test {_pct(sa['ratio'])}")
    if best is not None:
        b = sa[best][0]
        text += (f", best logit-space estimator {_SHORT[best]} {_pct(sa[best])}): Ḋᵖ minus that estimator "
                 f"{100 * (p - b):+.1f} pts (mean over seeds). Ḋᵖ's {100 * (1 - p):.1f}% misses are the part of "
                 "the realized change beyond first order in the step")
        if p > b:
            text += (f"; {100 * (p - b):.1f} of the logit-space estimator's {100 * (1 - b):.1f}% misses come from "
                     "predicting along e_k − π in logit space instead of along the update.")
        else:
            text += ("; predicting along the update does not do better than the logit-space estimator here, so its "
                     "misses are not the logit-space approximation's.")
    else:
        text += ")."
    return text


def headline(summary: dict, label: str = "real optimizer step", reading: str = "precision") -> str:
    """One sentence: does the paper's direction (predictive lower unsafe-keep, higher corrective) hold, by how much,
    under `reading` (`READINGS`; the paper's numbers are given beside the precision reading only)."""
    mu, mc, nu, nc = READINGS[reading]
    parts = []
    for metric, name, want in ((mu, nu, -1), (mc, nc, +1)):
        paper = _paper_diff(metric)
        diffs = [summary[c]["diff_vs_ratio"][metric] for c in tr.CLOSED_FORM_ESTIMATORS + (al.ORACLE,)
                 if c in summary and "diff_vs_ratio" in summary[c]]
        ms = [100 * d[0] for d in diffs if math.isfinite(d[0])]
        if not ms:
            continue
        sig = [d for d in diffs if math.isfinite(d[1]) and abs(d[0]) > d[1]]
        agree = all(m * want > 0 for m in ms)
        oppose = all(m * want < 0 for m in ms)
        word = "agrees with" if agree else ("goes against" if oppose else "is mixed relative to")
        vs = "" if paper is None else f" vs the paper's {100 * paper:+.1f} pts"
        parts.append(f"{name} {word} the paper's direction "
                     f"({min(ms):+.1f} to {max(ms):+.1f} pts across estimators{vs}; "
                     f"{len(sig)} of {len(diffs)} significant at 95%)")
    return f"On the {label}, predictive minus ratio: " + "; ".join(parts) + "."


def threshold_free_sentence(summary: dict, label: str = "real optimizer step") -> Optional[str]:
    """Youden's J and sign agreement of each closed-form estimator minus the ratio test's (None without them)."""
    crits = [c for c in tr.CLOSED_FORM_ESTIMATORS + (al.ORACLE,) if "diff_vs_ratio" in summary.get(c, {})]
    if not crits or "ratio" not in summary:
        return None
    cells = ", ".join(f"{_SHORT[c]} {_pts(summary[c]['diff_vs_ratio']['youden_j'])}" for c in crits)
    return (f"Threshold-free, on the {label}: Youden's J = P(kept | ΔD < 0) − P(kept | ΔD > 0) of the ratio test "
            f"is {_pct(summary['ratio']['youden_j'])}; predictive minus ratio: {cells}.")


# ----------------------------------------------------------------------------- figures
def _plt():
    # Heavy (~1 s), and the Agg backend must be selected before pyplot is imported: only when plotting.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy (~1 s); only when a figure is drawn (Agg backend set first)

    return plt


_SHORT = {"ratio": "ratio", "aggregated_tail": "aggregated", "uniform_tail": "uniform", "bucket_exact": "bucket exact",
          "full": "full μ", "param_jvp": "param Ḋᵖ"}
_COLORS = {"ratio": "#999999", "aggregated_tail": "#4c72b0", "uniform_tail": "#55a868", "bucket_exact": "#c44e52",
           "full": "#8172b2", "param_jvp": "#dd8452"}


def figure_paper_vs_ours(summary: dict, iso_summary: Optional[dict], path: str) -> None:
    """Bars: unsafe-keep and corrective rates, paper (ratio vs predictive) beside ours (every criterion), for the real
    optimizer step and the isolated step (mean ± 95% CI over seeds)."""
    plt = _plt()
    crits = [c for c in al.ALL_CRITERIA if c in summary or (iso_summary and c in iso_summary)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, metric, title in zip(axes, ("unsafe_share", "corrective_share"),
                                 ("unsafe-keep  P(D increased | kept)  ↓", "corrective  P(D decreased | kept)  ↑")):
        xs, labels, clusters = [], [], []
        ax.bar([0, 1], [PAPER[metric]["ratio"], PAPER[metric]["predictive"]],
               color=[_COLORS["ratio"], _COLORS["aggregated_tail"]], hatch="//", edgecolor="white")
        xs += [0, 1]
        labels += ["ratio", "predictive"]
        clusters.append((0.5, f"paper\n({PAPER['seeds']} seeds)"))
        x = 2.8
        for src, summ, hatch in (("real step", summary, None), ("isolated step", iso_summary, "..")):
            if not summ:
                continue
            x0 = x
            for c in crits:
                if c not in summ:
                    continue
                m, ci, _ = summ[c][metric]
                ax.bar([x], [m], yerr=[ci if math.isfinite(ci) else 0], color=_COLORS[c], hatch=hatch, capsize=3,
                       edgecolor="white")
                labels.append(_SHORT[c])
                xs.append(x)
                x += 1
            clusters.append(((x0 + x - 1) / 2, f"ours, {src}\n({summ['_totals']['seeds']} seeds)"))
            x += 0.8
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
        for cx, text in clusters:
            ax.text(cx, 1.02, text, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.12)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_title(title, fontsize=10, pad=4)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure_differences(summaries: dict, path: str) -> None:
    """Paired per-seed differences (criterion − ratio) in percentage points with 95% CIs, beside the paper's.

    summaries: label -> `summarize` output (e.g. {"real step": ..., "isolated step": ...}).
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, metric, title in zip(axes, ("unsafe_share", "corrective_share"),
                                 ("Δ unsafe-keep P(ΔD > 0 | kept) vs ratio (pts, lower = better)",
                                  "Δ corrective P(ΔD < 0 | kept) vs ratio (pts, higher = better)")):
        paper = 100 * (PAPER[metric]["predictive"] - PAPER[metric]["ratio"])
        ax.axhline(0, color="k", lw=0.8)
        ax.scatter([0], [paper], marker="*", s=160, color="C3", zorder=3)
        xs, labels = [0], ["paper"]
        x = 1.5
        for label, summ in summaries.items():
            if not summ:
                continue
            for c in al.ALL_CRITERIA[1:]:
                if c not in summ or "diff_vs_ratio" not in summ[c]:
                    continue
                m, ci, _ = summ[c]["diff_vs_ratio"][metric]
                ax.errorbar([x], [100 * m], yerr=[100 * ci if math.isfinite(ci) else 0], fmt="o", capsize=4,
                            color=_COLORS[c])
                xs.append(x)
                labels.append(f"{_SHORT[c]}\n{label}")
                x += 1
            x += 0.5
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=6.5, rotation=45, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure_paired(per_seed: list, path: str, criterion: str = "aggregated_tail") -> None:
    """Per-seed scatter: criterion vs ratio, for unsafe-keep and corrective (points below/above the diagonal)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, metric in zip(axes, ("unsafe_share", "corrective_share")):
        pts = [(p["rates"]["ratio"][metric], p["rates"][criterion][metric]) for p in per_seed
               if criterion in p["rates"] and "ratio" in p["rates"]]
        pts = [(a, b) for a, b in pts if math.isfinite(a) and math.isfinite(b)]
        if pts:
            a, b = zip(*pts)
            ax.scatter(a, b, s=18)
        ax.plot([0, 1], [0, 1], color="k", lw=0.8)
        ax.scatter([PAPER[metric]["ratio"]], [PAPER[metric]["predictive"]], marker="*", s=120, color="C3",
                   label="paper (mean)")
        ax.set_xlabel("ratio criterion")
        ax.set_ylabel(criterion.replace("_", " "))
        ax.set_title({"unsafe_share": "unsafe-keep", "corrective_share": "corrective"}[metric] + " per seed "
                     "(share of the kept updates)", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure_fidelity(fidelity: dict, path: str) -> None:
    """Sign agreement of each estimator with the full-vocabulary Ḋ against the behaviour tail mass μ_T."""
    plt = _plt()
    bins = np.asarray(fidelity["bins"], np.float64)
    n = np.asarray(fidelity["n"], np.float64)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    centers = np.arange(len(n))
    for name, color in (("aggregated_tail", "#4c72b0"), ("uniform_tail", "#55a868"), ("bucket_exact", "#c44e52")):
        agree = np.asarray(fidelity[name], np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(n > 0, agree / n, np.nan)
            se = np.where(n > 0, 1.96 * np.sqrt(np.clip(rate * (1 - rate), 0, None) / np.maximum(n, 1)), np.nan)
        ax.errorbar(centers, rate, yerr=se, marker="o", capsize=3, label=name.replace("_", " "), color=color)
    ax.set_xticks(centers)
    ax.set_xticklabels([f"[{bins[i]:.0e},\n{min(bins[i + 1], 1):.0e})\nn={int(n[i])}" for i in range(len(n))],
                       fontsize=6)
    ax.set_xlabel("behaviour tail mass μ_T (tokens outside TopK ∪ {y_t})")
    ax.set_ylabel("sign agreement with full-vocab Ḋ")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- markdown
def _table(summary: dict, crits: Sequence[str]) -> list:
    lines = ["| criterion | unsafe-keep P(ΔD>0 \\| kept) ↓ | corrective P(ΔD<0 \\| kept) ↑ | P(kept \\| ΔD>0) ↓ "
             "| P(kept \\| ΔD<0) ↑ | Youden's J ↑ | sign agreement ↑ | disagreement set (frac. of tokens) "
             "| right on disagreement | Δ unsafe-keep vs ratio | Δ corrective vs ratio | Δ J vs ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in crits:
        if c not in summary:
            continue
        s = summary[c]
        d = s.get("diff_vs_ratio")
        diffs = " | ".join(_pts(d[m]) if d else "–" for m in ("unsafe_share", "corrective_share", "youden_j"))
        lines.append(f"| {LABELS.get(c, c)} | {_pct(s['unsafe_share'])} | {_pct(s['corrective_share'])} | "
                     f"{_pct(s['unsafe_keep'])} | {_pct(s['corrective'])} | {_pct(s['youden_j'])} | "
                     f"{_pct(s['sign_agreement'])} | {_pct(s['disagreement_frac'])} | "
                     f"{_pct(s['right_on_disagreement'])} | {diffs} |")
    return lines


_DEFINITIONS = ["## Definitions", "",
           "Over tokens outside the trust region (top-K KL D_t > δ) with Â ≠ 0, per seed. The precision reading "
           "(the paper's; a criterion's two rates add up to 100%): unsafe-keep = P(ΔD > 0 | kept), the share of the "
           "updates the criterion keeps that increased the divergence, and corrective = P(ΔD < 0 | kept), the share "
           "that decreased it. The keep-rate reading conditions on the change instead: P(kept | ΔD > 0) and "
           "P(kept | ΔD < 0) (a criterion that merely masks more tokens lowers both). Youden's J = "
           "P(kept | ΔD < 0) − P(kept | ΔD > 0) (threshold-free: 0 = keeping is unrelated to the change), "
           "sign agreement = P(predicted sign of Â·dir = sign ΔD), "
           "disagreement set = tokens where the criterion's keep decision differs from the ratio criterion's, "
           "'right on disagreement' = P(criterion right | disagreement) with right = kept & ΔD < 0 or masked & "
           "ΔD > 0. Keep decisions come from `pdm_jax.rl.trust_region.trust_region_mask` (the training code); "
           "`full` is the same rule with the full-vocabulary Ḋ; `param_jvp` masks a token iff Ḋᵖ = ⟨∇_θ D_t, Δθ⟩ > 0 "
           "(one jax.jvp through the model along the step's actual update Δθ; in the isolated mode along the "
           "isolated step, i.e. the sign of its first-order term) — an oracle of the first-order change, not a "
           "mask training could use as is (it needs the update it judges). "
           "Intervals: Student-t over seeds; a seed whose "
           "denominator is empty drops out of that mean.", ""]


def _setup_section(seeds, settings, iso_summary, t, extra_notes, spec) -> list:
    """The report's "Setup" section: config, tokens seen, δ, behaviour-μ provenance, timing."""
    steps = [st for s in seeds for st in s.get("steps", [])]
    n_valid = sum(st["num_valid"] for st in steps)
    n_out = sum(st["num_outside"] for st in steps)
    n_sel = sum(st["num_selected"] for st in steps)
    errs = [st["behavior_logprob_max_err"] for st in steps if st.get("behavior_logprob_max_err") is not None]
    lags = [st["behavior_version_lag"] for st in steps if st.get("behavior_version_lag") is not None]
    fallbacks = sum(st.get("behavior_version_fallbacks") or 0 for st in steps)
    secs = [s.get("seconds", float("nan")) for s in seeds]
    warm = [s["summary"].get("warmstart_accuracy") for s in seeds]
    final = [s["summary"].get("final_accuracy") for s in seeds]
    md = ["", "## Setup", "",
           f"- Config: `{settings.get('config', '?')}:{settings.get('arg', '')}`"
           + (f" + `{settings['overrides']}`" if settings.get("overrides") else "")
           + (f" (code at commit `{settings['git_commit']}`)" if settings.get("git_commit") else "") + ".",
           _seed_sentence(settings) + _describe_config(spec),
           f"- Trust region δ = {_delta_of(settings, spec)} nats (top-K KL)"
           + (", smaller than the tiny default δ = 0.05: with fp8 rollouts and lr 1e-4 almost no token leaves a "
              "0.05 region within one rollout batch (the tiny default run reports frac_outside ≈ 0 after the first "
              "steps)." if str(settings.get("config", "")).endswith("tiny.py") else "."),
           f"- Tokens: {n_valid} valid completion tokens seen by {len(steps)} optimizer steps; {n_out} outside the "
           f"region ({100 * n_out / max(n_valid, 1):.2f}%), {n_sel} of them with Â ≠ 0 analysed "
           f"({t['increase']} with D increased, {t['decrease']} decreased, {t['tie']} unchanged).",
           "- Realized change: ΔD_t = D_t(θ_after) − D_t(θ_before), recomputed on the same mini-batch with the same "
           "μ (the batch's top-K and log μ(y_t)) after the actual AdamW update of the run. "
           "Training uses ONE mask (above); "
           "a token that mask drops moves only through the other tokens' gradients, so the real-step rates "
           "measure each criterion's decisions against the dynamics of that run. The isolated mode below removes "
           "this coupling.",
           ]
    if iso_summary:
        md.append(f"- Isolated mode: for up to {settings.get('isolated_tokens')} tokens per optimizer step, ΔD_t "
                  f"after a normalized gradient step of length ε = {settings.get('isolated_step')} (parameter L2 "
                  "norm) on that token's loss alone, −Â·sg(min(r, C))·log π(y_t).")
    jvp_errs = [st["param_jvp_d_max_err"] for st in steps if st.get("param_jvp_d_max_err") is not None]
    if jvp_errs:
        md.append("- Parameter-space Ḋᵖ_t = ⟨∇_θ D_t, Δθ⟩ with Δθ = θ_after − θ_before of each optimizer step, one "
                  "forward-mode pass (jax.jvp) through the model per step; the jvp's own D matches the analysis's "
                  f"D_before to {max(jvp_errs):.1e} nats (max over tokens).")
    if errs:
        md.append(f"- Full μ recomputed from the sampler's quantized weights of the version that sampled each row (the "
                  f"batch's `weights_version`; lag 0: {sum(1 for x in lags if x == 0)}, lag 1: "
                  f"{sum(1 for x in lags if x == 1)} steps; {fallbacks} rows matched by log μ because their "
                  f"version was not kept); max |Δ log μ(y_t)| vs the sampler's = {max(errs):.1e}.")
    md.append(f"- Warm-start accuracy {_fmt_mean(warm)}, final {_fmt_mean(final)} (avg@k on the few held-out "
              f"prompts of the short runs); wall time per seed {np.nanmean(secs):.0f} s "
              f"(total {np.nansum(secs):.0f} s).")
    by_commit = {}
    for s in seeds:
        by_commit.setdefault(s.get("settings", {}).get("git_commit") or "?", []).append(s["seed"])
    if len(by_commit) > 1:
        md.append("- The seeds ran at different code versions (same settings otherwise): "
                  + "; ".join(f"`{c}`: seeds {_seed_ranges(v)}" for c, v in by_commit.items())
                  + ". Runs of one seed at two versions need not be bit-identical; the pooled rates treat them "
                  "as draws of one setting.")
    md += [""] + [f"- {n}" for n in extra_notes]
    return md


def _seed_ranges(seeds: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0–2, 5, 7–8"."""
    out, xs = [], sorted(seeds)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(f"{xs[i]}–{xs[j]}" if j > i else f"{xs[i]}")
        i = j + 1
    return ", ".join(out)


def _seed_sentence(settings: dict) -> str:
    """How the seeds differ: independent runs, or one shared warm start (`run.run_seeds(warmstart=...)`)."""
    w = settings.get("warmstart")
    if not w:
        return "- Each seed is an independent run (own model init, warm start, rollouts): "
    acc = (f" (avg@4 {w['warmstart_accuracy']}, greedy {w.get('warmstart_greedy_accuracy')})"
           if "warmstart_accuracy" in w else "")
    made = (f", made by `{' '.join(w['command'][2:])}` at code `{w.get('code_version', '?')}`"
            if w.get("command") else "")
    return ("- All seeds resume from ONE shared warm start" + acc + made + "; the seed varies only the RL phase "
            "(rollouts, mini-batch order): ")


def _paper_section(summary, crits) -> list:
    """"Paper vs ours" and the real-step tables and figures."""
    t = summary["_totals"]
    md = ["", "## Paper vs ours", "",
           "The precision reading, P(ΔD > 0 | kept) and P(ΔD < 0 | kept), in which the paper reports its rates:", "",
           "| | unsafe-keep ↓ (ratio → predictive) | corrective ↑ (ratio → predictive) | seeds |",
           "|---|---|---|---|",
           f"| paper (PDM, arXiv 2607.10848) | {100 * PAPER['unsafe_share']['ratio']:.1f}% → "
           f"{100 * PAPER['unsafe_share']['predictive']:.1f}% | {100 * PAPER['corrective_share']['ratio']:.1f}% → "
           f"{100 * PAPER['corrective_share']['predictive']:.1f}% | {PAPER['seeds']} |"]
    for c in crits:
        if c == "ratio":
            continue
        md.append(f"| ours, {LABELS[c]} | {_pct(summary['ratio']['unsafe_share'])} → "
                  f"{_pct(summary[c]['unsafe_share'])} | {_pct(summary['ratio']['corrective_share'])} → "
                  f"{_pct(summary[c]['corrective_share'])} | {t['seeds']} |")
    md += ["", "![paper vs ours](paper_vs_ours.png)", "",
           "Paired differences (criterion − ratio, per seed, then mean ± 95% CI over seeds; the star is the paper):",
           "", "![differences](differences.png)", "",
           "## Real optimizer step (mean ± 95% CI over seeds)", ""] + _table(summary, crits)
    md += ["", "Per-seed pairs (each point one seed; below the diagonal = predictive keeps fewer unsafe tokens, "
           "above = more corrective ones):", "",
           "![per seed, aggregated tail](per_seed_aggregated_tail.png)",
           "![per seed, bucket exact](per_seed_bucket_exact.png)", ""]
    return md


def _isolated_section(seeds, iso_summary, crits) -> list:
    """The isolated-step section (empty without isolated records)."""
    md = []
    if iso_summary:
        it = iso_summary["_totals"]
        fin = np.concatenate([np.asarray(s["records"].get("iso_delta_d", []), np.float64) for s in seeds])
        fo = np.concatenate([np.asarray(s["records"].get("iso_first_order", []), np.float64) for s in seeds])
        ok = np.isfinite(fin) & np.isfinite(fo)
        same = float(np.mean(np.sign(fin[ok]) == np.sign(fo[ok]))) if ok.any() else float("nan")
        md += ["## Isolated step (mean ± 95% CI over seeds)", "",
               f"{it['tokens']} tokens ({it['increase']} increased, {it['decrease']} decreased, {it['tie']} "
               f"unchanged). The finite step's ΔD has the sign of its first-order term (jax.jvp along the same "
               f"step) on {100 * same:.1f}% of them; where they differ the first-order term is small and the "
               "second-order term wins at this ε. Finite step:", ""] + _table(iso_summary, crits)
        fo_summary = summarize(seed_rates(seeds, change_key="iso_first_order"))
        md += ["", "First-order change (ε → 0, the sign of −∇D_t·∇ℓ_t):", ""] + _table(fo_summary, crits)
        md += ["", "Verdicts on the isolated step:", ""]
        for c in ("aggregated_tail", "bucket_exact"):
            if c in iso_summary:
                md.append(f"- {verdict(iso_summary, c)}")
        md.append("")
    return md


def _pm(m: float, ci: float, digits: int) -> str:
    """``m ± ci`` (just ``m`` when the interval is undefined, e.g. one seed)."""
    return f"{m:.{digits}f}" + (f" ± {ci:.{digits}f}" if math.isfinite(ci) else "")


def _disagreement_section(per_seed: list, iso_per_seed: Optional[list], crits: Sequence[str]) -> list:
    """Disagreement-set size in tokens per seed (mean ± 95% CI, median, range) beside the paper's ≈ 82."""
    md = ["## Disagreement set per seed", "",
          "Tokens per seed on which the criterion's keep decision differs from the ratio test's (out-of-region "
          f"tokens with Â ≠ 0), beside the paper's ≈ {PAPER_DISAGREEMENT_PER_SEED} per seed; 'analysed' = all such "
          "tokens of a seed:", "",
          "| step | criterion | tokens per seed (mean ± 95% CI) | median | min–max | analysed per seed | paper |",
          "|---|---|---|---|---|---|---|"]
    for label, ps in (("real", per_seed), ("isolated", iso_per_seed)):
        if not ps:
            continue
        n_all = [p["counts"]["n"] for p in ps]
        m_all, ci_all, _ = al.mean_ci95(n_all)
        for c in crits:
            if c == "ratio":
                continue
            xs = [p["rates"][c]["disagreement_n"] for p in ps if c in p["rates"]]
            if not xs:
                continue
            m, ci, _ = al.mean_ci95(xs)
            md.append(f"| {label} | {LABELS.get(c, c)} | {_pm(m, ci, 1)} | {np.median(xs):.0f} | "
                      f"{min(xs):.0f}–{max(xs):.0f} | {_pm(m_all, ci_all, 0)} | ≈ {PAPER_DISAGREEMENT_PER_SEED} |")
    be = [(p["seed"], p["rates"]["bucket_exact"]["disagreement_n"]) for p in per_seed if "bucket_exact" in p["rates"]]
    if be:
        md += ["", "Per seed (real step, bucket exact; seed: tokens): "
               + ", ".join(f"{sd}: {n:.0f}" for sd, n in be) + "."]
    return md + [""]


def _fidelity_section(fidelity) -> list:
    """Sign agreement of each closed-form Ḋ with the full-vocabulary one, binned by tail mass (empty without full μ)."""
    md = []
    if fidelity is not None:
        n = np.asarray(fidelity["n"])
        md += ["## Estimator fidelity", "",
               "Sign agreement of each closed-form Ḋ with the full-vocabulary Ḋ (full μ recomputed from the sampler's "
               "quantized weights; the estimators see the top-K view of that same μ), over every valid token, "
               "binned by the "
               "behaviour tail mass μ_T:", "",
               "| μ_T bin | tokens | aggregated tail | uniform tail | bucket exact |", "|---|---|---|---|---|"]
        bins = fidelity["bins"]
        for i in range(len(n)):
            if n[i] == 0:
                continue
            cells = [f"{100 * np.asarray(fidelity[e])[i] / n[i]:.1f}%" for e in tr.CLOSED_FORM_ESTIMATORS]
            md.append(f"| [{bins[i]:.0e}, {min(bins[i + 1], 1.0):.0e}) | {int(n[i])} | " + " | ".join(cells) + " |")
        tot = n.sum()
        md.append("| all | " + str(int(tot)) + " | " + " | ".join(
            f"{100 * np.asarray(fidelity[e]).sum() / max(tot, 1):.1f}%" for e in tr.CLOSED_FORM_ESTIMATORS) + " |")
        md += ["", "![estimator fidelity](estimator_fidelity.png)", ""]
    return md


def disagreement_by_tail_mass(seeds: Sequence[dict], bins: Sequence[float] = al.TAIL_MASS_BINS) -> Optional[dict]:
    """Where each direction criterion parts from the ratio test, by the behaviour tail mass μ_T of the token.

    Pooled over the seeds' analysed tokens (real optimizer step), μ_T binned by `bins` (`alignment.TAIL_MASS_BINS`):
    per bin the token count and, per criterion of `alignment.criteria_in` other than the ratio test, the tokens whose
    decision differs from the ratio test's (``disagree``) and those where it is right (``right``).

    Returns None when a seed lacks ``tail_mass`` or ``delta_d``, else ``{"bins": [edges], "n": [nbins] int,
    "no_tail_mass": int, criterion: {"disagree": [nbins] int, "right": [nbins] int}}`` (a non-finite μ_T counts only
    in ``no_tail_mass``)."""
    recs = [s.get("records", {}) for s in seeds]
    if not recs or any("tail_mass" not in r or "delta_d" not in r or "keep_ratio" not in r for r in recs):
        return None
    crits = [c for c in al.criteria_in(recs[0]) if c != "ratio" and all(c in al.criteria_in(r) for r in recs)]
    nb = len(bins) - 1
    out = {"bins": list(bins), "n": np.zeros(nb, np.int64), "no_tail_mass": 0,
           **{c: {"disagree": np.zeros(nb, np.int64), "right": np.zeros(nb, np.int64)} for c in crits}}
    for r in recs:
        mass = np.asarray(r["tail_mass"], np.float64)
        ok = np.isfinite(mass)
        out["no_tail_mass"] += int((~ok).sum())
        idx = np.where(ok, np.clip(np.digitize(mass, bins) - 1, 0, nb - 1), -1)
        for b in range(nb):  # the alignment counts of the bin's tokens (`alignment.alignment_counts`)
            counts = al.alignment_counts({k: np.asarray(v)[idx == b] for k, v in r.items() if np.ndim(v) == 1})
            out["n"][b] += counts["n"]
            for c in crits:
                out[c]["disagree"][b] += counts[c]["disagree_with_ratio"]
                out[c]["right"][b] += counts[c]["right_on_disagreement"]
    return out


def _tail_mass_section(seeds: Sequence[dict]) -> list:
    """`disagreement_by_tail_mass` as a table (empty without ``tail_mass`` in every seed's records)."""
    by = disagreement_by_tail_mass(seeds)
    if by is None or by["n"].sum() == 0:
        return []
    crits = [c for c in by if c not in ("bins", "n", "no_tail_mass")]
    n, bins = by["n"], by["bins"]
    md = ["## Disagreement by tail mass", "",
          "Of the analysed out-of-region tokens (real step, pooled over seeds), per behaviour tail mass μ_T bin: the "
          "bin's share of the tokens, and for each criterion the share of the bin's tokens on which its keep decision "
          "differs from the ratio test's (in brackets: of those, the share where the criterion is the one that is "
          "right):", "",
          "| μ_T bin | tokens | " + " | ".join(LABELS.get(c, c) for c in crits) + " |",
          "|---|---|" + "---|" * len(crits)]

    def cell(c, sl):
        d, r = by[c]["disagree"][sl].sum(), by[c]["right"][sl].sum()
        return f"{100 * d / max(n[sl].sum(), 1):.1f}% ({100 * r / d:.1f}%)" if d else "0.0%"

    for i in range(len(n)):
        if n[i]:
            md.append(f"| [{bins[i]:.0e}, {min(bins[i + 1], 1.0):.0e}) | {int(n[i])} ({100 * n[i] / n.sum():.1f}%) | "
                      + " | ".join(cell(c, slice(i, i + 1)) for c in crits) + " |")
    md.append(f"| all | {int(n.sum())} | " + " | ".join(cell(c, slice(None)) for c in crits) + " |")
    if by["no_tail_mass"]:
        k = by["no_tail_mass"]
        md += ["", f"{k} token{'s' if k != 1 else ''} without a finite μ_T {'are' if k != 1 else 'is'} left out."]
    return md + [""]


def topk_capture(seeds: Sequence[dict]) -> Optional[dict]:
    """Σ top-K KL / Σ full KL (both KL(μ ‖ π) in nats before the step) over the analysed tokens of the seeds that
    recorded the full KL: the share of the divergence the top-K view sees (at most 1 by data processing; the paper: >
    99%).

    Returns None when no seed has both fields, else ``pooled``, ``per_seed`` (`alignment.mean_ci95`), ``n`` (tokens)
    and ``seeds``."""
    ratios, tot_topk, tot_full, n = [], 0.0, 0.0, 0
    for s in seeds:
        r = s.get("records", {})
        if "full_kl_before" not in r or "d_before" not in r:
            continue
        d = np.asarray(r["d_before"], np.float64)
        f = np.asarray(r["full_kl_before"], np.float64)
        ok = np.isfinite(d) & np.isfinite(f)
        if not ok.any() or f[ok].sum() <= 0:
            continue
        ratios.append(d[ok].sum() / f[ok].sum())
        tot_topk, tot_full, n = tot_topk + d[ok].sum(), tot_full + f[ok].sum(), n + int(ok.sum())
    if not ratios:
        return None
    return dict(pooled=tot_topk / tot_full, per_seed=al.mean_ci95(ratios), n=n, seeds=len(ratios))


def _capture_section(seeds: Sequence[dict], spec=None) -> list:
    """The top-K KL capture beside the paper's > 99% (empty without full μ)."""
    cap = topk_capture(seeds)
    if cap is None:
        return []
    m, ci, _ = cap["per_seed"]
    k = "the run's K" if spec is None else f"K = {spec.rl.top_k_logprobs}"
    return ["## Top-K KL capture", "",
            f"Σ top-K KL / Σ full KL over the {cap['n']} analysed out-of-region tokens of {cap['seeds']} seeds ({k}; "
            "the full KL from μ recomputed over the whole vocabulary): "
            f"**{100 * cap['pooled']:.1f}%** pooled, {_pm(100 * m, 100 * ci, 1)}% per seed; the paper reports "
            f"> {PAPER_TOPK_CAPTURE_PCT}%. The top-K KL compares the two distributions coarsened to the K ids of μ's "
            "view and one tail bucket, so it never exceeds the full KL.", ""]


def readings(seeds: list) -> list:
    """The verdict in both readings and the threshold-free measure, one line each (what ``report`` prints)."""
    per_seed = seed_rates(seeds)
    summary = summarize(per_seed)
    iso_per_seed = seed_rates(seeds, change_key="iso_delta_d")
    lines = [f"precision reading (the paper's), P(ΔD > 0 | kept) / P(ΔD < 0 | kept): {headline(summary)}"]
    if any(p["counts"]["n"] for p in iso_per_seed):
        lines.append(f"precision reading, isolated step: {headline(summarize(iso_per_seed), 'isolated step')}")
    lines.append("keep-rate reading, P(kept | ΔD > 0) / P(kept | ΔD < 0): "
                 + headline(summary, reading="keep_rate"))
    tf = threshold_free_sentence(summary)
    return lines + ([tf] if tf else [])


def write_report(seeds: list, out_dir: str, *, spec=None, title: str = "Token-level analysis of the direction criteria",
                 extra_notes: Sequence[str] = ()) -> str:
    """Writes ``<out_dir>/README.md`` and figures from loaded seeds (`run.load_seeds`); returns the markdown.
    ``spec``: the `RunSpec` the seeds ran with (the command line's `report_spec`; None: not readable here)."""
    os.makedirs(out_dir, exist_ok=True)
    per_seed = seed_rates(seeds)
    summary = summarize(per_seed)
    iso_per_seed = seed_rates(seeds, change_key="iso_delta_d")
    iso_summary = summarize(iso_per_seed) if any(p["counts"]["n"] for p in iso_per_seed) else None
    fidelity = None
    for s in seeds:
        if s.get("fidelity"):
            fidelity = al.add_fidelity_counts(fidelity, {k: (v if k == "bins" else np.asarray(v))
                                                         for k, v in s["fidelity"].items()})
    figure_paper_vs_ours(summary, iso_summary, os.path.join(out_dir, "paper_vs_ours.png"))
    figure_differences({"real step": summary, "isolated": iso_summary}, os.path.join(out_dir, "differences.png"))
    figure_paired(per_seed, os.path.join(out_dir, "per_seed_aggregated_tail.png"), "aggregated_tail")
    figure_paired(per_seed, os.path.join(out_dir, "per_seed_bucket_exact.png"), "bucket_exact")
    if fidelity is not None:
        figure_fidelity(fidelity, os.path.join(out_dir, "estimator_fidelity.png"))

    settings = seeds[0].get("settings", {}) if seeds else {}
    crits = [c for c in al.ALL_CRITERIA if c in summary]
    md = [f"# {title}", "",
          f"Generated by `python -m pdm_jax.analysis` from {len(seeds)} seeds "
          f"(seeds {_seed_ranges([s['seed'] for s in seeds])}).", "",
          "## Verdict", "",
          "In the paper's reading (of the out-of-region updates a criterion keeps, the share that increased / "
          "decreased the divergence, P(ΔD > 0 | kept) / P(ΔD < 0 | kept)):", "", f"**{headline(summary)}**", ""]
    if iso_summary:
        md += [f"**{headline(iso_summary, 'isolated step')}**", ""]
    md += ["In the keep-rate reading (of the updates that increased / decreased the divergence, the share the "
           "criterion keeps, P(kept | ΔD > 0) / P(kept | ΔD < 0)): " + headline(summary, reading="keep_rate"), ""]
    for label, summ in (("real optimizer step", summary), ("isolated step", iso_summary)):
        line = threshold_free_sentence(summ, label) if summ else None
        if line:
            md += [line, ""]
    for label, summ in (("real optimizer step", summary), ("isolated step", iso_summary)):
        line = param_direction_sentence(summ, label) if summ else None
        if line:
            md += [line, ""]
    def kept_frac(c):
        return al.mean_ci95([(p["counts"][c]["kept_increase"] + p["counts"][c]["kept_decrease"])
                             / max(p["counts"]["n_increase"] + p["counts"]["n_decrease"], 1)
                             for p in per_seed if c in p["counts"] and p["counts"]["n"] > 0])

    if "bucket_exact" in summary:
        md += [f"Kept fraction of the analysed out-of-region tokens (real step): ratio {_pct(kept_frac('ratio'))}, "
               + ", ".join(f"{_SHORT[c]} {_pct(kept_frac(c))}" for c in al.ALL_CRITERIA[1:] if c in summary)
               + f". On the disagreement set ({_pct(summary['bucket_exact']['disagreement_frac'])} of the tokens for "
               f"bucket exact) the predictive decision is the right one "
               f"{_pct(summary['bucket_exact']['right_on_disagreement'])} "
               "of the time (50% = no better than the ratio test).", ""]
    md += ["Per criterion (real optimizer step):", ""]
    for c in ("aggregated_tail", "bucket_exact", "uniform_tail", "full", "param_jvp"):
        if c in summary:
            md.append(f"- {verdict(summary, c)}")
    md += _setup_section(seeds, settings, iso_summary, summary["_totals"], extra_notes, spec)
    md += _paper_section(summary, crits)
    md += _isolated_section(seeds, iso_summary, [c for c in al.ALL_CRITERIA if iso_summary and c in iso_summary])
    md += _disagreement_section(per_seed, iso_per_seed if iso_summary else None, crits)
    md += _fidelity_section(fidelity)
    md += _tail_mass_section(seeds)
    md += _capture_section(seeds, spec)
    md += _DEFINITIONS
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(text)
    return text


def _field_of(settings: dict, key: str, default: str = "?") -> str:
    """The last ``key=`` item of the run's argument strings (later items override earlier ones)."""
    val = default
    for item in (settings.get("arg", "") + "," + settings.get("overrides", "")).split(","):
        if item.strip().startswith(key + "="):
            val = item.split("=", 1)[1]
    return val


def _describe_config(spec) -> str:
    """A sentence with the run settings that matter here, from the `RunSpec` the seeds ran with (None: unreadable)."""
    if spec is None:
        return "(config not readable here)."
    m, rl, tr_ = spec.model, spec.rl, spec.trust_region
    model = (f"Qwen3 from `{m.hf_path}`" if m.hf_path else
             f"Qwen3 d {m.hidden_size}, {m.num_hidden_layers} layers (random init)")
    ups = rl.num_minibatches * rl.num_iterations
    tau_s = spec.rollout.temperature
    return (f"{model}; data `{spec.data.kind}`/`{spec.data.task}`; {spec.sft.steps} SFT steps × "
            f"{spec.sft.batch_size}; {rl.steps} GRPO steps of {rl.prompts_per_step} prompts × {rl.group_size} "
            f"samples, lr {rl.learning_rate:g}; {spec.sampler.quantization} sampler ({spec.sampler.mode}); "
            f"{rl.num_minibatches} mini-batches × {rl.num_iterations} iterations per rollout batch ({ups} optimizer "
            f"steps, {ups - 1} of them off-policy); staleness {rl.max_staleness}; K = {rl.top_k_logprobs}"
            + (f"; a `{spec.tokenizer.kind}` tokenizer of up to {spec.tokenizer.vocab_size} tokens"
               if spec.tokenizer.kind == "bpe" else "")
            + (f"; rollouts at temperature τ_s = {tau_s:g} (the loss's π at {rl.temperature:g})"
               if tau_s != rl.temperature else "")
            + f"; trained with mask `{tr_.mask}`" + (f" (estimator `{tr_.estimator}`)" if tr_.mask == "pdm" else "")
            + ".")


def _delta_of(settings: dict, spec=None) -> str:
    """δ of the run: the last ``delta=`` of its argument strings, else the `RunSpec`'s."""
    val = _field_of(settings, "delta")
    if val == "?" and spec is not None:
        val = f"{float(spec.trust_region.delta):g}"
    return val


def _fmt_mean(xs) -> str:
    m, ci, n = al.mean_ci95([x for x in xs if x is not None])
    if not math.isfinite(m):
        return "–"
    return f"{m:.3f}" + (f" ± {ci:.3f}" if math.isfinite(ci) else "")
