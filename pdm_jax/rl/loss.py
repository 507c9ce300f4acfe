"""The RL policy loss in one place: per-token loss, its aggregation and the RL metrics.

:func:`token_terms` turns tempered logits (z/τ) of a block of positions (all ``[B,T,V]``, from
``pdm_jax.rl.train_step.make_rl_loss``, or a ``[B,c,V]`` chunk, from ``pdm_jax.rl.chunked_loss``) into the mask and
log π(y_t) (ONE log-softmax), the per-token loss, entropy and top-K KL; :func:`loss_and_metrics` reduces the whole
batch's terms (``objectives.aggregate_loss``, exact under any split of the positions) to the loss and the step's
metrics. Per-token loss (DESIGN.md §2): truncated IS ``-A sg(min(r, C)) M log π(y_t)`` (DPPO arXiv 2602.04879; PDM
arXiv 2607.10848) or the PPO clipped surrogate (arXiv 1707.06347 eq. 7, DAPO clip-higher, dual clip arXiv 1912.09729
eq. 5) times M unless M is PPO's own clip, plus ``kl_beta`` times ``objectives.kl_penalty``. Shapes: B sequences, T
positions, V vocabulary, K top-K; all outputs float32."""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from pdm_jax.rl import objectives, trust_region

_F32 = jnp.float32
POLICY_LOSSES = objectives.LOSS_TYPES


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static settings of the RL loss (hashable, closed over by the jitted step), built by
    ``pdm_jax.config.step_configs`` from ``rl.*`` and ``trust_region.clip_eps_*``.

    - ``policy_loss``: "tis" (truncated IS) | "ppo_clip"; ``tis_cap``: C > 0 (finite), the IS truncation;
    - ``clip_eps_low`` in [0, 1), ``clip_eps_high`` >= 0: the PPO clip; ``dual_clip``: 0 (off) or c > 1;
    - ``loss_aggregation``: one of ``objectives.AGGREGATION_MODES``; ``max_response_length``: tokens, Dr. GRPO's
      normaliser;
    - ``kl_beta`` >= 0, ``kl_estimator`` ("k1" | "k2" | "k3"): the penalty to π_ref (``objectives.kl_penalty``);
    - ``temperature`` τ > 0: logits are divided by it before every log-softmax (DESIGN.md §1);
    - ``logits_chunk_size``: 0 = all ``[B,T,V]`` logits at once, c > 0 = ``pdm_jax.rl.chunked_loss``;
    - ``micro_batch_size``: 0 = one forward/backward, m > 0 = exact accumulation over micro-batches of m sequences
      (of m packed rows with ``pack_sequences``, ``pdm_jax.rl.packing``);
    - ``router_aux_loss_coef`` >= 0 (finite): Qwen3-MoE's load-balancing loss weight (0 = off; logged unscaled as
      ``router_aux_loss``).

    Raises:
      ValueError: a field out of range, named as the run config names it (``rl.<field>``)."""

    policy_loss: str = "tis"
    tis_cap: float = 5.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0
    loss_aggregation: str = "token_mean"
    max_response_length: int = 1
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    logits_chunk_size: int = 0
    micro_batch_size: int = 0
    router_aux_loss_coef: float = 0.0
    pack_sequences: bool = False

    def __post_init__(self):
        def need(ok, field, what):
            if not ok:
                raise ValueError(f"{field} = {getattr(self, field.split('.')[-1])!r}: {what}")

        need(self.policy_loss in POLICY_LOSSES, "rl.policy_loss", f"must be one of {POLICY_LOSSES}")
        need(self.tis_cap > 0 and math.isfinite(self.tis_cap), "rl.tis_cap", "C must be finite and > 0")
        need(not self.dual_clip or self.dual_clip > 1, "rl.dual_clip", "must be 0 (off) or > 1")
        need(self.temperature > 0 and math.isfinite(self.temperature), "rl.temperature",
             "must be finite and > 0 (the trust region compares tempered distributions)")
        need(self.kl_beta >= 0, "rl.kl_beta", "must be >= 0")
        need(self.kl_estimator in objectives.KL_KINDS, "rl.kl_estimator", f"must be one of {objectives.KL_KINDS}")
        need(self.loss_aggregation in objectives.AGGREGATION_MODES, "rl.loss_aggregation",
             f"must be one of {objectives.AGGREGATION_MODES}")
        need(not isinstance(self.logits_chunk_size, bool) and isinstance(self.logits_chunk_size, int)
             and self.logits_chunk_size >= 0, "rl.logits_chunk_size", "must be an int >= 0 (0 = unchunked)")
        need(not isinstance(self.micro_batch_size, bool) and isinstance(self.micro_batch_size, int)
             and self.micro_batch_size >= 0, "rl.micro_batch_size", "must be an int >= 0 (0 = no micro-batches)")
        need(isinstance(self.router_aux_loss_coef, (int, float)) and not isinstance(self.router_aux_loss_coef, bool)
             and math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0,
             "rl.router_aux_loss_coef", "must be a finite float >= 0 (0 = off)")
        need(isinstance(self.pack_sequences, bool), "rl.pack_sequences", "must be True or False")


def needs_separate_topk_kl(tr_config: trust_region.TrustRegionConfig) -> bool:
    """Whether the top-K KL metric must be computed on its own (the mask's divergence is not it)."""
    return not (tr_config.divergence == "topk_kl" and tr_config.mask in ("dppo", "pdm"))


def masked_mean(x, valid):
    """Mean of ``x`` over ``valid`` positions (0 when none): f32 scalar; NaN outside ``valid`` is ignored."""
    m = valid.astype(_F32)
    return jnp.sum(jnp.where(m > 0, x, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def per_token_policy_loss(logprobs, behavior_logprobs, advantages, mask, valid, loss_config: PolicyLossConfig, *,
                          ref_logprobs=None, mask_is_ppo_clip: bool = False):
    """Per-token RL loss and KL to the reference policy.

    Args:
      logprobs: ``[B,T]`` log π(y_t) at temperature τ (differentiable).
      behavior_logprobs: ``[B,T]`` log μ(y_t).
      advantages: ``[B]`` or ``[B,T]`` Â.
      mask: ``[B,T]`` bool trust-region mask M (AND-ed with ``valid``).
      valid: ``[B,T]`` bool, real completion tokens.
      loss_config: the static loss settings.
      ref_logprobs: ``[B,T]`` log π_ref(y_t); read only when ``kl_beta > 0``.
      mask_is_ppo_clip: M is PPO's ratio test, which the clipped surrogate already is.

    Returns:
      ``(per_token [B,T] f32, kl [B,T] f32)``: 0 (with 0 gradient) at invalid positions; kl is
      ``objectives.kl_penalty`` (zeros when ``kl_beta == 0``).

    Raises:
      ValueError: ``kl_beta > 0`` without ``ref_logprobs``, or shapes that disagree."""
    lc = loss_config
    if lc.policy_loss == "tis":
        per_token = objectives.tis_policy_loss(logprobs, behavior_logprobs, advantages, mask, tis_cap=lc.tis_cap)
    else:
        per_token = objectives.ppo_clip_policy_loss(
            logprobs, behavior_logprobs, advantages, clip_eps_low=lc.clip_eps_low, clip_eps_high=lc.clip_eps_high,
            dual_clip=lc.dual_clip if lc.dual_clip else None, mask=valid)
        if not mask_is_ppo_clip:
            per_token = jnp.where(mask, per_token, 0.0)
    kl = jnp.zeros_like(logprobs)
    if lc.kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError(f"rl.kl_beta = {lc.kl_beta} > 0 needs the batch's ref_logprobs (got None)")
        kl = objectives.kl_penalty(logprobs, ref_logprobs, kind=lc.kl_estimator, mask=valid,
                                   behavior_logprobs=behavior_logprobs, is_cap=lc.tis_cap)
        per_token = per_token + lc.kl_beta * kl
    return jnp.where(valid, per_token, 0.0), kl


@flax.struct.dataclass
class TokenInputs:
    """The per-token inputs of the mask and the loss for one block of positions, one pytree (a JAX dataclass), so that
    chunking (`pdm_jax.rl.chunked_loss`) and micro-batching map over it whole.

    ==================  ==========  =======  ===================================================================
    field               shape       dtype    meaning
    ==================  ==========  =======  ===================================================================
    tokens              [B, T]      int32    the sampled ids y_t
    valid               [B, T]      bool     valid completion tokens
    topk_ids            [B, T, K]   int32    the sampler's top-K ids
    topk_logprobs       [B, T, K]   float32  their log mu
    behavior_logprobs   [B, T]      float32  log mu(y_t)
    advantages          [B] or      float32  the sequence's (or each token's) advantage
                        [B, T]
    ref_logprobs        [B, T]      float32  log pi_ref(y_t), when ``kl_beta > 0``; else None
    param_direction     [B, T]      float32  Ḋᵖ, iff ``direction == "param_jvp"``; else None
    ==================  ==========  =======  ===================================================================
    """

    tokens: object
    valid: object
    topk_ids: object
    topk_logprobs: object
    behavior_logprobs: object
    advantages: object
    ref_logprobs: object = None
    param_direction: object = None

    @classmethod
    def of(cls, batch, *, param_direction=None) -> "TokenInputs":
        """The per-token fields of a ``StepBatch`` (or ``pdm_jax.rl.packing.PackedRows``): ``completion_ids`` are the
        tokens, ``completion_mask`` the valid positions."""
        return cls(tokens=batch.completion_ids, valid=batch.completion_mask, topk_ids=batch.topk_ids,
                   topk_logprobs=batch.topk_logprobs, behavior_logprobs=batch.behavior_logprobs,
                   advantages=batch.advantages, ref_logprobs=batch.ref_logprobs, param_direction=param_direction)


def token_terms(logits_tau, x: TokenInputs, tr_config: trust_region.TrustRegionConfig,
                loss_config: PolicyLossConfig) -> dict:
    """Everything per token of one block of positions (the whole completion or one chunk).

    Args:
      logits_tau: ``[B,T,V]`` f32 trainer logits divided by τ (differentiable).
      x: the block's `TokenInputs`.
      tr_config, loss_config: static settings.

    Returns:
      dict of ``[B,T]`` f32 arrays ``per_token`` (loss), ``logprobs`` (log π(y_t), 0 where invalid), ``kl``,
      ``entropy`` (nats, of softmax(z/τ)), ``topk_kl`` (only when :func:`needs_separate_topk_kl`), ``mask`` (bool
      M_t) and ``stats`` (of ``trust_region_mask_and_logprobs``)."""
    # One log-softmax gives the mask (under stop_gradient) and the differentiable log π(y_t), with padded / non-finite
    # positions replaced before the math (no NaN in loss or gradient).
    mask, logprobs, stats = trust_region.trust_region_mask_and_logprobs(
        logits_tau, x.tokens, x.topk_ids, x.topk_logprobs, x.behavior_logprobs, x.advantages, x.valid, tr_config,
        param_direction=x.param_direction)
    per_token, kl = per_token_policy_loss(logprobs, x.behavior_logprobs, x.advantages, mask, x.valid, loss_config,
                                          ref_logprobs=x.ref_logprobs, mask_is_ppo_clip=tr_config.mask == "ppo")
    logits_sg = jax.lax.stop_gradient(logits_tau)
    logp_sg = jax.nn.log_softmax(logits_sg, axis=-1)
    out = dict(per_token=per_token, logprobs=logprobs, mask=mask, kl=kl, stats=stats,
               entropy=-jnp.sum(jnp.exp(logp_sg) * logp_sg, axis=-1))
    if needs_separate_topk_kl(tr_config):  # always report the top-K KL, whatever the proximity test
        out["topk_kl"] = trust_region.topk_kl(logits_sg, x.tokens, x.topk_ids, x.topk_logprobs, x.behavior_logprobs)
    return out


def combine_stats(stats_N: dict) -> dict:
    """Whole-batch trust-region statistics from those of N disjoint parts (``[N]`` arrays per key), as
    ``trust_region_mask_and_logprobs`` computes them on the whole batch: ``num_*`` summed, ``frac_*`` weighted by
    ``num_valid``, ``mean_*`` by ``num_valid - num_nonfinite - num_bad_ids``.

    Raises:
      ValueError: a statistic without a num_/frac_/mean_ prefix."""
    n_valid_N = stats_N["num_valid"]
    n_good_N = n_valid_N - stats_N["num_nonfinite"] - stats_N["num_bad_ids"]
    total_valid = jnp.sum(n_valid_N)
    total_good = jnp.sum(n_good_N)
    out = {}
    for key, v_N in stats_N.items():
        if key.startswith("num_"):
            out[key] = jnp.sum(v_N)
        elif key.startswith("frac_"):
            out[key] = jnp.sum(v_N * jnp.maximum(n_valid_N, 1.0)) / jnp.maximum(total_valid, 1.0)
        elif key.startswith("mean_"):
            out[key] = jnp.sum(v_N * jnp.maximum(n_good_N, 1.0)) / jnp.maximum(total_good, 1.0)
        else:
            raise ValueError(f"cannot recombine the trust-region statistic {key!r} (expected a num_/frac_/mean_ "
                             "prefix)")
    return out


def loss_and_metrics(terms: dict, valid, behavior_logprobs, advantages, loss_config: PolicyLossConfig):
    """The aggregated loss and the RL metrics from the whole batch's :func:`token_terms`.

    Args:
      terms: :func:`token_terms` over all ``[B,T]`` positions (``stats`` recombined when chunked).
      valid: ``[B,T]`` bool; behavior_logprobs ``[B,T]``; advantages ``[B]`` or ``[B,T]``.
      loss_config: aggregation mode and its normaliser.

    Returns:
      ``(loss, metrics)``: loss = loss_sum / denominator (0, not NaN, for an all-padding batch); f32 scalar metrics,
        means
      over valid tokens: the trust-region statistics, ``mean_topk_kl`` and ``entropy`` (nats), ``mean_ratio``,
      ``mean_abs_log_ratio``, ``frac_tis_capped`` (r > C), ``frac_clipped``, ``kl_to_ref``, ``policy_loss``; with
      ``param_jvp`` also ``frac_outside_kept``."""
    lc = loss_config
    loss_sum, denom = objectives.aggregate_loss(terms["per_token"], valid, lc.loss_aggregation,
                                                max_response_length=lc.max_response_length)
    loss = objectives.combine([loss_sum], [denom])
    log_ratio = jnp.where(valid, terms["logprobs"] - behavior_logprobs, 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -trust_region.LOG_RATIO_CLAMP, trust_region.LOG_RATIO_CLAMP))
    adv = jnp.where(valid, objectives.broadcast_advantages(advantages, valid.shape), 0.0)
    clipped = ((ratio > 1.0 + lc.clip_eps_high) & (adv > 0)) | ((ratio < 1.0 - lc.clip_eps_low) & (adv < 0))
    metrics = dict(terms["stats"])
    if "num_outside_kept" in metrics:  # param_jvp: the kept fraction of the out-of-region tokens
        kept, outside = metrics.pop("num_outside_kept"), metrics.pop("num_outside")
        metrics["frac_outside_kept"] = kept / jnp.maximum(outside, 1.0)
    stats = terms["stats"]
    metrics["mean_topk_kl"] = masked_mean(terms["topk_kl"], valid) if "topk_kl" in terms \
        else stats["mean_divergence"]
    metrics.update(
        entropy=masked_mean(terms["entropy"], valid),
        mean_ratio=masked_mean(ratio, valid),
        mean_abs_log_ratio=masked_mean(jnp.abs(log_ratio), valid),
        frac_tis_capped=masked_mean((ratio > lc.tis_cap).astype(_F32), valid),
        frac_clipped=masked_mean(clipped.astype(_F32), valid),
        kl_to_ref=masked_mean(terms["kl"], valid),
        policy_loss=loss,
    )
    return loss, metrics
