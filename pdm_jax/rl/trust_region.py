"""Trust-region core: top-K divergences, predictive directional derivatives, masks.

Pure ``jnp`` functions (jit-, grad-, jvp- and vmap-friendly) plus two host-side validators; notation and math are
``DESIGN.md`` sections 1-2, the PDM paper (arXiv 2607.10848) and DPPO (arXiv 2602.04879):

* ``logits``            ``[B,T,V]`` trainer logits **already divided by the sampling temperature** tau.
* ``tokens``            ``[B,T]`` int, the sampled ids y_t = k.
* ``topk_ids``          ``[B,T,K]`` int, the sampler's K most likely ids; ``topk_logprobs`` ``[B,T,K]`` their log mu.
* ``behavior_logprobs`` ``[B,T]`` log mu(y_t).

Inputs may be bf16 or f32; all math runs in f32 and outputs are f32; leading dimensions are arbitrary (``[..., V]``).
Candidates E = TopK ∪ {k}: a duplicate id in ``topk_ids`` counts once (its first occurrence; :func:`validate_topk`
rejects it on the host); out-of-range ids are clipped, counted (``num_bad_ids``) and masked by
:func:`trust_region_mask`. Tail masses: mu_T = max(0, 1 - sum_E mu_i), lowered to min(mu_T, pi_T) within f32 rounding
of 0 (:func:`tail_mass_tolerance`); pi_T is a log-sum-exp over the complement of E, so it keeps full relative
precision; 0 log 0 = 0 and ``-inf`` log-probs are zero probabilities. :func:`trust_region_mask_and_logprobs` needs
ONE log-softmax over V, which also gives the differentiable log pi(y_t) of the loss."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "TrustRegionConfig", "TokenQuantities", "token_quantities", "sanitize_inputs",
    "topk_kl", "topk_tv", "topk_reverse_kl", "binary_tv", "binary_kl", "full_kl", "DIVERGENCE_FNS",
    "kl_directional_derivative", "full_kl_directional_derivative", "autodiff_directional_derivative",
    "policy_gradient_direction", "token_logprobs", "token_logprobs_and_ratio",
    "trust_region_mask", "trust_region_mask_and_logprobs", "validate_topk",
    "DIRECTION_CRITERIA", "DIRECTIONS", "PARAM_JVP", "criterion_settings", "trust_region_radius",
    "tail_mass_tolerance",
]

MASK_MODES = ("none", "ppo", "dppo", "pdm")
DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "topk_reverse_kl")
CLOSED_FORM_ESTIMATORS = ("aggregated_tail", "uniform_tail", "bucket_exact")
ESTIMATORS = CLOSED_FORM_ESTIMATORS + ("autodiff",)
#: The direction criteria of the top-K KL mask (DESIGN.md section 2): ``"ratio"`` is dir = r - 1 (DPPO), each
#: closed-form estimator dir = D' (PDM); :func:`criterion_settings` maps a name to its config fields.
DIRECTION_CRITERIA = ("ratio",) + CLOSED_FORM_ESTIMATORS
#: Where the mask's direction comes from (:attr:`TrustRegionConfig.direction`): ``"per_token"`` (each token's own
#: logit-space direction, the default) or ``"param_jvp"`` (Ḋᵖ_t along the optimizer's update, from the train step).
PARAM_JVP = "param_jvp"
DIRECTIONS = ("per_token", PARAM_JVP)
NONFINITE_POLICIES = ("mask", "error")

#: Floor on mu in :func:`topk_reverse_kl` (KL(pi||mu) is infinite where mu = 0 < pi; log(1e-20) = -46).
REVERSE_KL_MIN_PROB = 1e-20
#: |log pi - log mu| is clipped at this before every exp of a log-ratio (here, ``objectives``, ``loss``): r = e^20 ~
#: 4.9e8 is outside any sensible trust region and inf never appears; beyond it the gradient is zero. Defined once.
LOG_RATIO_CLAMP = 20.0

#: ulps of 1 (f32 eps) added to the C = K + 1 of the candidates in the rounding tolerance of
#: mu_T = 1 - sum_E mu (see :func:`tail_mass_tolerance`: (C + 4) eps).
TAIL_MASS_ROUNDING_SLACK = 4

_F32 = jnp.float32


# ---- Shared per-token quantities (one log-softmax, K+1 gathers, tail reductions) -------------------------


def _log_softmax_f32(logits: jax.Array, max_logit: Optional[jax.Array] = None) -> jax.Array:
    """log_softmax over the last axis in f32; ``max_logit`` [...,1] may be given (reused)."""
    z = jnp.asarray(logits).astype(_F32)
    if max_logit is None:
        max_logit = jnp.max(z, axis=-1, keepdims=True)
    shifted = z - jax.lax.stop_gradient(max_logit)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


class TokenQuantities(NamedTuple):
    """Per-token quantities shared by every divergence and direction: ``C = K + 1`` candidate slots (the K top-K ids,
    then the sampled id); all float fields f32."""

    logp_k: jax.Array  # [...] log pi(k)
    logmu_k: jax.Array  # [...] behavior_logprobs (log mu(k) as reported by the sampler)
    cand_ids: jax.Array  # [...,C] int32, clipped to [0, V)
    member: jax.Array  # [...,C] bool: slot is a (deduplicated) member of E
    is_k: jax.Array  # [...,C] bool: member slot holding the sampled id (exactly one)
    logpi_e: jax.Array  # [...,C] log pi at the candidates (finite for finite logits)
    logmu_e: jax.Array  # [...,C] log mu at the candidates (0 where not a member or mu = 0)
    pi_e: jax.Array  # [...,C] pi at member slots, 0 elsewhere
    mu_e: jax.Array  # [...,C] mu at member slots, 0 elsewhere
    mu_t: jax.Array  # [...] behaviour tail mass, clamped >= 0, 0 for an empty tail, min(mu_T, pi_T)
    #                  when within rounding of 0 (tail_mass_tolerance)
    pi_t: jax.Array  # [...] policy tail mass (exact complement sum)
    log_pi_t: jax.Array  # [...] log pi_T (-inf if the tail carries no policy mass)
    tail_has_mass: jax.Array  # [...] bool: tail non-empty and pi_T > 0 (in log space)
    tail_size: jax.Array  # [...] f32 |T| = V - |E|
    tail_sq_over_pi_t: Optional[jax.Array]  # [...] q = sum_T pi_i^2 / pi_T (bucket_exact) or None


def tail_mass_tolerance(num_candidates: int) -> float:
    """The rounding tolerance (C + 4) eps of the f32 behaviour tail mass mu_T = 1 - sum_E mu, a python float.

    C = ``num_candidates`` (= K + 1) f32 log-probs leave a zero-mass tail as a residue of at most (C - 1)/2 ulps (the
    sum), 1 ulp (the exps) and 1.5 ulps (the log-softmax's normalisation); the tolerance is twice that (7.2e-7 for K
    = 1, 2.9e-6 for K = 20; eps = 2**-23). :func:`token_quantities` lowers a mu_T at or below it to min(mu_T, pi_T),
    which changes the top-K KL by at most tol · log(tol / pi_T) and leaves every larger tail bit for bit.

    Raises:
      ValueError: ``num_candidates`` < 1."""
    if int(num_candidates) < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates!r}")
    return float((int(num_candidates) + TAIL_MASS_ROUNDING_SLACK) * np.finfo(np.float32).eps)


def _first_occurrence(topk_ids: jax.Array) -> jax.Array:
    """[...,K] bool: True where the id does not appear at an earlier top-K slot."""
    k = topk_ids.shape[-1]
    eq = topk_ids[..., :, None] == topk_ids[..., None, :]
    earlier = jnp.tril(jnp.ones((k, k), dtype=bool), k=-1)
    return ~jnp.any(eq & earlier, axis=-1)


def _tail_logp(logp: jax.Array, cand_ids: jax.Array) -> jax.Array:
    """[...,V] log pi with -inf at the candidate ids, from C elementwise compares against an iota (no scatter: XLA's CPU
    scatter is serial), materialised once (optimization barrier) for the tail reductions that read it."""
    iota = jax.lax.broadcasted_iota(jnp.int32, logp.shape, logp.ndim - 1)
    tail = logp
    for j in range(cand_ids.shape[-1]):
        tail = jnp.where(iota == cand_ids[..., j:j + 1], -jnp.inf, tail)
    return jax.lax.optimization_barrier(tail)


@functools.partial(jax.jit, static_argnames=("with_tail_squares",))
def token_quantities(
    logp: jax.Array,
    tokens: jax.Array,
    topk_ids: jax.Array,
    topk_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    *,
    with_tail_squares: bool = True,
) -> TokenQuantities:
    """Everything the divergences and directions need, from one log-softmax.

    Args:
      logp: ``[...,V]`` f32 log pi of the temperature-scaled logits (differentiable).
      tokens, topk_ids, topk_logprobs, behavior_logprobs: as in the module docstring (ids clipped into ``[0, V)``).
      with_tail_squares: also q = sum_T pi_i^2 / pi_T (one more reduction over V; only bucket_exact needs it).

    Returns:
      :class:`TokenQuantities`."""
    vocab = logp.shape[-1]
    tokens = jnp.clip(jnp.asarray(tokens).astype(jnp.int32), 0, vocab - 1)
    topk_ids = jnp.clip(jnp.asarray(topk_ids).astype(jnp.int32), 0, vocab - 1)
    topk_lp = jnp.asarray(topk_logprobs).astype(_F32)
    behavior_lp = jnp.asarray(behavior_logprobs).astype(_F32)

    k_in_topk = jnp.any(topk_ids == tokens[..., None], axis=-1)
    cand_ids = jnp.concatenate([topk_ids, tokens[..., None]], axis=-1)
    member = jnp.concatenate([_first_occurrence(topk_ids), ~k_in_topk[..., None]], axis=-1)
    is_k = member & (cand_ids == tokens[..., None])
    logmu_raw = jnp.concatenate([topk_lp, behavior_lp[..., None]], axis=-1)

    logpi_e = jnp.take_along_axis(logp, cand_ids, axis=-1)
    logp_k = logpi_e[..., -1]
    pi_e = jnp.where(member, jnp.exp(logpi_e), 0.0)
    mu_e = jnp.where(member, jnp.exp(logmu_raw), 0.0)
    logmu_e = jnp.where(mu_e > 0, logmu_raw, 0.0)

    tail_size = (vocab - jnp.sum(member, axis=-1)).astype(_F32)
    tail_nonempty = tail_size > 0
    mu_t_rounded = jnp.where(tail_nonempty, jnp.maximum(1.0 - jnp.sum(mu_e, axis=-1), 0.0), 0.0)

    # Log-sum-exp over the complement of E, shifted by the maximal tail log-prob.
    tail_logp = _tail_logp(logp, cand_ids)
    tail_max = jax.lax.stop_gradient(jnp.max(tail_logp, axis=-1))
    tail_has_mass = jnp.isfinite(tail_max)
    tail_shift = jnp.where(tail_has_mass, tail_max, 0.0)
    scaled = jnp.exp(tail_logp - tail_shift[..., None])  # 0 on E, <= 1 on the tail
    s1 = jnp.sum(scaled, axis=-1)
    s1_safe = jnp.where(tail_has_mass, s1, 1.0)
    log_pi_t = jnp.where(tail_has_mass, tail_shift + jnp.log(s1_safe), -jnp.inf)
    pi_t = jnp.where(tail_has_mass, jnp.exp(tail_shift + jnp.log(s1_safe)), 0.0)

    # A zero-mass behaviour tail comes out as a few ulps (e.g. 6e-8), which against a zero policy tail would make the
    # KL +inf: within that rounding mu_T is lowered to pi_T, as a constant (tail_mass_tolerance).
    tolerance = tail_mass_tolerance(cand_ids.shape[-1])
    mu_t = jnp.where(mu_t_rounded <= tolerance,
                     jnp.minimum(mu_t_rounded, jax.lax.stop_gradient(pi_t)), mu_t_rounded)

    q = None
    if with_tail_squares:
        # exp(2x - 2 shift) rather than scaled**2: no shared [...,V] subexpression with s1, so XLA fuses each reduction
        # with its own exp instead of materialising `x - shift`.
        s2 = jnp.sum(jnp.exp(2.0 * tail_logp - (2.0 * tail_shift)[..., None]), axis=-1)
        # sum_T pi^2 / pi_T = pi_T * s2 / s1^2; clamp to its exact bounds [pi_T/|T|, pi_T].
        q = pi_t * (s2 / (s1_safe * s1_safe))
        q = jnp.clip(q, pi_t / jnp.maximum(tail_size, 1.0), pi_t)
        q = jnp.where(tail_has_mass, q, 0.0)

    return TokenQuantities(
        logp_k=logp_k, logmu_k=behavior_lp, cand_ids=cand_ids, member=member, is_k=is_k,
        logpi_e=logpi_e, logmu_e=logmu_e, pi_e=pi_e, mu_e=mu_e, mu_t=mu_t, pi_t=pi_t,
        log_pi_t=log_pi_t, tail_has_mass=tail_has_mass, tail_size=tail_size,
        tail_sq_over_pi_t=q)


def _quantities(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, *, with_tail_squares):
    return token_quantities(_log_softmax_f32(logits), tokens, topk_ids, topk_logprobs,
                            behavior_logprobs, with_tail_squares=with_tail_squares)


# ---- Divergences from the shared quantities --------------------------------------------------------------


def _topk_kl_from(tq: TokenQuantities) -> jax.Array:
    head = jnp.sum(jnp.where(tq.mu_e > 0, tq.mu_e * (tq.logmu_e - tq.logpi_e), 0.0), axis=-1)
    use_tail = (tq.mu_t > 0) & tq.tail_has_mass
    mu_t_safe = jnp.where(tq.mu_t > 0, tq.mu_t, 1.0)
    log_pi_t_safe = jnp.where(tq.tail_has_mass, tq.log_pi_t, 0.0)
    tail = jnp.where(use_tail, tq.mu_t * (jnp.log(mu_t_safe) - log_pi_t_safe), 0.0)
    # mu_T > 0 on a tail the policy gives exactly zero mass (all -inf logits): KL = +inf.
    tail = jnp.where((tq.mu_t > 0) & ~tq.tail_has_mass, jnp.inf, tail)
    return head + tail


def _topk_tv_from(tq: TokenQuantities) -> jax.Array:
    return 0.5 * (jnp.sum(jnp.abs(tq.mu_e - tq.pi_e), axis=-1) + jnp.abs(tq.mu_t - tq.pi_t))


def _topk_reverse_kl_from(tq: TokenQuantities) -> jax.Array:
    log_floor = math.log(REVERSE_KL_MIN_PROB)
    logmu_e = jnp.where(tq.mu_e > 0, jnp.maximum(tq.logmu_e, log_floor), log_floor)
    head = jnp.sum(jnp.where(tq.member, tq.pi_e * (tq.logpi_e - logmu_e), 0.0), axis=-1)
    log_mu_t = jnp.log(jnp.maximum(tq.mu_t, REVERSE_KL_MIN_PROB))
    log_pi_t_safe = jnp.where(tq.tail_has_mass, tq.log_pi_t, 0.0)
    tail = jnp.where(tq.tail_has_mass, tq.pi_t * (log_pi_t_safe - log_mu_t), 0.0)
    return head + tail


def _binary_tv_from(tq: TokenQuantities) -> jax.Array:
    return jnp.abs(jnp.exp(tq.logmu_k) - jnp.exp(tq.logp_k))


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - e^x) for x <= 0 (Maechler 2012), -inf at x = 0; x > 0 is treated as 0."""
    x = jnp.minimum(x, 0.0)
    x_safe = jnp.where(x < 0, x, -1.0)
    val = jnp.where(x_safe > -math.log(2.0), jnp.log(-jnp.expm1(x_safe)), jnp.log1p(-jnp.exp(x_safe)))
    return jnp.where(x < 0, val, -jnp.inf)


def _binary_kl_from(tq: TokenQuantities) -> jax.Array:
    # Bernoulli(mu_k) vs Bernoulli(pi_k); log(1 - pi_k) is the exact log-sum-exp over the complement of {k} (other
    # members of E and the tail), finite for finite logits.
    others = tq.member & ~tq.is_k
    logpi_others = jnp.where(others, tq.logpi_e, -jnp.inf)
    log_pi_t_or = jnp.where(tq.tail_has_mass, tq.log_pi_t, -jnp.inf)
    stacked = jnp.concatenate([logpi_others, log_pi_t_or[..., None]], axis=-1)
    present = jnp.concatenate([others, tq.tail_has_mass[..., None]], axis=-1)
    any_other = jnp.any(present, axis=-1)
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(present, stacked, -jnp.inf), axis=-1))
    shift = jnp.where(any_other, shift, 0.0)
    ssum = jnp.sum(jnp.where(present, jnp.exp(jnp.where(present, stacked, 0.0) - shift[..., None]), 0.0),
                   axis=-1)
    log1m_pi = jnp.where(any_other, shift + jnp.log(jnp.where(any_other, ssum, 1.0)), -jnp.inf)
    log1m_pi_safe = jnp.where(any_other, log1m_pi, 0.0)

    logmu = jnp.minimum(tq.logmu_k, 0.0)
    mu = jnp.exp(logmu)
    log1m_mu = _log1mexp(logmu)
    one_m_mu = -jnp.expm1(logmu)
    pos = jnp.where(mu > 0, mu * (jnp.where(mu > 0, logmu, 0.0) - tq.logp_k), 0.0)
    neg_ok = one_m_mu > 0
    neg = jnp.where(neg_ok & any_other,
                    one_m_mu * (jnp.where(neg_ok, log1m_mu, 0.0) - log1m_pi_safe), 0.0)
    neg = jnp.where(neg_ok & ~any_other, jnp.inf, neg)
    return pos + neg


# ---- Public divergences ----------------------------------------------------------------------------------


@jax.jit
def topk_kl(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> jax.Array:
    """Top-K KL(mu || pi) over E = TopK ∪ {k} plus one tail bucket (DPPO's proximity).

    D = sum_{i in E} mu_i log(mu_i / pi_i) + mu_T log(mu_T / pi_T) (DESIGN.md section 2; DPPO arXiv 2602.04879).

    Args:
      logits: ``[...,V]`` temperature-scaled trainer logits (bf16/f32).
      tokens: ``[...]`` int sampled ids.
      topk_ids: ``[...,K]`` int sampler top-K ids (a duplicate counts once).
      topk_logprobs: ``[...,K]`` log mu of ``topk_ids`` (``-inf`` allowed).
      behavior_logprobs: ``[...]`` log mu(k) (mu_k when k is not in the top-K).

    Returns:
      ``[...]`` f32 nats, >= 0 up to rounding; ``+inf`` only if mu_T exceeds :func:`tail_mass_tolerance` while every
      tail logit is ``-inf``; 0 when mu = pi on E. NaN inputs give NaN at that position only."""
    return _topk_kl_from(_quantities(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs,
                                     with_tail_squares=False))


@jax.jit
def topk_tv(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> jax.Array:
    """Top-K total variation ½(sum_E |mu_i - pi_i| + |mu_T - pi_T|), ``[...]`` f32 in [0, 1]; arguments as
    :func:`topk_kl` (DPPO arXiv 2602.04879 top-K TV)."""
    return _topk_tv_from(_quantities(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs,
                                     with_tail_squares=False))


@jax.jit
def topk_reverse_kl(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> jax.Array:
    """Top-K reverse KL(pi || mu) = sum_E pi_i log(pi_i/mu_i) + pi_T log(pi_T/mu_T), ``[...]`` f32.

    mu is floored at :data:`REVERSE_KL_MIN_PROB` inside the logs (finite and large where mu = 0 < pi). Arguments as
    :func:`topk_kl`."""
    return _topk_reverse_kl_from(_quantities(logits, tokens, topk_ids, topk_logprobs,
                                             behavior_logprobs, with_tail_squares=False))


@jax.jit
def binary_tv(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> jax.Array:
    """Binary TV |mu_k - pi_k| of the sampled token, ``[...]`` f32 in [0, 1] (DPPO); mu_k = exp(behavior_logprobs). The
    top-K arguments are unused, so every divergence shares one argument list."""
    del topk_ids, topk_logprobs
    logp_k, _ = token_logprobs_and_ratio(logits, tokens, behavior_logprobs)
    return jnp.abs(jnp.exp(jnp.asarray(behavior_logprobs).astype(_F32)) - jnp.exp(logp_k))


@jax.jit
def binary_kl(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> jax.Array:
    """Binary KL(Bernoulli(mu_k) || Bernoulli(pi_k)) of the sampled token, ``[...]`` f32 (DPPO).

    0 log 0 = 0; log(1 - pi_k) is the log-sum-exp over the complement of {k}, finite as pi_k -> 1. Arguments as
    :func:`topk_kl`."""
    return _binary_kl_from(_quantities(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs,
                                       with_tail_squares=False))


_DIVERGENCE_FROM = {
    "topk_kl": _topk_kl_from,
    "topk_tv": _topk_tv_from,
    "topk_reverse_kl": _topk_reverse_kl_from,
    "binary_tv": _binary_tv_from,
    "binary_kl": _binary_kl_from,
}
DIVERGENCE_FNS: dict = {
    "topk_kl": topk_kl,
    "topk_tv": topk_tv,
    "topk_reverse_kl": topk_reverse_kl,
    "binary_tv": binary_tv,
    "binary_kl": binary_kl,
}


@jax.jit
def full_kl(logits, behavior_logits) -> jax.Array:
    """Full-vocabulary KL(mu || pi), mu = softmax(behavior_logits), pi = softmax(logits); ``[...]`` f32."""
    logp = _log_softmax_f32(logits)
    logmu = _log_softmax_f32(behavior_logits)
    mu = jnp.exp(logmu)
    return jnp.sum(jnp.where(mu > 0, mu * (logmu - logp), 0.0), axis=-1)


# ---- Directional derivatives along e_k - pi --------------------------------------------------------------


def _kl_direction_from(tq: TokenQuantities, estimator: str) -> jax.Array:
    if estimator == "bucket_exact":
        if tq.tail_sq_over_pi_t is None:
            raise ValueError("bucket_exact needs token_quantities(..., with_tail_squares=True)")
        q = tq.tail_sq_over_pi_t
    elif estimator == "aggregated_tail":
        q = tq.pi_t
    elif estimator == "uniform_tail":
        q = tq.pi_t / jnp.maximum(tq.tail_size, 1.0)
    else:
        raise ValueError(f"estimator must be one of {CLOSED_FORM_ESTIMATORS}, got {estimator!r}")
    s = jnp.sum(tq.mu_e, axis=-1) + tq.mu_t
    pi_k = jnp.exp(tq.logp_k)
    mu_k = jnp.sum(jnp.where(tq.is_k, tq.mu_e, 0.0), axis=-1)
    head = s * (pi_k - jnp.sum(tq.pi_e * tq.pi_e, axis=-1)) - mu_k + jnp.sum(tq.mu_e * tq.pi_e, axis=-1)
    return head + q * (tq.mu_t - s * tq.pi_t)


@functools.partial(jax.jit, static_argnames=("estimator",))
def kl_directional_derivative(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, *,
                              estimator: str) -> jax.Array:
    """Closed-form predictive direction D' of the top-K KL along e_k - pi, ``[...]`` f32.

    D' = S(pi_k - sum_E pi_i^2) - mu_k + sum_E mu_i pi_i + q (mu_T - S pi_T), S = sum_E mu_i + mu_T, with
    ``"aggregated_tail"`` q = pi_T and ``"uniform_tail"`` q = pi_T / |T| (PDM paper, arXiv 2607.10848), or
    ``"bucket_exact"`` q = sum_{i in T} pi_i^2 / pi_T (the exact derivative of :func:`topk_kl` itself; DESIGN.md
    section 2 table). A policy-gradient step with advantage A changes D by A·c·D' (c > 0).

    Raises:
      ValueError: unknown ``estimator``."""
    if estimator not in CLOSED_FORM_ESTIMATORS:
        raise ValueError(f"estimator must be one of {CLOSED_FORM_ESTIMATORS}, got {estimator!r}")
    tq = _quantities(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs,
                     with_tail_squares=(estimator == "bucket_exact"))
    return _kl_direction_from(tq, estimator)


@jax.jit
def full_kl_directional_derivative(logits, behavior_logits, tokens) -> jax.Array:
    """D' = (pi_k - mu_k) + sum_i pi_i (mu_i - pi_i) of the full-vocabulary KL(mu || pi) along e_k - pi, ``[...]`` f32
    (DESIGN.md section 2), for tests and analysis where mu = softmax(behavior_logits) is known."""
    logp = _log_softmax_f32(logits)
    logmu = _log_softmax_f32(behavior_logits)
    pi, mu = jnp.exp(logp), jnp.exp(logmu)
    tokens = jnp.clip(jnp.asarray(tokens).astype(jnp.int32), 0, logp.shape[-1] - 1)[..., None]
    local = (jnp.take_along_axis(pi, tokens, axis=-1) - jnp.take_along_axis(mu, tokens, axis=-1))[..., 0]
    return local + jnp.sum(pi * (mu - pi), axis=-1)


@jax.jit
def policy_gradient_direction(logits, tokens) -> jax.Array:
    """The per-token logit direction e_k - pi of a policy-gradient step, ``[...,V]`` f32."""
    z = jnp.asarray(logits).astype(_F32)
    vocab = z.shape[-1]
    tokens = jnp.clip(jnp.asarray(tokens).astype(jnp.int32), 0, vocab - 1)
    return jax.nn.one_hot(tokens, vocab, dtype=_F32) - jax.nn.softmax(z, axis=-1)


@functools.partial(jax.jit, static_argnums=(0,))
def autodiff_directional_derivative(divergence_fn: Callable, logits, tokens, topk_ids, topk_logprobs,
                                    behavior_logprobs) -> jax.Array:
    """D' of any per-token divergence by ``jax.jvp`` w.r.t. the logits along e_k - pi, ``[...]`` f32.

    ``divergence_fn(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs) -> [...]``, position t depending only
    on logits[t] (:func:`topk_kl`, :func:`topk_tv`, :func:`binary_tv`, ...). One forward-mode pass (a ``[...,V]``
    tangent); TV uses JAX's d|x| = sign(x) dx."""
    z = jnp.asarray(logits).astype(_F32)
    direction = policy_gradient_direction(z, tokens)

    def f(zz):
        return divergence_fn(zz, tokens, topk_ids, topk_logprobs, behavior_logprobs)

    _, tangent = jax.jvp(f, (z,), (direction,))
    return tangent.astype(_F32)


# ---- Token log-probs -------------------------------------------------------------------------------------


@jax.jit
def token_logprobs(logits, tokens, valid_mask=None) -> jax.Array:
    """log pi(y_t) of the sampled tokens, ``[...]`` f32, differentiable w.r.t. ``logits``.

    Args:
      logits: ``[...,V]`` temperature-scaled logits (bf16/f32).
      tokens: ``[...]`` int ids (clipped into ``[0, V)``).
      valid_mask: optional ``[...]`` bool; where False the logits are zeroed *before* the log-softmax, so the output
        and its gradient are exactly 0 even over NaN/inf logits."""
    z = jnp.asarray(logits).astype(_F32)
    vocab = z.shape[-1]
    if valid_mask is not None:
        valid_mask = jnp.asarray(valid_mask).astype(bool)
        z = jnp.where(valid_mask[..., None], z, 0.0)
    tokens = jnp.clip(jnp.asarray(tokens).astype(jnp.int32), 0, vocab - 1)
    if valid_mask is not None:
        tokens = jnp.where(valid_mask, tokens, 0)
    logp = _log_softmax_f32(z)
    out = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    if valid_mask is not None:
        out = jnp.where(valid_mask, out, 0.0)
    return out


@jax.jit
def token_logprobs_and_ratio(logits, tokens, behavior_logprobs, valid_mask=None):
    """(log pi(y_t), r_t = pi(y_t)/mu(y_t)) from one log-softmax, both ``[...]`` f32.

    r is ``+inf`` for ``log mu = -inf`` (never NaN for finite logits); with ``valid_mask`` (:func:`token_logprobs`)
    invalid positions give log-prob 0 and ratio 1 with zero gradient."""
    logp_k = token_logprobs(logits, tokens, valid_mask)
    behavior = jnp.asarray(behavior_logprobs).astype(_F32)
    if valid_mask is not None:
        valid_mask = jnp.asarray(valid_mask).astype(bool)
        behavior = jnp.where(valid_mask, behavior, 0.0)
    return logp_k, jnp.exp(logp_k - behavior)


# ---- Configuration ---------------------------------------------------------------------------------------


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class TrustRegionConfig:
    """Static, hashable configuration of the per-token trust-region mask.

    Fields:
      mask: ``"none"`` (keep every valid token), ``"ppo"`` (ratio clip, ratio direction), ``"dppo"`` (divergence >
        delta, ratio direction; arXiv 2602.04879) or ``"pdm"`` (divergence > delta, predictive direction D'; arXiv
        2607.10848).
      divergence: ``"binary_tv" | "binary_kl" | "topk_tv" | "topk_kl" | "topk_reverse_kl"``.
      estimator: D' for pdm: ``"aggregated_tail" | "uniform_tail" | "bucket_exact"`` (closed forms, ``topk_kl`` only)
        or ``"autodiff"`` (``jax.jvp``; required for any other divergence with ``mask="pdm"``).
      delta: radius in the divergence's units (nats for KL, probability for TV); delta_low / delta_high: the radius
        where A < 0 / A > 0 (None: ``delta``). clip_eps_low / clip_eps_high: ppo keeps r in [1 - eps_low, 1 +
        eps_high].
      nonfinite: ``"mask"`` (NaN/inf inputs at a valid position are counted in ``num_nonfinite`` and masked) or
        ``"error"`` (also a ``ValueError`` naming the first bad position: directly when eager, as a
        ``JaxRuntimeError`` under ``jit``).
      direction_stats: also report ``frac_direction_disagree`` for none/ppo/dppo where the pair defines a predictive
        direction (:attr:`defines_predictive_direction`); pdm always reports it.
      direction: ``"per_token"`` (the logit-space direction above) or ``"param_jvp"`` (``mask="pdm"`` only): masked
        iff outside and Ḋᵖ_t > 0, the change of the divergence along the optimizer's update of the unmasked
        mini-batch, supplied as ``param_direction`` by the train step (:data:`DIRECTIONS`).

    Raises:
      ValueError: naming the field and the value, for any invalid field."""

    mask: str = "pdm"
    divergence: str = "topk_kl"
    estimator: str = "bucket_exact"
    delta: float = 0.05
    delta_low: Optional[float] = None
    delta_high: Optional[float] = None
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    nonfinite: str = "mask"
    direction_stats: bool = True
    direction: str = "per_token"

    def __post_init__(self):
        for name in ("delta", "delta_low", "delta_high", "clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)  # numpy scalars -> python floats (hashable, jit-static friendly)
            if isinstance(value, (np.floating, np.integer)):
                object.__setattr__(self, name, float(value))
        for name, allowed in (("mask", MASK_MODES), ("divergence", DIVERGENCES),
                              ("estimator", ESTIMATORS), ("nonfinite", NONFINITE_POLICIES),
                              ("direction", DIRECTIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"TrustRegionConfig.{name} must be one of {allowed}, got {value!r}")
        if not (_is_real(self.delta) and self.delta > 0):
            raise ValueError(f"TrustRegionConfig.delta must be a finite float > 0, got {self.delta!r}")
        for name in ("delta_low", "delta_high"):
            value = getattr(self, name)
            if value is not None and not (_is_real(value) and value > 0):
                raise ValueError(f"TrustRegionConfig.{name} must be None or a finite float > 0, got {value!r}")
        if not (_is_real(self.clip_eps_low) and 0 <= self.clip_eps_low < 1):
            raise ValueError(f"TrustRegionConfig.clip_eps_low must be in [0, 1), got {self.clip_eps_low!r}")
        if not (_is_real(self.clip_eps_high) and self.clip_eps_high >= 0):
            raise ValueError(f"TrustRegionConfig.clip_eps_high must be a finite float >= 0, "
                             f"got {self.clip_eps_high!r}")
        if not isinstance(self.direction_stats, bool):
            raise ValueError(f"TrustRegionConfig.direction_stats must be a bool, got {self.direction_stats!r}")
        if self.direction == PARAM_JVP and self.mask != "pdm":
            raise ValueError(f"TrustRegionConfig.direction={PARAM_JVP!r} is a predictive direction: it needs "
                             f"mask='pdm' (it replaces the estimator's D'), got mask={self.mask!r}")
        if (self.mask == "pdm" and self.direction != PARAM_JVP and self.divergence != "topk_kl"
                and self.estimator != "autodiff"):
            raise ValueError(
                f"TrustRegionConfig.estimator={self.estimator!r} is a closed form of the top-K KL; "
                f"mask='pdm' with divergence={self.divergence!r} needs estimator='autodiff'")

    @property
    def uses_param_direction(self) -> bool:
        """True if the mask needs Ḋᵖ from the train step (``direction="param_jvp"``)."""
        return self.direction == PARAM_JVP

    @property
    def defines_predictive_direction(self) -> bool:
        """True if (divergence, estimator) names a predictive direction (closed form or jvp)."""
        return self.divergence == "topk_kl" or self.estimator == "autodiff"

    @property
    def radius_low(self) -> float:
        return self.delta if self.delta_low is None else self.delta_low

    @property
    def radius_high(self) -> float:
        return self.delta if self.delta_high is None else self.delta_high


def criterion_settings(criterion: str) -> dict:
    """The :class:`TrustRegionConfig` fields that select a direction criterion, a new dict.

    ``{"mask": "dppo"}`` for ``"ratio"``, ``{"mask": "pdm", "estimator": criterion}`` for a closed-form estimator of
    :data:`DIRECTION_CRITERIA`, ``{"mask": "pdm", "direction": "param_jvp"}`` for ``"param_jvp"``; other fields are
    the caller's.

    Raises:
      ValueError: naming the criterion and the allowed names."""
    if criterion == "ratio":
        return {"mask": "dppo"}
    if criterion in CLOSED_FORM_ESTIMATORS:
        return {"mask": "pdm", "estimator": criterion}
    if criterion == PARAM_JVP:
        return {"mask": "pdm", "direction": PARAM_JVP}
    raise ValueError(f"direction criterion must be one of {DIRECTION_CRITERIA}, got {criterion!r}")


# ---- The mask --------------------------------------------------------------------------------------------


def _predictive_direction(config: TrustRegionConfig, tq: TokenQuantities, safe_inputs) -> jax.Array:
    if config.divergence == "topk_kl" and config.estimator != "autodiff":
        return _kl_direction_from(tq, config.estimator)
    return autodiff_directional_derivative(DIVERGENCE_FNS[config.divergence], *safe_inputs)


def _raise_nonfinite(count, flat_index, shape):
    count = int(count)
    if count > 0:
        position = tuple(int(i) for i in np.unravel_index(int(flat_index), shape))
        raise ValueError(
            f"trust_region_mask: {count} valid position(s) with non-finite values (NaN/inf logits, "
            f"NaN/+inf behaviour or top-K log-probs, non-finite advantages, or a non-finite "
            f"divergence/direction); first at position {position}")



@jax.jit
def sanitize_inputs(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, keep_mask):
    """Replace every input where ``keep_mask`` is False by benign values (double where), BEFORE any math whose gradient
    is taken: a NaN logit poisons its position's softmax Jacobian even under a zero cotangent.

    Args:
      logits, tokens, topk_ids, topk_logprobs, behavior_logprobs: ``[...,V]``, ``[...]``, ``[...,K]``, ``[...,K]``,
        ``[...]``.
      keep_mask: ``[...]`` bool, True where the inputs are real.

    Returns:
      The five inputs (floats f32, ids int32); not-kept positions hold zero logits, token 0, ids ``0..K-1 (mod V)``
      and log-probs ``-log V``; kept positions are unchanged (ids clipped into ``[0, V)``)."""
    z = jnp.asarray(logits).astype(_F32)
    vocab = z.shape[-1]
    keep = jnp.asarray(keep_mask).astype(bool)
    topk_ids = jnp.asarray(topk_ids)
    uniform_lp = -math.log(vocab)
    filler_ids = jnp.broadcast_to(jnp.arange(topk_ids.shape[-1], dtype=jnp.int32) % vocab, topk_ids.shape)
    clip = lambda ids: jnp.clip(jnp.asarray(ids).astype(jnp.int32), 0, vocab - 1)  # noqa: E731
    return (jnp.where(keep[..., None], z, 0.0),
            jnp.where(keep, clip(tokens), 0),
            jnp.where(keep[..., None], clip(topk_ids), filler_ids),
            jnp.where(keep[..., None], jnp.asarray(topk_logprobs).astype(_F32), uniform_lp),
            jnp.where(keep, jnp.asarray(behavior_logprobs).astype(_F32), uniform_lp))


def trust_region_radius(advantages, delta: float, delta_low: Optional[float] = None,
                        delta_high: Optional[float] = None) -> jax.Array:
    """The per-token radius delta_A: delta_low where A < 0, delta_high where A > 0, delta elsewhere (NaN included).

    The one place the radius is computed (DESIGN.md section 1), for the mask and for ``pdm_jax.analysis.alignment``.

    Args:
      advantages: ``[...]`` advantages A, any float dtype.
      delta: radius in the divergence's units (python float).
      delta_low / delta_high: None means ``delta``.

    Returns:
      ``[...]`` f32, the shape of ``advantages``."""
    adv = jnp.asarray(advantages)
    low = delta if delta_low is None else delta_low
    high = delta if delta_high is None else delta_high
    return jnp.where(adv < 0, low, jnp.where(adv > 0, high, delta)).astype(_F32)


def _checked_inputs(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, advantages, valid_mask):
    """The mask's inputs as arrays of the right dtypes, advantages broadcast to the token shape.

    Raises:
      ValueError: shapes that disagree with the logits' leading shape (naming the input).
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 1:
        raise ValueError(f"logits must have a vocabulary axis, got shape {logits.shape}")
    lead = logits.shape[:-1]
    tokens = jnp.asarray(tokens)
    topk_ids = jnp.asarray(topk_ids)
    topk_lp = jnp.asarray(topk_logprobs).astype(_F32)
    behavior_lp = jnp.asarray(behavior_logprobs).astype(_F32)
    valid = jnp.asarray(valid_mask).astype(bool)
    for name, arr in (("tokens", tokens), ("behavior_logprobs", behavior_lp), ("valid_mask", valid)):
        if arr.shape != lead:
            raise ValueError(f"{name} must have shape {lead} (logits {logits.shape}), got {arr.shape}")
    if topk_ids.shape[:-1] != lead or topk_lp.shape != topk_ids.shape or topk_ids.ndim != len(lead) + 1:
        raise ValueError(f"topk_ids/topk_logprobs must have shape {lead} + (K,), got "
                         f"{topk_ids.shape} and {topk_lp.shape}")
    adv = jnp.asarray(advantages).astype(_F32)
    if adv.shape != lead:
        if adv.ndim == 1 and len(lead) >= 1 and adv.shape[0] == lead[0]:
            adv = jnp.broadcast_to(adv.reshape(adv.shape + (1,) * (len(lead) - 1)), lead)
        else:
            raise ValueError(f"advantages must have shape {lead} or ({lead[0] if lead else ''},), "
                             f"got {adv.shape}")
    return logits, tokens, topk_ids, topk_lp, behavior_lp, valid, adv


def _mask_stats(valid, good, nonfinite, bad_ids, outside, mask, divergence, tail_mass, keep_ratio, keep_pred,
                count_outside_kept=False):
    """The mask's statistics (f32 scalars, no gradient): counts, fractions of valid tokens, means over good ones;
    ``count_outside_kept`` adds ``num_outside`` and ``num_outside_kept`` (their ratio is ``frac_outside_kept``)."""
    n_valid = jnp.sum(valid.astype(_F32))
    n_good = jnp.sum(good.astype(_F32))
    frac = lambda b: jnp.sum((b & valid).astype(_F32)) / jnp.maximum(n_valid, 1.0)  # noqa: E731
    mean_good = lambda x: jnp.sum(jnp.where(good, x, 0.0)) / jnp.maximum(n_good, 1.0)  # noqa: E731
    stats = {
        "num_valid": n_valid,
        "num_nonfinite": jnp.sum(nonfinite.astype(_F32)),
        "num_bad_ids": jnp.sum((valid & bad_ids).astype(_F32)),
        "frac_outside": frac(good & outside),
        "frac_masked": frac(~mask),
        "mean_divergence": mean_good(divergence),
        "mean_tail_mass": mean_good(tail_mass),
    }
    if keep_pred is not None:
        stats["frac_direction_disagree"] = frac(good & (keep_ratio != keep_pred))
    if count_outside_kept:
        stats["num_outside"] = jnp.sum((good & outside).astype(_F32))
        stats["num_outside_kept"] = jnp.sum((good & outside & mask).astype(_F32))
    return {k: jax.lax.stop_gradient(v.astype(_F32)) for k, v in stats.items()}


@functools.partial(jax.jit, static_argnames=("config",))
def _mask_core(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, advantages, valid_mask,
               config: TrustRegionConfig, param_direction=None):
    logits, tokens, topk_ids, topk_lp, behavior_lp, valid, adv = _checked_inputs(
        logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, advantages, valid_mask)
    vocab = logits.shape[-1]

    # ---- detect bad inputs (one max over V, reused by the log-softmax) ----
    z = logits.astype(_F32)
    max_logit = jax.lax.stop_gradient(jnp.max(z, axis=-1))
    is_pinf = lambda x: jnp.isnan(x) | (x == jnp.inf)  # noqa: E731  (-inf log-probs are zero probabilities)
    bad_input = (~jnp.isfinite(max_logit) | is_pinf(behavior_lp) | jnp.any(is_pinf(topk_lp), axis=-1)
                 | ~jnp.isfinite(adv))
    bad_ids = ((tokens < 0) | (tokens >= vocab) | jnp.any((topk_ids < 0) | (topk_ids >= vocab), axis=-1))
    keep_in = valid & ~bad_input & ~bad_ids

    # ---- double where: benign inputs at every position that is not kept ----
    z_safe, tokens_safe, topk_ids_safe, topk_lp_safe, behavior_safe = sanitize_inputs(
        z, tokens, topk_ids, topk_lp, behavior_lp, keep_in)
    max_safe = jnp.where(keep_in, max_logit, 0.0)[..., None]
    adv_safe = jnp.where(keep_in, adv, 0.0)

    logp = _log_softmax_f32(z_safe, max_safe)  # the ONE log-softmax (differentiable)
    logprobs = jnp.where(keep_in, jnp.take_along_axis(logp, tokens_safe[..., None], axis=-1)[..., 0], 0.0)

    logp_sg = jax.lax.stop_gradient(logp)
    param_dir = config.uses_param_direction
    need_pred = not param_dir and (config.mask == "pdm"
                                   or (config.direction_stats and config.defines_predictive_direction))
    closed_form = config.divergence == "topk_kl" and config.estimator != "autodiff"
    tq = token_quantities(logp_sg, tokens_safe, topk_ids_safe, topk_lp_safe, behavior_safe,
                          with_tail_squares=need_pred and closed_form and config.estimator == "bucket_exact")
    divergence = _DIVERGENCE_FROM[config.divergence](tq)
    log_ratio = tq.logp_k - behavior_safe
    ratio_dir = log_ratio  # sign(r - 1) == sign(log r)
    pred_dir = None
    if need_pred:
        safe_inputs = (jax.lax.stop_gradient(z_safe), tokens_safe, topk_ids_safe, topk_lp_safe, behavior_safe)
        pred_dir = jax.lax.stop_gradient(_predictive_direction(config, tq, safe_inputs))
    elif param_dir:  # Ḋᵖ from the train step; a sign test without the advantage factor (below)
        pred_dir = jax.lax.stop_gradient(jnp.where(keep_in, jnp.asarray(param_direction).astype(_F32), 0.0))

    bad_math = ~jnp.isfinite(divergence)
    if pred_dir is not None:
        bad_math = bad_math | ~jnp.isfinite(pred_dir)
    nonfinite = valid & ~bad_ids & (bad_input | bad_math)
    good = valid & ~bad_ids & ~bad_input & ~bad_math

    radius = trust_region_radius(adv_safe, config.delta, config.delta_low, config.delta_high)
    if config.mask == "ppo":
        ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        outside = (ratio < 1.0 - config.clip_eps_low) | (ratio > 1.0 + config.clip_eps_high)
    else:
        outside = divergence > radius
    keep_ratio = ~(outside & (adv_safe * ratio_dir > 0))
    keep_pred = None if pred_dir is None else ~(outside & ((pred_dir if param_dir else adv_safe * pred_dir) > 0))

    if config.mask == "none":
        keep = jnp.ones_like(good)
    elif config.mask == "pdm":
        keep = keep_pred
    else:
        keep = keep_ratio
    mask = jax.lax.stop_gradient(good & keep)

    stats = _mask_stats(valid, good, nonfinite, bad_ids, outside, mask, divergence, tq.mu_t, keep_ratio, keep_pred,
                        count_outside_kept=param_dir)

    first_nonfinite = jnp.argmax(nonfinite.reshape(-1))
    # 0 (and zero gradient) wherever the position is padding or was counted as non-finite.
    logprobs = jnp.where(good, logprobs, 0.0)
    return mask, logprobs, stats, first_nonfinite


def trust_region_mask_and_logprobs(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs,
                                   advantages, valid_mask, config: TrustRegionConfig, param_direction=None):
    """The trust-region mask, the differentiable log pi(y_t) and statistics, from one log-softmax.

    M_t = 0 iff outside_t and A_t · dir_t > 0 (DESIGN.md section 2), with delta_A = :func:`trust_region_radius`:

    * ``ppo``:  outside iff r not in [1 - eps_low, 1 + eps_high], dir = r - 1;
    * ``dppo``: outside iff D > delta_A, dir = r - 1;
    * ``pdm``:  outside iff D > delta_A, dir = D' (configured estimator); with ``direction="param_jvp"`` masked iff
      outside and ``param_direction`` > 0 (no advantage factor);
    * ``none``: every valid position kept (``outside`` for the statistics is D > delta_A).

    sign(r - 1) is taken as sign(log pi(k) - log mu(k)). M is False on invalid positions and on valid ones with
    non-finite inputs; invalid positions may hold anything (inputs are replaced before the math), no NaN reaches
    outputs or gradient.

    Args:
      logits: ``[B,T,V]`` temperature-scaled trainer logits (bf16/f32).
      tokens: ``[B,T]`` int; topk_ids ``[B,T,K]`` int; topk_logprobs ``[B,T,K]``; behavior_logprobs ``[B,T]``.
      advantages: ``[B,T]`` or ``[B]``.
      valid_mask: ``[B,T]`` bool (False on padding).
      config: :class:`TrustRegionConfig` (static).
      param_direction: ``[B,T]`` f32 Ḋᵖ_t (nats per update), required iff ``config.direction == "param_jvp"``;
        non-finite at a valid position counts as non-finite (masked).

    Returns:
      ``(mask [B,T] bool, logprobs [B,T] f32, stats)``; mask and stats under ``stop_gradient``; logprobs = log
      pi(y_t) where valid with finite inputs, else 0 (zero gradient). ``stats`` (f32 scalars): ``num_valid``,
      ``num_nonfinite``, ``num_bad_ids``; fractions of valid positions ``frac_outside``, ``frac_masked``,
      ``frac_direction_disagree``; means over valid finite positions ``mean_divergence``, ``mean_tail_mass`` (mu_T);
      with ``param_jvp`` also ``num_outside`` / ``num_outside_kept``.

    Raises:
      ValueError: bad shapes; ``param_direction`` missing (param_jvp), given otherwise, or of another shape; with
        ``nonfinite="error"`` (eager) a non-finite valid input, naming the position."""
    if not isinstance(config, TrustRegionConfig):
        raise ValueError(f"config must be a TrustRegionConfig, got {type(config).__name__}")
    if (param_direction is None) == config.uses_param_direction:
        raise ValueError(f"param_direction must be given iff TrustRegionConfig.direction={PARAM_JVP!r} "
                         f"(direction={config.direction!r}, param_direction "
                         f"{'missing' if param_direction is None else 'given'})")
    if param_direction is not None and jnp.shape(param_direction) != jnp.shape(tokens):
        raise ValueError(f"param_direction must have the token shape {jnp.shape(tokens)}, "
                         f"got {jnp.shape(param_direction)}")
    mask, logprobs, stats, first_nonfinite = _mask_core(
        logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, advantages, valid_mask, config=config,
        param_direction=param_direction)
    if config.nonfinite == "error":
        count = stats["num_nonfinite"]
        lead = mask.shape
        if isinstance(count, jax.core.Tracer):
            jax.debug.callback(_raise_nonfinite, count, first_nonfinite, lead)
        else:
            _raise_nonfinite(count, first_nonfinite, lead)
    return mask, logprobs, stats


def trust_region_mask(logits, tokens, topk_ids, topk_logprobs, behavior_logprobs, advantages,
                      valid_mask, config: TrustRegionConfig, param_direction=None):
    """Per-token trust-region mask and statistics ``(mask [B,T] bool, stats)``: as
    :func:`trust_region_mask_and_logprobs` without the log-probs. ``config`` is static under ``jit``."""
    mask, _, stats = trust_region_mask_and_logprobs(logits, tokens, topk_ids, topk_logprobs,
                                                    behavior_logprobs, advantages, valid_mask, config,
                                                    param_direction=param_direction)
    return mask, stats


# ---- Host-side validation --------------------------------------------------------------------------------


def validate_topk(topk_ids, vocab_size: Optional[int] = None, valid_mask=None) -> None:
    """Host-side check of sampler top-K ids (outside ``jit``, e.g. on a fresh rollout).

    Args:
      topk_ids: ``[...,K]`` int array (numpy or jax).
      vocab_size: if given, every id must be in ``[0, vocab_size)``.
      valid_mask: optional ``[...]`` bool; padded positions are not checked.

    Raises:
      ValueError: naming the first position (index tuple) with a duplicate id (and the id) or an out-of-range id."""
    ids = np.asarray(topk_ids)
    if ids.ndim < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_ids must be an integer array [..., K], got dtype {ids.dtype} shape {ids.shape}")
    check = np.ones(ids.shape[:-1], bool)
    if valid_mask is not None:
        check = np.broadcast_to(np.asarray(valid_mask).astype(bool), ids.shape[:-1])
    if vocab_size is not None:
        out = ((ids < 0) | (ids >= vocab_size)).any(axis=-1) & check
        if out.any():
            pos = tuple(int(i) for i in np.argwhere(out)[0])
            raise ValueError(f"topk_ids at position {pos} has an id outside [0, {vocab_size}): "
                             f"{ids[pos].tolist()}")
    srt = np.sort(ids, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]).any(axis=-1) & check
    if dup.any():
        pos = tuple(int(i) for i in np.argwhere(dup)[0])
        row = np.sort(ids[pos])
        dup_id = int(row[1:][row[1:] == row[:-1]][0])
        raise ValueError(f"topk_ids at position {pos} contains the id {dup_id} more than once: "
                         f"{ids[pos].tolist()}")
