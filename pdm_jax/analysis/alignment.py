"""Token-level alignment of mask decisions with the *realized* change of the divergence (docs/analysis.md).

For every token outside the trust region (PDM paper, arXiv 2607.10848, token-level analysis): did the mask keep it,
and did the optimizer update push its divergence D_t (`pdm_jax.rl.trust_region.topk_kl`, with the *same* μ before and
after) further out or back in? Pure per-token bookkeeping: `pdm_jax.analysis.callback` feeds it logits before and
after each real step, `pdm_jax.analysis.report` aggregates seeds. Criteria are those of
`pdm_jax.rl.trust_region.DIRECTION_CRITERIA` (``ratio``, ``aggregated_tail``, ``uniform_tail``, ``bucket_exact``),
whose keep decisions come from `trust_region_mask` itself, plus ``full`` (Ḋ of the full-vocabulary KL with the full
μ: an oracle) and ``param_jvp`` (Ḋᵖ = ⟨∇_θ D_t, Δθ⟩ along the actual update, `pdm_jax.analysis.param_direction`;
masked iff outside and Ḋᵖ > 0).

Over out-of-region tokens with Â ≠ 0 (a realized change of exactly 0 counts in neither conditional): unsafe-keep
P(kept | ΔD > 0), corrective P(kept | ΔD < 0), sign agreement P(sign(Â·dir) = sign(ΔD)), and the disagreement set
with the ratio criterion, where "right" = kept and ΔD < 0, or masked and ΔD > 0."""

from __future__ import annotations

import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdm_jax.rl import trust_region as tr
from pdm_jax.analysis.param_direction import PARAM_CRITERION
from pdm_jax.rl.step_batch import StepBatch

#: The oracle criterion (needs the full behaviour distribution; no library mask).
ORACLE = "full"

#: Every criterion the analysis can record, in report order (the library's, the oracle, Ḋᵖ).
ALL_CRITERIA = tr.DIRECTION_CRITERIA + (ORACLE, PARAM_CRITERION)

#: Per-token record fields (host numpy, one entry per selected token).
RECORD_FIELDS = (("d_before", "d_after", "advantage", "tail_mass", "log_ratio")
                 + tuple(f"keep_{c}" for c in tr.DIRECTION_CRITERIA)
                 + tuple(f"dir_{e}" for e in tr.CLOSED_FORM_ESTIMATORS))


@functools.partial(jax.jit, static_argnames=("delta", "delta_low", "delta_high"))
def token_analysis(logits_before, logits_after, batch: StepBatch, *, delta: float,
                   delta_low: Optional[float] = None, delta_high: Optional[float] = None,
                   behavior_logits=None) -> dict:
    """Per-token divergences, predictions, keep decisions and realized change, all ``[B,T]``.

    Args:
      logits_before: ``[B,T,V]`` temperature-scaled trainer logits before the optimizer step (f32 or bf16).
      logits_after: ``[B,T,V]`` the same positions after the step (or an isolated step), same μ.
      batch: the train-step `StepBatch`: ``completion_ids`` [B,T], ``completion_mask`` [B,T] bool,
        ``behavior_logprobs`` [B,T], ``topk_ids``/``topk_logprobs`` [B,T,K], ``advantages`` [B] or [B,T] f32.
      delta, delta_low, delta_high: the trust-region radius (nats), as in `TrustRegionConfig` (static).
      behavior_logits: optional ``[B,T,V]`` temperature-scaled behaviour logits z_q/τ (full μ); adds the ``full``
        fields.

    Returns:
      dict of ``[B,T]`` arrays: ``valid`` (bool), ``outside`` (D > δ_Â), ``advantage`` f32, ``d_before``/``d_after``/
      ``delta_d`` (nats, f32), ``log_ratio`` f32, ``tail_mass`` (μ_T, f32), ``dir_<estimator>`` f32 (Ḋ),
      ``keep_<criterion>`` bool for every name in `DIRECTION_CRITERIA` (True inside the region), and with
      ``behavior_logits``: ``dir_full``, ``keep_full``, ``full_kl_before``."""
    tokens = batch.completion_ids
    valid = batch.completion_mask.astype(bool)
    topk_ids, topk_lp = batch.topk_ids, batch.topk_logprobs
    behavior = batch.behavior_logprobs
    adv = jnp.asarray(batch.advantages, jnp.float32)
    if adv.ndim == 1:
        adv = jnp.broadcast_to(adv[:, None], tokens.shape)
    zb = jnp.asarray(logits_before, jnp.float32)
    za = jnp.asarray(logits_after, jnp.float32)
    d_before = tr.topk_kl(zb, tokens, topk_ids, topk_lp, behavior)
    d_after = tr.topk_kl(za, tokens, topk_ids, topk_lp, behavior)
    radius = tr.trust_region_radius(adv, delta, delta_low, delta_high)
    outside = valid & (d_before > radius)
    logp = jax.nn.log_softmax(zb, axis=-1)
    tq = tr.token_quantities(logp, tokens, topk_ids, topk_lp, behavior, with_tail_squares=False)
    out = dict(valid=valid, outside=outside, advantage=adv, d_before=d_before, d_after=d_after,
               delta_d=d_after - d_before, log_ratio=tq.logp_k - jnp.asarray(behavior, jnp.float32),
               tail_mass=tq.mu_t)
    for name in tr.DIRECTION_CRITERIA:
        # direction_stats only adds a statistic (pdm computes its direction regardless): same keep decisions.
        cfg = tr.TrustRegionConfig(divergence="topk_kl", delta=delta, delta_low=delta_low, delta_high=delta_high,
                                   direction_stats=False, **tr.criterion_settings(name))
        if name != "ratio":
            out[f"dir_{name}"] = tr.kl_directional_derivative(zb, tokens, topk_ids, topk_lp, behavior,
                                                              estimator=name)
        mask, _ = tr.trust_region_mask(zb, tokens, topk_ids, topk_lp, behavior, adv, valid, cfg)
        out[f"keep_{name}"] = mask | ~valid
    if behavior_logits is not None:
        zq = jnp.asarray(behavior_logits, jnp.float32)
        dir_full = tr.full_kl_directional_derivative(zb, zq, tokens)
        out["dir_full"] = dir_full
        out["keep_full"] = ~(outside & (adv * dir_full > 0))
        out["full_kl_before"] = tr.full_kl(zb, zq)
    return out


def select_tokens(analysis: Mapping[str, jax.Array], *, require_outside: bool = True) -> dict:
    """Host numpy arrays ``[N]`` of the tokens to record (valid, Â ≠ 0 and by default outside the region): every
    ``[B,T]`` field of `token_analysis` flattened, plus ``row``/``col`` (int32 positions in the batch)."""
    a = jax.device_get(dict(analysis))
    sel = np.asarray(a["valid"]) & (np.asarray(a["advantage"]) != 0)
    if require_outside:
        sel &= np.asarray(a["outside"])
    rows, cols = np.nonzero(sel)
    out = {k: np.asarray(v)[rows, cols] for k, v in a.items()}
    out["row"] = rows.astype(np.int32)
    out["col"] = cols.astype(np.int32)
    return out


def concat_records(parts: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """Concatenates per-step token records (dicts of ``[N_i]`` arrays) along the token axis; keys present in only some
    parts (e.g. ``full``) are dropped."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    keys = set(parts[0])
    for p in parts[1:]:
        keys &= set(p)
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in sorted(keys)}


def param_keep(d_dot, outside):
    """Keep decision of ``param_jvp``: masked iff ``outside`` (``[...]`` bool) and ``d_dot`` (``[...]`` f32 Ḋᵖ, or the
    isolated step's ``iso_first_order``) > 0; a NaN keeps. Returns ``[...]`` bool (numpy or jax, as the inputs)."""
    return ~(outside & (d_dot > 0))


def _keep_of(records: Mapping[str, np.ndarray], criterion: str, change_key: str):
    """``[N]`` bool keep decision of `criterion` against `change_key`, or None when not available (``param_jvp`` uses
    the first-order term of the step whose change is judged, and has none for ``iso_first_order`` itself)."""
    if criterion == PARAM_CRITERION and change_key.startswith("iso_"):
        if change_key != "iso_delta_d" or "iso_first_order" not in records:
            return None
        fo = np.asarray(records["iso_first_order"], np.float64)
        return np.asarray(param_keep(fo, np.ones(fo.shape, bool)), bool)  # records are outside tokens
    key = f"keep_{criterion}"
    return np.asarray(records[key], bool) if key in records else None


def criteria_in(records: Mapping[str, np.ndarray], change_key: str = "delta_d") -> list:
    """The criteria with a keep decision in `records` against `change_key` (`ALL_CRITERIA` order:
    `pdm_jax.rl.trust_region.DIRECTION_CRITERIA`, then ``full`` and ``param_jvp`` when present)."""
    return [c for c in ALL_CRITERIA if _keep_of(records, c, change_key) is not None]


def alignment_counts(records: Mapping[str, np.ndarray], *, change_key: str = "delta_d") -> dict:
    """Counts behind the alignment rates, per criterion, pooled over the records' tokens.

    Args:
      records: dict of ``[N]`` arrays from `select_tokens`: ``keep_<criterion>`` bool and `change_key` (ΔD, f32).
      change_key: ``delta_d`` (the real step) or ``iso_delta_d`` (the isolated step).

    Returns:
      ``{"n": N, "n_increase", "n_decrease", "n_tie", criterion: {"kept_increase", "kept_decrease", "agree",
      "disagree_with_ratio", "right_on_disagreement"}}`` (ints); ``agree`` counts tokens with ΔD ≠ 0 whose predicted
      sign (= not kept) matches the sign of ΔD."""
    if not records or change_key not in records:
        return {"n": 0, "n_increase": 0, "n_decrease": 0, "n_tie": 0}
    dd = np.asarray(records[change_key], np.float64)
    finite = np.isfinite(dd)
    inc, dec = finite & (dd > 0), finite & (dd < 0)
    out = {"n": int(dd.size), "n_increase": int(inc.sum()), "n_decrease": int(dec.sum()),
           "n_tie": int((finite & (dd == 0)).sum())}
    keep_ratio = np.asarray(records["keep_ratio"], bool)
    for c in criteria_in(records, change_key):
        keep = _keep_of(records, c, change_key)
        disagree = keep != keep_ratio
        right = (keep & dec) | (~keep & inc)
        out[c] = {"kept_increase": int((keep & inc).sum()), "kept_decrease": int((keep & dec).sum()),
                  "agree": int(((~keep) & inc).sum() + (keep & dec).sum()),
                  "disagree_with_ratio": int(disagree.sum()),
                  "right_on_disagreement": int((disagree & right).sum())}
    return out


def _ratio(num: int, den: int) -> float:
    return float(num) / float(den) if den > 0 else float("nan")


def alignment_rates(counts: Mapping) -> dict:
    """Rates from `alignment_counts`, per criterion; NaN where a denominator is 0.

    The precision reading (the paper's): ``unsafe_share`` = P(ΔD > 0 | kept), ``corrective_share`` = P(ΔD < 0 |
    kept); the keep-rate reading: ``unsafe_keep`` = P(kept | ΔD > 0), ``corrective`` = P(kept | ΔD < 0).
    Threshold-free: ``youden_j`` = P(kept | ΔD < 0) − P(kept | ΔD > 0) and ``sign_agreement``. Also
    ``disagreement_frac`` (of the N tokens), ``disagreement_n``, ``right_on_disagreement``."""
    out = {}
    n, ninc, ndec = counts.get("n", 0), counts.get("n_increase", 0), counts.get("n_decrease", 0)
    for c in ALL_CRITERIA:
        if c not in counts:
            continue
        k = counts[c]
        kept = k["kept_increase"] + k["kept_decrease"]
        unsafe, corrective = _ratio(k["kept_increase"], ninc), _ratio(k["kept_decrease"], ndec)
        out[c] = dict(unsafe_keep=unsafe, corrective=corrective,
                      unsafe_share=_ratio(k["kept_increase"], kept), corrective_share=_ratio(k["kept_decrease"], kept),
                      youden_j=corrective - unsafe,
                      sign_agreement=_ratio(k["agree"], ninc + ndec),
                      disagreement_frac=_ratio(k["disagree_with_ratio"], n),
                      disagreement_n=float(k["disagree_with_ratio"]),
                      right_on_disagreement=_ratio(k["right_on_disagreement"], k["disagree_with_ratio"]))
    return out


# ----------------------------------------------------------------------------- estimator fidelity
#: Bin edges of the behaviour tail mass μ_T for the fidelity curves.
TAIL_MASS_BINS = (0.0, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0 + 1e-9)


@functools.partial(jax.jit, static_argnames=("k",))
def fidelity_analysis(logits, behavior_logits, tokens, valid, *, k: int) -> dict:
    """Sign of each closed-form Ḋ estimator vs the full-vocabulary Ḋ, with a self-consistent μ.

    μ = softmax(behavior_logits); its top-K view is derived from that same μ, so only each estimator's tail
    approximation is measured.

    Args:
      logits: ``[B,T,V]`` temperature-scaled trainer logits (π).
      behavior_logits: ``[B,T,V]`` temperature-scaled behaviour logits (μ).
      tokens: ``[B,T]`` int sampled ids; valid: ``[B,T]`` bool.
      k: K of the top-K view (static).

    Returns:
      dict of ``[B,T]`` arrays: ``valid``, ``tail_mass`` (μ_T), ``dir_full`` and ``dir_<estimator>`` (f32),
      ``agree_<estimator>`` (bool; exact zeros agree only with exact zeros)."""
    logmu = jax.nn.log_softmax(jnp.asarray(behavior_logits, jnp.float32), axis=-1)
    z = jnp.asarray(logits, jnp.float32)
    topk_lp, topk_ids = jax.lax.top_k(logmu, k)
    behavior = jnp.take_along_axis(logmu, tokens[..., None], axis=-1)[..., 0]
    dir_full = tr.full_kl_directional_derivative(z, logmu, tokens)
    tq = tr.token_quantities(jax.nn.log_softmax(z, axis=-1), tokens, topk_ids, topk_lp, behavior,
                             with_tail_squares=False)
    out = dict(valid=valid.astype(bool), tail_mass=tq.mu_t, dir_full=dir_full)
    for name in tr.CLOSED_FORM_ESTIMATORS:
        d = tr.kl_directional_derivative(z, tokens, topk_ids, topk_lp, behavior, estimator=name)
        out[f"dir_{name}"] = d
        out[f"agree_{name}"] = jnp.sign(d) == jnp.sign(dir_full)
    return out


def fidelity_counts(fid: Mapping[str, np.ndarray], bins: Sequence[float] = TAIL_MASS_BINS) -> dict:
    """Per tail-mass bin: valid tokens and, per estimator, how many agree in sign with the full Ḋ; a non-finite tail
    mass is in no bin. Returns ``{"bins": [edges], "n": [nbins] int, "<estimator>": [nbins] int}``."""
    f = jax.device_get(dict(fid))
    mass = np.asarray(f["tail_mass"], np.float64)
    valid = np.asarray(f["valid"], bool) & np.isfinite(mass)
    mass = mass[valid]
    idx = np.clip(np.digitize(mass, bins) - 1, 0, len(bins) - 2)
    out = {"bins": list(bins), "n": np.bincount(idx, minlength=len(bins) - 1).astype(np.int64)}
    for name in tr.CLOSED_FORM_ESTIMATORS:
        agree = np.asarray(f[f"agree_{name}"], bool)[valid]
        out[name] = np.bincount(idx, weights=agree.astype(np.float64), minlength=len(bins) - 1).astype(np.int64)
    return out


def add_fidelity_counts(a: Optional[dict], b: dict) -> dict:
    """Sum of two `fidelity_counts` results (a may be None)."""
    if a is None:
        return {k: (list(v) if k == "bins" else np.asarray(v).copy()) for k, v in b.items()}
    return {k: (a[k] if k == "bins" else np.asarray(a[k]) + np.asarray(b[k])) for k in a}


# ----------------------------------------------------------------------------- statistics over seeds
def mean_ci95(values: Sequence[float]) -> tuple:
    """(mean, 95% Student-t half-width, n) over the finite values; half-width NaN for n < 2."""
    xs = np.asarray([v for v in values if v is not None and math.isfinite(float(v))], np.float64)
    if xs.size == 0:
        return float("nan"), float("nan"), 0
    m = float(xs.mean())
    if xs.size < 2:
        return m, float("nan"), 1
    from scipy import stats  # heavy (~1 s) and only for the report's t-intervals

    half = float(stats.t.ppf(0.975, xs.size - 1) * xs.std(ddof=1) / math.sqrt(xs.size))
    return m, half, int(xs.size)
