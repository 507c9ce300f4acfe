"""GRPO-family objective: group advantages, per-token policy losses, exact aggregation.

Pure ``jnp`` functions (jit-, grad- and vmap-friendly) plus one host-side validator; notation is ``DESIGN.md``
sections 1-2: ``logprobs`` = log pi(y_t), ``behavior_logprobs`` = log mu(y_t), ``advantages`` = A_t, ``mask`` = the
trust-region mask M_t AND the valid mask, ``valid_mask`` = real completion tokens. Per-token arrays are ``[B, T]``;
advantages ``[B]`` (broadcast over T) or ``[B, T]``; inputs bf16 or f32, all math and outputs f32.

Padding: a function that takes a mask returns exactly 0 loss AND 0 gradient at masked positions, even over NaN/inf
inputs there (inputs are replaced before any arithmetic); NaN *logits* must be sanitised by the caller before the
log-softmax. Micro-batching: :func:`aggregate_loss` returns ``(loss_sum, denominator)`` and the global loss is ``sum
loss_sum / sum denominator`` (:func:`combine`), never a mean of means; the denominator depends only on masks
(:func:`loss_denominator`).

Sources: GRPO (arXiv 2402.03300, eq. 3); DPPO (arXiv 2602.04879: unnormalised group advantages, truncated IS); PPO
clip (arXiv 1707.06347, eq. 7); dual clip (arXiv 1912.09729, eq. 5); clip-higher and token-mean (DAPO, arXiv
2503.14476, eq. 8-10); seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783); KL estimators k1/k2/k3 (J. Schulman,
"Approximating KL Divergence", 2020) with k2's gradient (verl PR #2953)."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# |log pi - log mu| is clamped to LOG_RATIO_CLAMP before every exp (defined once, in trust_region).
from pdm_jax.rl.trust_region import LOG_RATIO_CLAMP

__all__ = [
    "AGGREGATION_MODES",
    "KL_KINDS",
    "LOSS_TYPES",
    "LOG_RATIO_CLAMP",
    "validate_rewards",
    "MAX_ABS_REWARD",
    "group_advantages",
    "safe_log_ratio",
    "tis_policy_loss",
    "ppo_clip_policy_loss",
    "kl_penalty",
    "aggregate_loss",
    "loss_denominator",
    "combine",
    "broadcast_advantages",
]

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k2", "k3")
LOSS_TYPES = ("tis", "ppo_clip")



# ---- Advantages ------------------------------------------------------------------------------------------


def _check_group_size(num_samples: int, group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    group_size = int(group_size)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if num_samples % group_size != 0:
        raise ValueError(
            f"number of rewards N={num_samples} is not divisible by group_size={group_size}"
        )
    return group_size


MAX_ABS_REWARD = 1e30
"""Largest reward magnitude ``validate_rewards`` accepts: group differences r - mean
(up to 2x this) stay finite in float32 (max 3.4e38)."""


def validate_rewards(rewards, group_size: Optional[int] = None) -> np.ndarray:
    """Host-side check of verifier rewards before they enter a jitted step.

    Args:
      rewards: array-like ``[N]`` float rewards, prompt-major (row ``i * G + j`` is sample ``j`` of prompt ``i``).
      group_size: G; when given, N must be divisible by it and errors name the group of a bad sample.

    Returns:
      The rewards as a float32 numpy array ``[N]``.

    Raises:
      ValueError: not 1-D; N not divisible by ``group_size`` (naming both); a NaN, +-inf or |r| >
        ``MAX_ABS_REWARD`` reward (naming the first sample index, its group and value, and the count)."""
    arr = np.asarray(rewards, dtype=np.float64)  # checked before the float32 cast (1e39 is finite here)
    if arr.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {arr.shape}")
    if group_size is not None:
        group_size = _check_group_size(arr.shape[0], group_size)
    def where(i):
        w = f"sample index {i}"
        if group_size is not None:
            w += f" (group {i // group_size}, sample {i % group_size} within the group)"
        return w

    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"non-finite reward {float(arr[i])!r} at {where(i)}; {bad.size} non-finite reward(s) in total"
        )
    huge = np.flatnonzero(np.abs(arr) > float(np.float32(MAX_ABS_REWARD)))  # float32(1e30) itself passes
    if huge.size:
        i = int(huge[0])
        raise ValueError(
            f"reward {float(arr[i])!r} at {where(i)} exceeds |r| <= {MAX_ABS_REWARD:g} "
            f"(MAX_ABS_REWARD: beyond it float32 advantages r - mean can overflow); "
            f"{huge.size} such reward(s) in total; scale the verifier's rewards")
    return arr.astype(np.float32)


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> jax.Array:
    """Group-relative advantages A_ij = r_ij - mean_j r_ij, optionally / (std_j r_ij + eps) (population std).

    DPPO uses no std normalisation (the default); GRPO (arXiv 2402.03300, section 4.1.2) divides by the std. A group
    of equal rewards gets exactly 0.

    Args:
      rewards: ``[N]`` float, prompt-major; checked by :func:`validate_rewards` when concrete (call it on the host
        before ``jit``).
      group_size: G (static Python int).
      normalize_std: divide by the group std + ``eps``.
      eps: > 0.

    Returns:
      ``[N]`` float32 advantages.

    Raises:
      ValueError: rewards not 1-D; N not divisible by ``group_size``; bad ``group_size`` or ``eps``; with concrete
        rewards a NaN/inf reward or |r| > ``MAX_ABS_REWARD`` (naming the sample index and group)."""
    if not isinstance(rewards, jax.core.Tracer):
        validate_rewards(rewards, group_size)
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
    group_size = _check_group_size(rewards.shape[0], group_size)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    r_PxG = rewards.reshape(-1, group_size)
    # Groups with max |r| > 1e15 are scaled down by a power of two <= 2**100 (exact, and its reciprocal stays a normal
    # float32), so the mean's sum and the variance's squares cannot overflow; other groups use scale 1 (bit-identical).
    max_abs_Px1 = jnp.max(jnp.abs(r_PxG), axis=1, keepdims=True)
    scale_Px1 = jnp.where(max_abs_Px1 > 1e15,
                          jnp.exp2(jnp.minimum(jnp.ceil(jnp.log2(max_abs_Px1)), 100.0)), 1.0)
    scaled_PxG = r_PxG / scale_Px1
    centred_PxG = scaled_PxG - jnp.mean(scaled_PxG, axis=1, keepdims=True)
    if normalize_std:
        std_Px1 = jnp.sqrt(jnp.mean(jnp.square(centred_PxG), axis=1, keepdims=True))
        centred_PxG = centred_PxG / (std_Px1 + eps / scale_Px1)
    else:
        centred_PxG = centred_PxG * scale_Px1
    all_equal_Px1 = jnp.max(r_PxG, axis=1, keepdims=True) == jnp.min(r_PxG, axis=1, keepdims=True)
    adv_PxG = jnp.where(all_equal_Px1, 0.0, centred_PxG)
    return adv_PxG.reshape(-1)


# ---- Per-token policy losses -----------------------------------------------------------------------------


def broadcast_advantages(advantages, shape) -> jax.Array:
    """Advantages ``[B]`` or ``[B,T]`` as an f32 ``[B,T]`` array; ValueError for any other shape."""
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1:
        if adv.shape[0] != shape[0]:
            raise ValueError(f"advantages shape {adv.shape} does not match batch size B={shape[0]}")
        adv = adv[:, None]
    elif adv.shape != tuple(shape):
        raise ValueError(f"advantages must be [B] or [B,T]={tuple(shape)}, got shape {adv.shape}")
    return jnp.broadcast_to(adv, shape)


def _check_same_shape(**arrays):
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items() if v is not None}
    ref_name, ref = next(iter(shapes.items()))
    if len(ref) != 2:
        raise ValueError(f"{ref_name} must be [B,T], got shape {ref}")
    for k, s in shapes.items():
        if s != ref:
            raise ValueError(f"{k} shape {s} != {ref_name} shape {ref}")
    return ref


def _sanitize(x, mask, fill=0.0):
    """f32 copy of x with masked-out entries replaced by ``fill`` (before any math)."""
    x = jnp.asarray(x, jnp.float32)
    if mask is None:
        return x
    return jnp.where(mask, x, fill)


def safe_log_ratio(logprobs, behavior_logprobs, clamp: float = LOG_RATIO_CLAMP) -> jax.Array:
    """log pi - log mu clamped to [-clamp, clamp] (default :data:`LOG_RATIO_CLAMP`), f32 of the input shape.

    NaN stays NaN (mask it first); ``log mu = -inf`` gives ``+clamp``."""
    lr = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(behavior_logprobs, jnp.float32)
    return jnp.clip(lr, -clamp, clamp)


def tis_policy_loss(
    logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tis_cap: float,
) -> jax.Array:
    """Truncated-importance-sampling policy-gradient loss per token.

    loss_t = -A_t * sg(min(r_t, C)) * M_t * log pi(y_t), r_t = pi(y_t)/mu(y_t) (DESIGN.md section 2; DPPO arXiv
    2602.04879; PDM arXiv 2607.10848); its logit gradient is -A_t * min(r_t, C) * M_t * (e_k - pi_t). The ratio is
    ``exp(min(log pi - log mu, log C))``, so no ``inf`` appears, also for ``log mu = -inf``.

    Args:
      logprobs: ``[B,T]`` log pi(y_t) (differentiable).
      behavior_logprobs: ``[B,T]`` log mu(y_t).
      advantages: ``[B]`` or ``[B,T]``.
      mask: ``[B,T]`` bool M_t; masked positions give exactly 0 loss and gradient.
      tis_cap: C > 0, the truncation (typically 2-10).

    Returns:
      ``[B,T]`` float32 per-token loss (aggregate with :func:`aggregate_loss`).

    Raises:
      ValueError: shape mismatch or ``tis_cap`` not a finite float > 0."""
    if not (isinstance(tis_cap, (int, float)) and tis_cap > 0 and math.isfinite(tis_cap)):
        raise ValueError(f"tis_cap must be a finite float > 0, got {tis_cap!r}")
    shape = _check_same_shape(logprobs=logprobs, behavior_logprobs=behavior_logprobs, mask=mask)
    mask = jnp.asarray(mask).astype(bool)
    logp = _sanitize(logprobs, mask)
    behavior_logp = _sanitize(behavior_logprobs, mask)
    adv = _sanitize(broadcast_advantages(advantages, shape), mask)
    log_ratio = jnp.minimum(logp - behavior_logp, math.log(tis_cap))
    truncated_ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    # pi(y) = 0 gives min(r, C) = 0: the token contributes 0 (not -A * 0 * -inf = NaN).
    live = mask & (truncated_ratio > 0)
    loss = -adv * truncated_ratio * jnp.where(live, logp, 0.0)
    return jnp.where(live, loss, 0.0)


def ppo_clip_policy_loss(
    logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: Optional[float] = None,
    mask: Optional[jax.Array] = None,
) -> jax.Array:
    """PPO clipped surrogate per token, with clip-higher and optional dual clip.

    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) (PPO eq. 7, DAPO's decoupled eps); with
    ``dual_clip`` c > 1 a token with A_t < 0 uses min(loss_t, -c A_t) (Ye et al. 2020, eq. 5). r_t =
    exp(:func:`safe_log_ratio`).

    Args:
      logprobs: ``[B,T]`` log pi(y_t) (differentiable).
      behavior_logprobs: ``[B,T]`` log mu(y_t) (PPO's "old" policy).
      advantages: ``[B]`` or ``[B,T]``.
      clip_eps_low: in [0, 1). clip_eps_high: >= 0.
      dual_clip: None or c > 1.
      mask: optional ``[B,T]`` bool; masked positions give exactly 0 loss and gradient. Without it pads must be
        finite.

    Returns:
      ``[B,T]`` float32 per-token loss.

    Raises:
      ValueError: bad eps/dual_clip (naming the field and value) or shapes."""
    if not (0.0 <= clip_eps_low < 1.0):
        raise ValueError(f"clip_eps_low must be in [0, 1), got {clip_eps_low!r}")
    if not (clip_eps_high >= 0.0 and math.isfinite(clip_eps_high)):
        raise ValueError(f"clip_eps_high must be a finite float >= 0, got {clip_eps_high!r}")
    if dual_clip is not None and not (dual_clip > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(f"dual_clip must be None or a finite float > 1, got {dual_clip!r}")
    shape = _check_same_shape(logprobs=logprobs, behavior_logprobs=behavior_logprobs, mask=mask)
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    logp = _sanitize(logprobs, mask)
    behavior_logp = _sanitize(behavior_logprobs, mask)
    adv = _sanitize(broadcast_advantages(advantages, shape), mask)
    ratio = jnp.exp(safe_log_ratio(logp, behavior_logp))
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = jnp.maximum(-adv * ratio, -adv * clipped_ratio)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
    if mask is not None:
        loss = jnp.where(mask, loss, 0.0)
    return loss


def kl_penalty(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    kind: str = "k3",
    *,
    mask: Optional[jax.Array] = None,
    behavior_logprobs: Optional[jax.Array] = None,
    is_cap: Optional[float] = None,
) -> jax.Array:
    """Per-token KL(pi || pi_ref) penalty at the sampled token (the caller applies beta).

    With d = log pi_ref(y) - log pi(y) (clamped to +-:data:`LOG_RATIO_CLAMP`) the values are (J. Schulman, 2020) k1 =
    -d (unbiased, can be negative), k2 = d^2 / 2 (>= 0, second-order), k3 = exp(d) - d - 1 (unbiased, >= 0; GRPO eq.
    4). Whatever ``kind``, the gradient is k2's (``k + k2 - sg(k2)``), whose expectation under pi is grad_z KL(pi ||
    pi_ref); k1's has expectation 0 and k3's is the forward KL's (verl PR #2953 "k1+"/"k3+"). With
    ``behavior_logprobs`` each token is weighted by w = sg(min(pi/mu, C)), C = ``is_cap``, making the expectation
    over y ~ mu the one over pi while pi/mu <= C (capped tokens count C mu(y) < pi(y)); without, w = 1. DESIGN.md
    section 2.

    Args:
      logprobs: ``[B,T]`` log pi(y_t) (differentiable).
      ref_logprobs: ``[B,T]`` log pi_ref(y_t).
      kind: "k1" | "k2" | "k3", the estimator whose *value* is returned.
      mask: optional ``[B,T]`` bool; masked positions give exactly 0 and a 0 gradient.
      behavior_logprobs: optional ``[B,T]`` log mu(y_t).
      is_cap: C > 0 (finite), required with ``behavior_logprobs``.

    Returns:
      ``[B,T]`` float32 w * k_kind (gradient w * grad k2).

    Raises:
      ValueError: unknown ``kind``, shape mismatch, or ``behavior_logprobs`` without a finite ``is_cap`` > 0."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask, behavior_logprobs=behavior_logprobs)
    if behavior_logprobs is not None and not (
            isinstance(is_cap, (int, float)) and not isinstance(is_cap, bool) and is_cap > 0
            and math.isfinite(is_cap)):
        raise ValueError(f"is_cap must be a finite float > 0 with behavior_logprobs, got {is_cap!r}")
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    logp = _sanitize(logprobs, mask)
    ref_logp = _sanitize(ref_logprobs, mask)
    d = safe_log_ratio(ref_logp, logp)
    k2 = 0.5 * jnp.square(d)
    if kind == "k1":
        value = -d
    elif kind == "k2":
        value = k2
    else:
        value = jnp.expm1(d) - d
    kl = k2 if kind == "k2" else jax.lax.stop_gradient(value) + (k2 - jax.lax.stop_gradient(k2))
    if behavior_logprobs is not None:
        behavior_logp = _sanitize(behavior_logprobs, mask)
        weight = jax.lax.stop_gradient(jnp.exp(jnp.minimum(logp - behavior_logp, math.log(is_cap))))
        kl = weight * kl
    if mask is not None:
        kl = jnp.where(mask, kl, 0.0)
    return kl


# ---- Aggregation (exact under micro-batching) ------------------------------------------------------------


def _check_mode(mode: str, max_response_length):
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregation mode must be one of {AGGREGATION_MODES}, got {mode!r}")
    if max_response_length is not None and (
        isinstance(max_response_length, bool)
        or not isinstance(max_response_length, (int, np.integer))
        or max_response_length < 1
    ):
        raise ValueError(f"max_response_length must be None or an int >= 1, got {max_response_length!r}")


def loss_denominator(
    valid_mask: jax.Array, mode: str, *, max_response_length: Optional[int] = None
) -> jax.Array:
    """The denominator of :func:`aggregate_loss` alone, a float32 scalar (depends only on the mask).

    token_mean: valid tokens; seq_mean_token_mean: sequences with >= 1 valid token; seq_mean_token_sum_norm: that
    times ``max_response_length`` (default T; pass the generation budget when micro-batches differ in T).

    Raises:
      ValueError: unknown ``mode`` or bad ``max_response_length``."""
    _check_mode(mode, max_response_length)
    valid_mask = jnp.asarray(valid_mask).astype(bool)
    if valid_mask.ndim != 2:
        raise ValueError(f"valid_mask must be [B,T], got shape {valid_mask.shape}")
    if mode == "token_mean":
        return jnp.sum(valid_mask, dtype=jnp.float32)
    num_seqs = jnp.sum(jnp.any(valid_mask, axis=1), dtype=jnp.float32)
    if mode == "seq_mean_token_mean":
        return num_seqs
    length = valid_mask.shape[1] if max_response_length is None else int(max_response_length)
    return num_seqs * jnp.float32(length)


def aggregate_loss(
    per_token_loss: jax.Array,
    valid_mask: jax.Array,
    mode: str,
    *,
    max_response_length: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
    """Reduce a ``[B,T]`` per-token loss to ``(loss_sum, denominator)``, two float32 scalars.

    ``mode``: ``"token_mean"`` (DAPO eq. 10) sum l v / sum v; ``"seq_mean_token_mean"`` (GRPO eq. 3) sum_b [sum_t l v
    / sum_t v] / #sequences with a valid token; ``"seq_mean_token_sum_norm"`` (Dr. GRPO) sum l v / (#sequences *
    max_response_length). :func:`combine` is exact for token_mean under any split of the tokens and for the sequence
    modes under sequence-aligned splits. Masked positions add exactly 0 in value even over NaN (not in gradient: pass
    ``mask`` to the loss functions).

    Args:
      per_token_loss: ``[B,T]`` float.
      valid_mask: ``[B,T]`` bool, True on real completion tokens.
      mode: one of :data:`AGGREGATION_MODES`.
      max_response_length: for ``seq_mean_token_sum_norm`` (default T).

    Raises:
      ValueError: unknown ``mode``, bad ``max_response_length`` or shapes."""
    _check_mode(mode, max_response_length)
    _check_same_shape(per_token_loss=per_token_loss, valid_mask=valid_mask)
    valid_mask = jnp.asarray(valid_mask).astype(bool)
    loss = _sanitize(per_token_loss, valid_mask)
    denominator = loss_denominator(valid_mask, mode, max_response_length=max_response_length)
    if mode == "seq_mean_token_mean":
        tokens_per_seq = jnp.sum(valid_mask, axis=1, dtype=jnp.float32)
        per_seq = jnp.sum(loss, axis=1) / jnp.maximum(tokens_per_seq, 1.0)
        return jnp.sum(per_seq), denominator
    return jnp.sum(loss), denominator


def token_loss_weights(valid_mask: jax.Array, mode: str, *, max_response_length: Optional[int] = None) -> jax.Array:
    """``[B,T]`` f32 weights w with ``sum(w * l)`` = :func:`aggregate_loss`'s ``loss_sum / denominator``.

    token_mean ``v / #valid``; seq_mean_token_mean ``v / (#tokens of the row x #sequences)``; seq_mean_token_sum_norm
    ``v / (#sequences x max_response_length)``; 0 when the denominator is 0. The packed step (``pdm_jax.rl.packing``)
    weights each position by its token's w, so any split of the tokens gives the padded loss and gradient.

    Raises:
      ValueError: as :func:`loss_denominator`."""
    valid_mask = jnp.asarray(valid_mask).astype(bool)
    denominator = loss_denominator(valid_mask, mode, max_response_length=max_response_length)
    per_token = jnp.ones(valid_mask.shape, jnp.float32)
    if mode == "seq_mean_token_mean":
        per_token = per_token / jnp.maximum(jnp.sum(valid_mask, axis=1, dtype=jnp.float32), 1.0)[:, None]
    return jnp.where(valid_mask & (denominator > 0), per_token / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def combine(loss_sums, denominators) -> jax.Array:
    """Global loss ``sum(loss_sums) / sum(denominators)`` from per-micro-batch pairs, a float32 scalar; 0 (not NaN) when
    the total denominator is 0. Takes scalars or stacked ``[num_micro_batches]`` arrays, inside or outside ``jit``."""
    total = jnp.sum(jnp.stack([jnp.asarray(s, jnp.float32) for s in loss_sums]))
    denom = jnp.sum(jnp.stack([jnp.asarray(d, jnp.float32) for d in denominators]))
    return jnp.where(denom > 0, total / jnp.where(denom > 0, denom, 1.0), 0.0)
