"""Pure, jitted train steps: the GRPO policy update with a trust-region mask, and SFT.

`train_step(state, batch) -> (state, metrics)` is a pure function (DESIGN.md §3):
no I/O, no services; the loop in `pdm_jax.trainer` owns side effects. Both
steps are compiled with explicit in/out shardings on the mesh by
`jit_train_step`.

Batch layout (device arrays; B sequences, P prompt length, T completion length,
K top-K):

=================  ============  ========  ==========================================
key                shape         dtype     meaning
=================  ============  ========  ==========================================
prompt_ids         [B, P]        int32     left-padded prompts
prompt_mask        [B, P]        bool
completion_ids     [B, T]        int32     right-padded completions (the tokens y_t)
completion_mask    [B, T]        bool      valid completion tokens
behavior_logprobs  [B, T]        float32   log mu(y_t) from the sampler
topk_ids           [B, T, K]     int32
topk_logprobs      [B, T, K]     float32
advantages         [B]           float32   group-relative advantages
ref_logprobs       [B, T]        float32   (only when kl_beta > 0) frozen reference log pi_ref(y_t)
=================  ============  ========  ==========================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pdm_jax import objectives, trust_region


@flax.struct.dataclass
class TrainState:
    """Optimizer step counter, model parameters (an nnx.State of Params) and optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static settings of the RL loss (hashable, closed over by the jitted step).

    Fields mirror `config.rl` (pdm_jax/config.py): `policy_loss` "tis" | "ppo_clip",
    `tis_cap` C > 0, `clip_eps_low/high`, `dual_clip` (0 = off, else > 1),
    `loss_aggregation`, `max_response_length` (for seq_mean_token_sum_norm),
    `kl_beta` >= 0 and `kl_estimator`, `temperature` tau > 0 (logits are divided
    by it before every log-softmax, DESIGN.md §1).
    """

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
    logits_chunk_size: int = 0  # > 0: pdm_jax.chunked_loss, logits [B,c,V] c positions at a time

    def __post_init__(self):
        if self.policy_loss not in ("tis", "ppo_clip"):
            raise ValueError(f"rl.policy_loss must be 'tis' or 'ppo_clip', got {self.policy_loss!r}")
        if not self.tis_cap > 0:
            raise ValueError(f"rl.tis_cap must be > 0, got {self.tis_cap}")
        if self.dual_clip and not self.dual_clip > 1:
            raise ValueError(f"rl.dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if not self.temperature > 0:
            raise ValueError(f"rl.temperature must be > 0, got {self.temperature}")
        if self.kl_beta < 0:
            raise ValueError(f"rl.kl_beta must be >= 0, got {self.kl_beta}")
        if isinstance(self.logits_chunk_size, bool) or not isinstance(self.logits_chunk_size, int) \
                or self.logits_chunk_size < 0:
            raise ValueError(f"rl.logits_chunk_size must be an int >= 0 (0 = unchunked), got {self.logits_chunk_size!r}")


def make_optimizer(learning_rate, *, weight_decay=0.0, b1=0.9, b2=0.999, max_grad_norm=1.0,
                   warmup_steps=0, total_steps=None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and linear warmup (then constant), from optax.

    `learning_rate` is the peak rate (per optimizer step). `max_grad_norm` <= 0
    disables clipping. Raises ValueError for a non-positive learning rate.
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if warmup_steps > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(learning_rate / max(warmup_steps, 1), learning_rate, warmup_steps),
             optax.constant_schedule(learning_rate)], [warmup_steps])
    else:
        schedule = optax.constant_schedule(learning_rate)
    parts = []
    if max_grad_norm and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts), schedule


def completion_logits(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Logits predicting each completion token: [B,T,V] float32.

    Runs the model on concat(prompt, completion) and keeps the positions
    P-1 .. P+T-2, whose next-token logits score completion tokens 0..T-1.
    """
    model = nnx.merge(graphdef, params)
    input_ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    attn = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    logits_BxLxV = model(input_ids, attention_mask=attn)
    p = prompt_ids.shape[1]
    t = completion_ids.shape[1]
    return logits_BxLxV[:, p - 1:p + t - 1].astype(jnp.float32)


def _entropy(logits_BxTxV):
    logp = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _masked_mean(x, m):
    m = m.astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def per_token_policy_loss(logprobs, behavior_logprobs, advantages, mask, valid, ref_logprobs,
                          tr_config, loss_config: "PolicyLossConfig"):
    """Per-token RL loss [B,T] (0 on padding) and KL-to-reference [B,T]; shared by the plain and chunked losses.

    Truncated IS -A sg(min(r,C)) M log pi, or the PPO clipped surrogate (multiplied by
    the mask unless the mask is PPO's own clip), plus kl_beta * KL(pi || pi_ref).
    `ref_logprobs` is only read when kl_beta > 0.
    """
    if loss_config.policy_loss == "tis":
        per_token = objectives.tis_policy_loss(logprobs, behavior_logprobs, advantages, mask,
                                               tis_cap=loss_config.tis_cap)
    else:
        per_token = objectives.ppo_clip_policy_loss(
            logprobs, behavior_logprobs, advantages, clip_eps_low=loss_config.clip_eps_low,
            clip_eps_high=loss_config.clip_eps_high,
            dual_clip=loss_config.dual_clip if loss_config.dual_clip else None, mask=valid)
        if tr_config.mask != "ppo":  # the PPO mask is the clip itself; keep the surrogate's value
            per_token = jnp.where(mask, per_token, 0.0)
    kl = jnp.zeros_like(logprobs)
    if loss_config.kl_beta > 0:
        kl = objectives.kl_penalty(logprobs, ref_logprobs, kind=loss_config.kl_estimator, mask=valid)
        per_token = per_token + loss_config.kl_beta * kl
    return jnp.where(valid, per_token, 0.0), kl


def rl_metrics(loss, tr_stats, valid, logprobs, behavior_logprobs, entropy, kl_to_ref, topk_kl=None) -> dict:
    """The RL step's metrics (f32 scalars, means over valid tokens), shared by the plain and chunked losses.

    Args: `tr_stats` from the trust-region mask; valid [B,T] bool; logprobs and
    behavior_logprobs [B,T] (log pi(y_t), log mu(y_t)); entropy and kl_to_ref
    [B,T]; topk_kl [B,T] or None when the configured divergence already is the
    top-K KL (then `mean_topk_kl` = tr_stats["mean_divergence"]).
    """
    log_ratio = jnp.where(valid, logprobs - behavior_logprobs, 0.0)
    aux = dict(tr_stats)
    aux["mean_topk_kl"] = tr_stats["mean_divergence"] if topk_kl is None else _masked_mean(topk_kl, valid)
    aux.update(
        entropy=_masked_mean(entropy, valid),
        mean_ratio=_masked_mean(jnp.exp(jnp.clip(log_ratio, -20.0, 20.0)), valid),
        mean_abs_log_ratio=_masked_mean(jnp.abs(log_ratio), valid),
        kl_to_ref=_masked_mean(kl_to_ref, valid),
        policy_loss=loss,
    )
    return aux


def make_rl_loss(graphdef, tr_config: trust_region.TrustRegionConfig, loss_config: PolicyLossConfig):
    """Returns loss_fn(params, batch) -> (loss, aux) for the GRPO policy update.

    loss = sum / denominator from `objectives.aggregate_loss` over the batch;
    the per-token loss is the truncated-IS loss -A sg(min(r,C)) M log pi(y_t)
    (DESIGN.md §2, with M the trust-region mask of `tr_config`) or the PPO
    clipped surrogate, plus kl_beta * KL(pi || pi_ref) when kl_beta > 0.
    With ``loss_config.logits_chunk_size`` = c > 0 the same loss is computed by
    ``pdm_jax.chunked_loss`` c sequence positions at a time.
    """
    if loss_config.logits_chunk_size > 0:  # same values, never all [B,T,V] logits at once
        from pdm_jax.chunked_loss import make_chunked_rl_loss

        return make_chunked_rl_loss(graphdef, tr_config, loss_config, loss_config.logits_chunk_size)
    tau = loss_config.temperature

    def loss_fn(params, batch):
        logits = completion_logits(graphdef, params, batch["prompt_ids"], batch["prompt_mask"],
                                   batch["completion_ids"], batch["completion_mask"]) / tau
        valid = batch["completion_mask"]
        tokens = batch["completion_ids"]
        adv_B = batch["advantages"]
        # One log-softmax gives the mask (under stop_gradient) and the differentiable log pi(y_t),
        # with padded / non-finite positions replaced before the math (no NaN in loss or gradient).
        mask, logprobs, tr_stats = trust_region.trust_region_mask_and_logprobs(
            logits, tokens, batch["topk_ids"], batch["topk_logprobs"],
            batch["behavior_logprobs"], adv_B, valid, tr_config)
        per_token, kl = per_token_policy_loss(logprobs, batch["behavior_logprobs"], adv_B, mask, valid,
                                              batch.get("ref_logprobs"), tr_config, loss_config)
        loss_sum, denom = objectives.aggregate_loss(
            per_token, valid, loss_config.loss_aggregation,
            max_response_length=loss_config.max_response_length)
        loss = objectives.combine([loss_sum], [denom])  # 0, not NaN, for an all-padding batch
        topk_kl = None
        if not (tr_config.divergence == "topk_kl" and tr_config.mask in ("dppo", "pdm")):
            # always report the top-K KL, whatever the configured proximity test
            topk_kl = trust_region.topk_kl(jax.lax.stop_gradient(logits), tokens, batch["topk_ids"],
                                           batch["topk_logprobs"], batch["behavior_logprobs"])
        return loss, rl_metrics(loss, tr_stats, valid, logprobs, batch["behavior_logprobs"],
                                _entropy(jax.lax.stop_gradient(logits)), kl, topk_kl)

    return loss_fn


def make_rl_train_step(graphdef, tx, tr_config, loss_config) -> Callable:
    """Returns the pure `train_step(state, batch) -> (state, metrics)` for RL (not yet jitted)."""
    return _gradient_step(make_rl_loss(graphdef, tr_config, loss_config), tx)


def _gradient_step(loss_fn, tx) -> Callable:
    """One optax step on `loss_fn(params, batch) -> (loss, aux)`; metrics = aux + loss + grad_norm."""

    def step(state: TrainState, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(aux, loss=loss, grad_norm=optax.tree.norm(grads))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return step


def make_sft_train_step(graphdef, tx) -> Callable:
    """Returns `sft_step(state, batch) -> (state, metrics)`: next-token cross-entropy on completions.

    batch: prompt_ids [B,P], prompt_mask [B,P], completion_ids [B,T],
    completion_mask [B,T] (the reference answer and the stop token). The loss
    is the token-mean negative log-likelihood of the completion tokens (nats).
    """

    def loss_fn(params, batch):
        logits = completion_logits(graphdef, params, batch["prompt_ids"], batch["prompt_mask"],
                                   batch["completion_ids"], batch["completion_mask"])
        logprobs = trust_region.token_logprobs(logits, batch["completion_ids"])
        valid = batch["completion_mask"]
        nll = -_masked_mean(logprobs, valid)
        correct = jnp.argmax(logits, axis=-1) == batch["completion_ids"]
        return nll, dict(token_accuracy=_masked_mean(correct.astype(jnp.float32), valid))

    return _gradient_step(loss_fn, tx)


def make_logprob_fn(graphdef, temperature: float) -> Callable:
    """Returns f(params, batch) -> log pi(y_t) [B,T] f32 at temperature tau (for reference policies)."""

    def f(params, batch):
        logits = completion_logits(graphdef, params, batch["prompt_ids"], batch["prompt_mask"],
                                   batch["completion_ids"], batch["completion_mask"]) / temperature
        return trust_region.token_logprobs(logits, batch["completion_ids"])

    return f
