"""Pure train steps: the GRPO policy update with a trust-region mask, and SFT.

`train_step(state, batch) -> (state, metrics)` is a pure function (DESIGN.md §3):
no I/O, no services; the loop in `pdm_jax.trainer` owns side effects and jits
it with explicit in/out shardings on the mesh. ``batch`` is a
`pdm_jax.rollout.StepBatch` (its docstring gives every field's shape and dtype).
The RL loss itself (per-token loss, aggregation, metrics) is `pdm_jax.loss`;
this module runs the model and the optimizer around it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pdm_jax import chunked_loss, loss as policy_loss, trust_region
from pdm_jax.rollout import StepBatch


@flax.struct.dataclass
class TrainState:
    """Optimizer step counter, model parameters (an nnx.State of Params) and optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings of one phase (built from ``rl.*`` or ``sft.*`` by ``pdm_jax.config.step_configs``).

    ``learning_rate`` is the peak rate per optimizer step, reached after
    ``warmup_steps`` linear warm-up steps; ``max_grad_norm`` <= 0 disables clipping.
    """

    learning_rate: float
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0
    warmup_steps: int = 0

    def build(self):
        """``(optax transformation, learning-rate schedule)`` (see :func:`make_optimizer`)."""
        return make_optimizer(self.learning_rate, weight_decay=self.weight_decay, b1=self.b1, b2=self.b2,
                              max_grad_norm=self.max_grad_norm, warmup_steps=self.warmup_steps)


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


def make_rl_loss(graphdef, tr_config: trust_region.TrustRegionConfig, loss_config: policy_loss.PolicyLossConfig):
    """Returns ``loss_fn(params, batch: StepBatch) -> (loss, metrics)`` for the GRPO policy update.

    The per-token loss, its aggregation and the metrics are `pdm_jax.loss`
    (``token_terms`` then ``loss_and_metrics``) on all ``[B,T,V]`` logits at once;
    with ``loss_config.logits_chunk_size`` = c > 0 the same terms are computed by
    ``pdm_jax.chunked_loss`` c sequence positions at a time (same loss and gradient).
    """
    if loss_config.logits_chunk_size > 0:  # same values, never all [B,T,V] logits at once
        return chunked_loss.make_chunked_rl_loss(graphdef, tr_config, loss_config, loss_config.logits_chunk_size)

    def loss_fn(params, batch: StepBatch):
        logits = completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask) / loss_config.temperature
        valid = batch.completion_mask
        terms = policy_loss.token_terms(logits, batch.completion_ids, valid, batch.topk_ids, batch.topk_logprobs,
                                        batch.behavior_logprobs, batch.advantages, tr_config, loss_config,
                                        ref_logprobs=batch.ref_logprobs)
        return policy_loss.loss_and_metrics(terms, valid, batch.behavior_logprobs, batch.advantages, loss_config)

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

    batch: a `StepBatch` with prompt_ids [B,P], prompt_mask [B,P], completion_ids [B,T],
    completion_mask [B,T] (the reference answer and the stop token); RL fields None. The loss
    is the token-mean negative log-likelihood of the completion tokens (nats).
    """

    def loss_fn(params, batch: StepBatch):
        logits = completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask)
        logprobs = trust_region.token_logprobs(logits, batch.completion_ids)
        valid = batch.completion_mask
        nll = -policy_loss.masked_mean(logprobs, valid)
        correct = jnp.argmax(logits, axis=-1) == batch.completion_ids
        return nll, dict(token_accuracy=policy_loss.masked_mean(correct.astype(jnp.float32), valid))

    return _gradient_step(loss_fn, tx)


def make_logprob_fn(graphdef, temperature: float) -> Callable:
    """Returns f(params, batch) -> log pi(y_t) [B,T] f32 at temperature tau (for reference policies)."""

    def f(params, batch: StepBatch):
        logits = completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask) / temperature
        return trust_region.token_logprobs(logits, batch.completion_ids)

    return f
