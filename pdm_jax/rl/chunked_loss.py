"""Sequence-chunked RL loss: the trust-region mask and the policy loss without ``[B,T,V]`` logits.

Exactly the loss, gradient and statistics of the unchunked ``pdm_jax.rl.train_step.make_rl_loss`` (f32 logits of 8
sequences x 8k tokens of Qwen3's V = 151,936 are 40 GB) while holding ``[B, c, V]`` logits at a time: the model runs
to its final hidden states ``h [B,T,D]``, a ``jax.lax.scan`` over chunks of c positions projects each to logits and
calls ``pdm_jax.rl.loss.token_terms`` (the unchunked path's function), and ``jax.checkpoint`` recomputes each chunk's
logits in the backward. Only ``[B,T]`` per-token arrays leave the scan, so every aggregation mode is exact; the
mask's statistics are recombined from the chunks' counts (``pdm_jax.rl.loss.combine_stats``). T is padded to a
multiple of c with invalid positions; with ``nonfinite="error"`` the position named is relative to its chunk."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pdm_jax.rl import loss as policy_loss, trust_region
from pdm_jax.rl.forward import completion_hidden_states
from pdm_jax.rl.step_batch import StepBatch

_F32 = jnp.float32


def _chunking(t: int, chunk_size: int):
    """``(to_chunks, from_chunks, n)``: [B,T,...] <-> [N,B,c,...] with T padded to N*c (c = min(chunk, T))."""
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t

    def to_chunks(x, fill=0):
        """[B,T,...] -> [N,B,c,...] (padded with `fill`)."""
        x = jnp.asarray(x)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape((x.shape[0], n, c) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def from_chunks(y_NxBxc):
        y = jnp.moveaxis(y_NxBxc, 0, 1)
        return y.reshape((y.shape[0], n * c) + y.shape[3:])[:, :t]

    return to_chunks, from_chunks, n


def chunked_token_divergence(h_BxTxD, head_fn: Callable, batch: StepBatch, tr_config: trust_region.TrustRegionConfig,
                             temperature: float, chunk_size: int):
    """``[B,T]`` f32: the configured divergence D_t of every position, ``[B,c,V]`` logits at a time.

    ``trust_region.DIVERGENCE_FNS[tr_config.divergence]`` of the tempered logits, padding positions sanitised first
    (their D is meaningless). Forward-mode differentiable: the train step's ``param_jvp`` direction takes its jvp
    along Δθ."""
    t = batch.completion_ids.shape[1]
    to_chunks, from_chunks, n = _chunking(t, chunk_size)
    xs = dict(h=to_chunks(h_BxTxD), tokens=to_chunks(batch.completion_ids),
              valid=to_chunks(jnp.asarray(batch.completion_mask).astype(bool), False),
              topk_ids=to_chunks(batch.topk_ids), topk_lp=to_chunks(batch.topk_logprobs),
              behavior_lp=to_chunks(batch.behavior_logprobs))

    def chunk(_, x):
        logits = head_fn(x["h"]).astype(_F32) / temperature
        safe = trust_region.sanitize_inputs(logits, x["tokens"], x["topk_ids"], x["topk_lp"], x["behavior_lp"],
                                            x["valid"])
        return None, trust_region.DIVERGENCE_FNS[tr_config.divergence](*safe)

    return from_chunks(jax.lax.scan(chunk, None, xs)[1])


def chunked_rl_terms(h_BxTxD, head_fn: Callable, batch: StepBatch, tr_config: trust_region.TrustRegionConfig,
                     loss_config: policy_loss.PolicyLossConfig, chunk_size: int, *, param_direction=None) -> dict:
    """``pdm_jax.rl.loss.token_terms`` of all positions from hidden states, one ``[B,c,V]`` chunk at a time.

    Args:
      h_BxTxD: ``[B,T,D]`` final hidden states (after the final norm), differentiable.
      head_fn: ``[B,c,D] -> [B,c,V]`` f32 logits (the LM head).
      batch: the train-step batch (completion_ids, completion_mask, behavior_logprobs, topk_ids, topk_logprobs,
        advantages ``[B]`` or ``[B,T]``, ref_logprobs when ``kl_beta > 0``).
      tr_config, loss_config: static settings.
      chunk_size: c >= 1 positions per chunk.
      param_direction: ``[B,T]`` f32 Ḋᵖ when ``tr_config.direction == "param_jvp"``.

    Returns:
      ``token_terms``' dict over all ``[B,T]`` positions with ``stats`` recombined from the chunks.

    Raises:
      ValueError: chunk_size < 1 or shapes that disagree."""
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"rl.logits_chunk_size must be an int >= 1 for the chunked loss, got {chunk_size!r}")
    b, t, d = h_BxTxD.shape
    if batch.completion_ids.shape != (b, t):
        raise ValueError(f"completion_ids has shape {batch.completion_ids.shape}, hidden states {h_BxTxD.shape}")
    to_chunks, from_chunks, n = _chunking(t, chunk_size)
    adv = jnp.asarray(batch.advantages).astype(_F32)
    adv_BxT = jnp.broadcast_to(adv[:, None], (b, t)) if adv.ndim == 1 else adv

    tokens = policy_loss.TokenInputs.of(batch, param_direction=param_direction).replace(
        valid=jnp.asarray(batch.completion_mask).astype(bool), advantages=adv_BxT,
        ref_logprobs=batch.ref_logprobs if loss_config.kl_beta > 0 else None)
    xs = (to_chunks(h_BxTxD), jax.tree.map(to_chunks, tokens))  # padding positions: invalid (False), zeros

    def chunk(x):
        h_c, tokens_c = x
        logits = head_fn(h_c).astype(_F32) / loss_config.temperature  # [B,c,V]: the only vocabulary-sized buffers
        return policy_loss.token_terms(logits, tokens_c, tr_config, loss_config)

    if n == 1:  # one chunk covers T: a scan with remat would only add a recomputation
        ys = jax.tree.map(lambda y: y[None], chunk(jax.tree.map(lambda x: x[0], xs)))
    else:
        # Rematerialise each chunk in the backward pass: only h and the per-token inputs are saved.
        chunk = jax.checkpoint(chunk, policy=jax.checkpoint_policies.nothing_saveable)
        _, ys = jax.lax.scan(lambda carry, x: (carry, chunk(x)), None, xs)

    terms = {k: from_chunks(v) for k, v in ys.items() if k != "stats"}
    terms["stats"] = policy_loss.combine_stats(ys["stats"])
    return terms


def make_chunked_rl_terms(graphdef, tr_config: trust_region.TrustRegionConfig,
                          loss_config: policy_loss.PolicyLossConfig, chunk_size: int):
    """``terms_fn(params, batch) -> token_terms`` of all positions without ``[B,T,V]`` logits: the unchunked path's
    terms and statistics (to 1e-5, tests/test_chunked_loss.py) with logits ``chunk_size`` positions at a time.

    Raises:
      ValueError: chunk_size < 1."""
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"rl.logits_chunk_size must be an int >= 1 for the chunked loss, got {chunk_size!r}")

    def terms_fn(params, batch: StepBatch, param_direction=None):
        h_BxTxD, head_fn, aux = completion_hidden_states(graphdef, params, batch.prompt_ids, batch.prompt_mask,
                                                         batch.completion_ids, batch.completion_mask,
                                                         return_aux=True, routed_experts=batch.routed_experts)
        terms = chunked_rl_terms(h_BxTxD, head_fn, batch, tr_config, loss_config, chunk_size,
                                 param_direction=param_direction)
        if aux is not None:  # Qwen3-MoE: the router load-balancing loss (see train_step.make_rl_loss)
            terms["router_aux_loss"] = aux
        return terms

    return terms_fn
