"""The one forward pass of the update: the policy on prompt + completion, kept at the completion's positions.

Both the whole-vocabulary step (`pdm_jax.rl.train_step`) and the chunked one (`pdm_jax.rl.chunked_loss`) call
`completion_forward`; `completion_logits` and `completion_hidden_states` are its two outputs. `packed_forward` is the
same model call on packed rows (`pdm_jax.rl.packing`), every position kept.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def completion_forward(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                       head: bool, return_aux: bool = False, routed_experts=None):
    """Runs the model on ``concat(prompt, completion)`` and keeps positions P-1 .. P+T-2, which score completion tokens
    0..T-1.

    Args:
      graphdef, params: ``nnx.split`` of a ``Qwen3ForCausalLM``.
      prompt_ids [B,P] int32, prompt_mask [B,P] bool (left-padded), completion_ids [B,T] int32, completion_mask [B,T]
      bool.
      head: True: the logits; False: the final hidden states.
      return_aux: compute the router aux loss (MoE only).
      routed_experts: [B,P+T,L,k] int (routing replay) or None.
    Returns:
      ``(out, model, aux)``: f32 logits [B,T,V] (``head``) or hidden states [B,T,D] (compute dtype); the merged
        module;
      the unscaled load-balancing loss (f32 scalar) of a MoE model with ``return_aux``, else None."""
    model = nnx.merge(graphdef, params)
    input_ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    attn = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    p, t = prompt_ids.shape[1], completion_ids.shape[1]
    kw = {} if routed_experts is None else dict(routed_experts=routed_experts)
    call = model if head else model.hidden_states
    aux = None
    if return_aux and getattr(model.config, "is_moe", False):
        out, aux = call(input_ids, attention_mask=attn, return_aux=True, **kw)
    else:
        out = call(input_ids, attention_mask=attn, **kw)
    out = out[:, p - 1:p + t - 1]
    return (out.astype(jnp.float32) if head else out), model, aux


def packed_forward(graphdef, params, rows, *, head: bool, return_aux: bool = False):
    """Runs the model on packed rows (``PackedRows``: ``input_ids`` [N,L] int32, ``token_mask`` [N,L] bool,
    ``segment_ids`` [N,L] int32; positions restart per sequence). Returns ``(out, model, aux)`` as
    `completion_forward` at all N x L positions (position l predicts l + 1 of its sequence)."""
    model = nnx.merge(graphdef, params)
    call = model if head else model.hidden_states
    kw = dict(attention_mask=rows.token_mask, segment_ids=rows.segment_ids)
    aux = None
    if return_aux and getattr(model.config, "is_moe", False):
        out, aux = call(rows.input_ids, return_aux=True, **kw)
    else:
        out = call(rows.input_ids, **kw)
    return (out.astype(jnp.float32) if head else out), model, aux


def completion_logits(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                      return_aux: bool = False, routed_experts=None):
    """Logits predicting each completion token, [B,T,V] float32; with ``return_aux`` ``(logits, router_aux_loss)``."""
    logits, _, aux = completion_forward(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        head=True, return_aux=return_aux,
                                        routed_experts=routed_experts)
    return (logits, aux) if return_aux else logits


def completion_hidden_states(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                             return_aux: bool = False, routed_experts=None):
    """``(h [B,T,D] in the compute dtype, head_fn)``, ``head_fn(h_chunk [B,c,D])`` giving f32 logits ``[B,c,V]``; with
    ``return_aux`` also the unscaled router aux loss (None if dense)."""
    h, model, aux = completion_forward(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                       head=False, return_aux=return_aux,
                                       routed_experts=routed_experts)
    return (h, model.logits_from_hidden, aux) if return_aux else (h, model.logits_from_hidden)
