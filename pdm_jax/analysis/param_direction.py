"""Parameter-space predictive direction: the first-order change of every token's divergence under Δθ.

A real optimizer step moves the logits along J·Δθ, coupling every token of the batch, not along each token's own e_k
− π (`pdm_jax.rl.trust_region.kl_directional_derivative`). This module computes, with ONE ``jax.jvp`` of the
per-token top-K KL (`pdm_jax.rl.trust_region.topk_kl`, μ fixed) through the model,

    Ḋᵖ_t = ⟨∇_θ D_t(θ), Δθ⟩ = d/dε D_t(θ + ε Δθ) |_{ε=0}

(with θ = z and Δz = e_k − π it is the ``bucket_exact`` closed form). The analysis uses it as the ``param_jvp``
criterion (keep an out-of-region token iff Ḋᵖ_t ≤ 0): a first-order oracle of the realized ΔD (DESIGN.md §2)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr

__all__ = ["PARAM_CRITERION", "parameter_update", "param_directional_change", "param_jvp_topk_kl"]

#: Name of the parameter-space criterion in the analysis records (``keep_param_jvp``, ``dir_param_jvp``).
PARAM_CRITERION = "param_jvp"


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _check_like(params, other, what: str) -> None:
    """ValueError unless `other` has the tree structure and leaf shapes of `params` (float leaves only)."""
    if jax.tree.structure(params) != jax.tree.structure(other):
        raise ValueError(f"{what} must have the tree structure of params: got {jax.tree.structure(other)}, "
                         f"expected {jax.tree.structure(params)}")
    for (path, p), o in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(other)):
        if not jnp.issubdtype(jnp.result_type(p), jnp.inexact):
            raise ValueError(f"params{_leaf_name(path)} has dtype {jnp.result_type(p)}: only floating-point "
                             "parameters can move along Δθ")
        if jnp.shape(p) != jnp.shape(o):
            raise ValueError(f"{what}{_leaf_name(path)} has shape {jnp.shape(o)}, params{_leaf_name(path)} "
                             f"has {jnp.shape(p)}")


def parameter_update(params_before, params_after):
    """Δθ = params_after − params_before, leaf by leaf, computed in f32 (f64 for f64 leaves) and cast to each leaf's
    dtype of `params_before` (``jax.jvp`` needs tangent dtype = primal dtype); a pytree like `params_before`.

    Raises:
      ValueError: different tree structures, a shape mismatch or a non-floating leaf (named by its path)."""
    _check_like(params_before, params_after, "params_after")

    def diff(b, a):
        wide = jnp.promote_types(jnp.result_type(b), jnp.float32)
        return (jnp.asarray(a, wide) - jnp.asarray(b, wide)).astype(jnp.result_type(b))

    return jax.tree.map(diff, params_before, params_after)


def param_directional_change(logits_fn: Callable, params, delta_params, tokens, topk_ids, topk_logprobs,
                             behavior_logprobs):
    """(D_t, Ḋᵖ_t): the top-K KL at θ and its derivative along Δθ, one ``jax.jvp`` through `logits_fn` (call it under
    ``jax.jit``).

    Args:
      logits_fn: ``params -> [...,V]`` temperature-scaled logits (bf16/f32).
      params: pytree θ with floating-point leaves.
      delta_params: pytree Δθ of the same structure and shapes (cast to the `params` leaf dtypes).
      tokens: ``[...]`` int sampled ids y_t.
      topk_ids: ``[...,K]`` int behaviour top-K ids; topk_logprobs: ``[...,K]`` their log μ.
      behavior_logprobs: ``[...]`` log μ(y_t).

    Returns:
      ``(d, d_dot)``, both ``[...]`` f32: D_t(θ) in nats and Ḋᵖ_t in nats per unit of the step.

    Raises:
      ValueError: `delta_params` does not match `params`, or a parameter leaf is not floating-point."""
    _check_like(params, delta_params, "delta_params")
    tangent = jax.tree.map(lambda p, d: jnp.asarray(d, jnp.result_type(p)), params, delta_params)

    def d_of(prm):
        return tr.topk_kl(logits_fn(prm), tokens, topk_ids, topk_logprobs, behavior_logprobs)

    d, d_dot = jax.jvp(d_of, (params,), (tangent,))
    return d.astype(jnp.float32), d_dot.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def param_jvp_topk_kl(graphdef, params, delta_params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      topk_ids, topk_logprobs, behavior_logprobs, *, temperature: float):
    """(D, Ḋᵖ) ``[B,T]`` f32 of a train-step batch under the trainer's model (its ``completion_logits`` / τ), one
    forward-mode pass; padding positions are computed too (mask them with ``completion_mask``).

    Args:
      graphdef: the trainer's nnx graphdef (static).
      params: θ *before* the step.
      delta_params: Δθ, same structure (:func:`parameter_update`).
      prompt_ids, prompt_mask, completion_ids, completion_mask, topk_ids, topk_logprobs, behavior_logprobs: the
        `StepBatch` fields (``[B,P]``, ``[B,T]``, ``[B,T,K]``).
      temperature: τ (static), > 0.

    Raises:
      ValueError: as :func:`param_directional_change`; ``temperature <= 0``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")

    def logits_fn(prm):
        return ts.completion_logits(graphdef, prm, prompt_ids, prompt_mask, completion_ids,
                                    completion_mask) / temperature

    return param_directional_change(logits_fn, params, delta_params, completion_ids, topk_ids, topk_logprobs,
                                    behavior_logprobs)
