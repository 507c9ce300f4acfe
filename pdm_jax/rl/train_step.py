"""Pure train steps: the GRPO policy update with a trust-region mask, and SFT.

`train_step(state, batch) -> (state, metrics)` is a pure function (DESIGN.md §3): no I/O, no services; the loop in
`pdm_jax.trainer` owns side effects and jits it with explicit in/out shardings on the mesh. ``batch`` is a
`pdm_jax.rl.step_batch.StepBatch` (its docstring gives every field's shape and dtype). The RL loss itself (per-token
loss, aggregation, metrics) is `pdm_jax.rl.loss`; this module runs the model and the optimizer around it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from pdm_jax.rl import chunked_loss, loss as policy_loss, objectives, packing, trust_region
from pdm_jax.rl.forward import completion_logits  # the analysis and the tests call it as train_step.completion_logits
from pdm_jax.rl.forward import packed_forward
from pdm_jax.rl.step_batch import StepBatch


@flax.struct.dataclass
class TrainState:
    """Optimizer step counter, model parameters (an nnx.State of Params) and optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings of one phase (``pdm_jax.config.step_configs`` from ``rl.*`` or ``sft.*``); see
    :func:`make_optimizer`."""

    learning_rate: float
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int = 0

    def build(self):
        """``(optax transformation, learning-rate schedule)`` (see :func:`make_optimizer`)."""
        return make_optimizer(self.learning_rate, weight_decay=self.weight_decay, b1=self.b1, b2=self.b2,
                              max_grad_norm=self.max_grad_norm, warmup_steps=self.warmup_steps,
                              lr_schedule=self.lr_schedule, total_steps=self.total_steps)


#: Learning-rate schedules after the warm-up (`make_optimizer`).
LR_SCHEDULES = ("constant", "cosine", "linear")


def make_optimizer(learning_rate, *, weight_decay=0.0, b1=0.9, b2=0.999, max_grad_norm=1.0,
                   warmup_steps=0, lr_schedule="constant",
                   total_steps=0) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with global-norm clipping and a linear warm-up, from optax; returns (the optimizer, its learning-rate
    schedule).

    `learning_rate` is the peak rate per optimizer step, reached after `warmup_steps`; `lr_schedule` "constant" holds
    it, "cosine" (`optax.cosine_decay_schedule`) and "linear" decay it to 0 at step `total_steps` (the warm-up
    included). `max_grad_norm` <= 0 disables clipping.

    Raises:
      ValueError: a non-positive learning rate; an unknown `lr_schedule`; a decaying schedule whose `total_steps`
        does not exceed `warmup_steps`."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
    if lr_schedule == "constant":
        after = optax.constant_schedule(learning_rate)
    elif total_steps <= warmup_steps:
        raise ValueError(f"lr_schedule {lr_schedule!r} decays over the phase's steps after the warm-up: total_steps "
                         f"= {total_steps} must exceed warmup_steps = {warmup_steps}")
    elif lr_schedule == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps)
    else:
        after = optax.linear_schedule(learning_rate, 0.0, total_steps - warmup_steps)
    if warmup_steps > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(learning_rate / max(warmup_steps, 1), learning_rate, warmup_steps), after],
            [warmup_steps])
    else:
        schedule = after
    parts = []
    if max_grad_norm and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts), schedule


def _with_router_aux(loss, metrics: dict, aux, loss_config) -> tuple:
    """Adds ``rl.router_aux_loss_coef`` x the router aux loss to `loss` and logs it as ``router_aux_loss`` (unscaled)
    when the model is MoE (`aux` not None)."""
    if aux is None:
        return loss, metrics
    return loss + loss_config.router_aux_loss_coef * aux, dict(metrics, router_aux_loss=aux)


def make_rl_terms(graphdef, tr_config: trust_region.TrustRegionConfig, loss_config: policy_loss.PolicyLossConfig):
    """``terms_fn(params, batch: StepBatch, param_direction=None) -> dict``: `pdm_jax.rl.loss.token_terms` of every
    position, on all ``[B,T,V]`` logits or, with ``logits_chunk_size`` = c > 0, c positions at a time
    (``pdm_jax.rl.chunked_loss``); ``param_direction`` ``[B,T]`` (Ḋᵖ) goes to the mask with ``direction ==
    "param_jvp"``."""
    if loss_config.logits_chunk_size > 0:  # same values, never all [B,T,V] logits at once
        return chunked_loss.make_chunked_rl_terms(graphdef, tr_config, loss_config, loss_config.logits_chunk_size)

    def terms_fn(params, batch: StepBatch, param_direction=None):
        logits, aux = completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                        batch.completion_mask, return_aux=True, routed_experts=batch.routed_experts)
        terms = policy_loss.token_terms(logits / loss_config.temperature,
                                        policy_loss.TokenInputs.of(batch, param_direction=param_direction),
                                        tr_config, loss_config)
        if aux is not None:  # Qwen3-MoE: the router load-balancing loss (a scalar, not a token term)
            terms["router_aux_loss"] = aux
        return terms

    return terms_fn


def make_rl_loss(graphdef, tr_config: trust_region.TrustRegionConfig, loss_config: policy_loss.PolicyLossConfig):
    """``loss_fn(params, batch: StepBatch, param_direction=None) -> (loss, metrics)`` of the GRPO policy update
    (:func:`make_rl_terms`, then ``loss.loss_and_metrics``)."""
    terms_fn = make_rl_terms(graphdef, tr_config, loss_config)

    def loss_fn(params, batch: StepBatch, param_direction=None):
        terms = terms_fn(params, batch, param_direction)
        aux = terms.pop("router_aux_loss", None)
        loss, metrics = policy_loss.loss_and_metrics(terms, batch.completion_mask, batch.behavior_logprobs,
                                                     batch.advantages, loss_config)
        return _with_router_aux(loss, metrics, aux, loss_config)

    return loss_fn


def make_rl_train_step(graphdef, tx, tr_config, loss_config) -> Callable:
    """The pure `train_step(state, batch) -> (state, metrics)` for RL (not yet jitted).

    ``micro_batch_size`` = m > 0 accumulates the gradient over micro-batches of m sequences
    (:func:`_micro_batched_grads`); ``direction == "param_jvp"`` takes the mask's direction along the unmasked update
    (:func:`_param_jvp_rl_step`); ``pack_sequences`` runs the model on packed rows (:func:`_packed_rl_step`, plus
    ``packed_fill``). Each gives the one-shot padded step's loss, gradient and metrics."""
    if loss_config.pack_sequences:
        if tr_config.uses_param_direction:
            raise ValueError("rl.pack_sequences is not implemented with trust_region.direction = param_jvp")
        return _packed_rl_step(graphdef, tx, tr_config, loss_config)
    if tr_config.uses_param_direction:
        return _param_jvp_rl_step(graphdef, tx, tr_config, loss_config)
    if loss_config.micro_batch_size > 0:
        terms_fn = make_rl_terms(graphdef, tr_config, loss_config)

        def step(state: TrainState, batch: StepBatch):
            grads, loss, aux = _micro_batched_grads(terms_fn, state.params, batch, loss_config)
            return _apply(tx, state, grads, dict(aux, loss=loss))

        return step
    return _gradient_step(make_rl_loss(graphdef, tr_config, loss_config), tx)


def _gradient_step(loss_fn, tx) -> Callable:
    """One optax step on `loss_fn(params, batch) -> (loss, aux)`; metrics = aux + loss + grad_norm."""

    def step(state: TrainState, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        return _apply(tx, state, grads, dict(aux, loss=loss))

    return step


def _apply(tx, state: TrainState, grads, metrics: dict):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _micro_split(x, m: int):
    """[B,...] -> [n, m, ...]: micro-batch j holds rows j, j + n, j + 2n, ... (n = B / m)."""
    return jnp.swapaxes(x.reshape((m, x.shape[0] // m) + x.shape[1:]), 0, 1)


def _micro_join(x_N):
    """Inverse of :func:`_micro_split`: [n, m, ...] -> [B, ...]."""
    return jnp.swapaxes(x_N, 0, 1).reshape((x_N.shape[0] * x_N.shape[1],) + x_N.shape[2:])


def _micro_count(batch: StepBatch, m: int) -> int:
    b = batch.num_sequences
    if b % m:
        raise ValueError(f"rl.micro_batch_size = {m} must divide the mini-batch of {b} sequences")
    return b // m


def _micro_batched_grads(terms_fn, params, batch: StepBatch, loss_config: policy_loss.PolicyLossConfig,
                         param_direction=None):
    """``(grads, loss, metrics)`` of one mini-batch, the gradient accumulated over micro-batches under ``lax.scan``.

    The denominator of the WHOLE mini-batch is computed first (masks only), so summing ``grad(loss_sum_mb) /
    denominator`` is exact for every aggregation mode. Micro-batch j takes rows j, j + n, ... (n = B / m), so every
    data shard feeds every micro-batch; the per-token terms are reassembled to ``[B,T]`` for
    ``loss.loss_and_metrics``; only one micro-batch's activations are alive at a time. ``param_direction`` ``[B,T]``
    is split with the batch.

    Raises:
      ValueError: B is not a multiple of ``micro_batch_size`` (at trace time)."""
    lc = loss_config
    m = lc.micro_batch_size
    n = _micro_count(batch, m)
    valid = batch.completion_mask.astype(bool)
    denom = objectives.loss_denominator(valid, lc.loss_aggregation, max_response_length=lc.max_response_length)
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    micro = jax.tree.map(lambda x: _micro_split(x, m), (batch, param_direction))

    def micro_loss(params, mb_and_dir):
        mb, mb_dir = mb_and_dir
        terms = terms_fn(params, mb, mb_dir)
        loss_sum, _ = objectives.aggregate_loss(terms["per_token"], mb.completion_mask.astype(bool),
                                                lc.loss_aggregation, max_response_length=lc.max_response_length)
        loss = loss_sum / safe_denom
        if "router_aux_loss" in terms:  # MoE: the mean over micro-batches of each one's aux loss
            loss = loss + lc.router_aux_loss_coef * terms["router_aux_loss"] / n
        return loss, jax.lax.stop_gradient(terms)

    grads, terms_N = _accumulated_grads(micro_loss, params, micro)
    loss, aux = _metrics_of_parts(terms_N, _micro_join, valid, batch, lc)
    return grads, loss, aux


def _accumulated_grads(micro_loss, params, micro):
    """``(sum of grad(micro_loss)(params, part), stacked aux terms)`` over the leading axis of ``micro`` (lax.scan)."""

    def body(grads, mb):
        g, terms = jax.grad(micro_loss, has_aux=True)(params, mb)
        return jax.tree.map(jnp.add, grads, g), terms

    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)


def _metrics_of_parts(terms_N: dict, join, valid, batch: StepBatch, loss_config) -> tuple:
    """``(loss, metrics)`` of the whole mini-batch from its parts' stacked terms: ``join`` maps each ``[n, ...]`` term
    back to ``[B,T]``, the trust-region stats are recombined, the router aux loss (MoE) averaged."""
    router_aux_N = terms_N.pop("router_aux_loss", None)
    terms = {k: join(v) for k, v in terms_N.items() if k != "stats"}
    terms["stats"] = policy_loss.combine_stats(terms_N["stats"])
    loss, aux = policy_loss.loss_and_metrics(terms, valid, batch.behavior_logprobs, batch.advantages, loss_config)
    return _with_router_aux(loss, aux, None if router_aux_N is None else router_aux_N.mean(), loss_config)


def make_packed_rl_terms(graphdef, tr_config: trust_region.TrustRegionConfig,
                         loss_config: policy_loss.PolicyLossConfig):
    """Returns ``terms_fn(params, rows: packing.PackedRows) -> dict``: `pdm_jax.rl.loss.token_terms` of every packed
    position ``[N,L]`` (all logits at once, or ``logits_chunk_size`` positions at a time)."""
    lc = loss_config

    def terms_fn(params, rows: packing.PackedRows):
        if lc.logits_chunk_size > 0:
            h, model, aux = packed_forward(graphdef, params, rows, head=False, return_aux=True)
            terms = chunked_loss.chunked_rl_terms(h, model.logits_from_hidden, rows, tr_config, lc,
                                                  lc.logits_chunk_size)
        else:
            logits, _, aux = packed_forward(graphdef, params, rows, head=True, return_aux=True)
            terms = policy_loss.token_terms(logits / lc.temperature, policy_loss.TokenInputs.of(rows), tr_config, lc)
        if aux is not None:
            terms["router_aux_loss"] = aux
        return terms

    return terms_fn


def _split_into(x, n: int):
    """[N,...] -> [n, N/n, ...]: part j holds rows j, j + n, j + 2n, ... (the layout of :func:`_micro_split`)."""
    return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)


def _with_packing_metrics(metrics: dict, plan: packing.PackingPlan) -> dict:
    """Adds ``packed_fill``: the fraction of packed positions that hold a real token."""
    return dict(metrics, packed_fill=jnp.mean(plan.token_mask.astype(jnp.float32)))


def packed_grads(terms_fn, params, batch: StepBatch, loss_config: policy_loss.PolicyLossConfig):
    """``(grads, loss, metrics)`` of one mini-batch whose sequences are packed (``batch.packing``): per-token inputs
    gathered into the packed rows, row r in micro-batch r % n, each micro-batch's ``sum(per_token x loss_weights)``
    (``objectives.token_loss_weights`` of the padded batch) accumulated under ``lax.scan``, terms gathered back to
    ``[B,T]`` for the metrics: the padded step's loss and gradient.

    Raises:
      ValueError: ``batch.packing`` is None or made for other shapes, or a per-token field of the wrong shape (at
        trace time, `packing.check_plan`)."""
    lc, plan = loss_config, batch.packing
    if plan is None:
        raise ValueError("rl.pack_sequences: the step batch carries no packing plan (StepBatch.packing)")
    packing.check_plan(batch, plan)
    n = plan.num_micro_batches
    valid = batch.completion_mask.astype(bool)
    weights = objectives.token_loss_weights(valid, lc.loss_aggregation, max_response_length=lc.max_response_length)
    micro = jax.tree.map(lambda x: _split_into(x, n), packing.packed_rows(batch, plan, weights))

    def micro_loss(params, mb):
        terms = terms_fn(params, mb)
        loss = jnp.sum(jnp.where(mb.completion_mask, terms["per_token"], 0.0) * mb.loss_weights)
        if "router_aux_loss" in terms:  # MoE: the mean over micro-batches of each one's aux loss
            loss = loss + lc.router_aux_loss_coef * terms["router_aux_loss"] / n
        return loss, jax.lax.stop_gradient(terms)

    grads, terms_N = _accumulated_grads(micro_loss, params, micro)
    loss, aux = _metrics_of_parts(terms_N, lambda v: packing.unpack(_micro_join(v), plan, valid), valid, batch, lc)
    return grads, loss, _with_packing_metrics(aux, plan)


def _packed_rl_step(graphdef, tx, tr_config, loss_config) -> Callable:
    """The RL step on packed rows (:func:`packed_grads`), then the optimizer step."""
    terms_fn = make_packed_rl_terms(graphdef, tr_config, loss_config)

    def step(state: TrainState, batch: StepBatch):
        grads, loss, aux = packed_grads(terms_fn, state.params, batch, loss_config)
        return _apply(tx, state, grads, dict(aux, loss=loss))

    return step


def make_token_divergence(graphdef, tr_config: trust_region.TrustRegionConfig,
                          loss_config: policy_loss.PolicyLossConfig) -> Callable:
    """``divergence_fn(params, batch) -> [B,T] f32``: the mask's divergence D_t of every position (padding sanitised,
    its value meaningless), all logits at once or chunk by chunk; forward-mode differentiable in ``params``."""
    tau, chunk = loss_config.temperature, loss_config.logits_chunk_size

    def divergence_fn(params, batch: StepBatch):
        if chunk > 0:
            h, head_fn = chunked_loss.completion_hidden_states(graphdef, params, batch.prompt_ids, batch.prompt_mask,
                                                               batch.completion_ids, batch.completion_mask,
                                                               routed_experts=batch.routed_experts)
            return chunked_loss.chunked_token_divergence(h, head_fn, batch, tr_config, tau, chunk)
        logits = completion_logits(graphdef, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask, routed_experts=batch.routed_experts) / tau
        safe = trust_region.sanitize_inputs(logits, batch.completion_ids, batch.topk_ids, batch.topk_logprobs,
                                            batch.behavior_logprobs, batch.completion_mask)
        return trust_region.DIVERGENCE_FNS[tr_config.divergence](*safe)

    return divergence_fn


def param_direction_along(divergence_fn: Callable, params, delta_params, batch: StepBatch) -> jax.Array:
    """Ḋᵖ_t = <grad_theta D_t, Δθ> ``[B,T]`` f32: one ``jax.jvp`` of ``divergence_fn(params, batch)`` along Δθ.

    ``delta_params`` (e.g. optax updates) is cast leaf by leaf to the dtype of ``params`` (jvp needs tangent dtype =
    primal dtype). Units: nats (the divergence's) per update.
    """
    tangent = jax.tree.map(lambda p, d: jnp.asarray(d, jnp.result_type(p)), params, delta_params)
    _, d_dot = jax.jvp(lambda prm: divergence_fn(prm, batch), (params,), (tangent,))
    return jax.lax.stop_gradient(d_dot.astype(jnp.float32))


def _param_jvp_rl_step(graphdef, tx, tr_config: trust_region.TrustRegionConfig,
                       loss_config: policy_loss.PolicyLossConfig) -> Callable:
    """The RL step whose mask direction is Ḋᵖ along the optimizer's update of the unmasked gradient (DESIGN.md section
    2): (1) the gradient with the proximity test off; (2) its optax update Δθ, not applied; (3) Ḋᵖ_t by one jvp of
    the divergence along Δθ (:func:`param_direction_along`); (4) the masked step as usual, an out-of-region token
    kept iff Ḋᵖ_t <= 0. With micro-batches (1), (3) and (4) run per micro-batch. About one extra forward + backward
    and one jvp per step (bench/bench_param_direction.py)."""
    unmasked = dataclasses.replace(tr_config, mask="none", direction="per_token", direction_stats=False)
    divergence_fn = make_token_divergence(graphdef, tr_config, loss_config)
    m = loss_config.micro_batch_size
    terms_u, terms_m = (make_rl_terms(graphdef, cfg, loss_config) for cfg in (unmasked, tr_config))
    loss_u, loss_m = (make_rl_loss(graphdef, cfg, loss_config) for cfg in (unmasked, tr_config))

    def step(state: TrainState, batch: StepBatch):
        if m > 0:
            grads_u = _micro_batched_grads(terms_u, state.params, batch, loss_config)[0]
        else:
            grads_u = jax.grad(lambda p: loss_u(p, batch)[0])(state.params)
        delta, _ = tx.update(grads_u, state.opt_state, state.params)
        if m > 0:
            micro = jax.tree.map(lambda x: _micro_split(x, m), batch)
            p_dir = _micro_join(jax.lax.map(lambda mb: param_direction_along(divergence_fn, state.params, delta, mb),
                                            micro))
            grads, loss, aux = _micro_batched_grads(terms_m, state.params, batch, loss_config, p_dir)
        else:
            p_dir = param_direction_along(divergence_fn, state.params, delta, batch)
            (loss, aux), grads = jax.value_and_grad(loss_m, has_aux=True)(state.params, batch, p_dir)
        return _apply(tx, state, grads, dict(aux, loss=loss))

    return step


def make_sft_train_step(graphdef, tx) -> Callable:
    """`sft_step(state, batch) -> (state, metrics)`: the token-mean next-token negative log-likelihood (nats) of the
    completion tokens of a `StepBatch` (prompt_ids [B,P], prompt_mask [B,P], completion_ids [B,T], completion_mask
    [B,T]; RL fields None)."""

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
                                   batch.completion_mask, routed_experts=batch.routed_experts) / temperature
        return trust_region.token_logprobs(logits, batch.completion_ids)

    return f
