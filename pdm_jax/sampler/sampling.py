"""The per-token draw shared by both batching programs: the sampling distribution, one sampling step,
the shape buckets and the KV cache's layout.

Sampling (per row, per token):


* ``temperature > 0``: z / tau, optional top-k (keep the k largest) then top-p
  (keep the smallest prefix of the sorted distribution whose mass reaches p;
  the most likely token is always kept), renormalised; the token is drawn with
  ``jax.random.categorical``.  All returned log-probabilities (sampled and
  top-K) are of this *renormalised, filtered* distribution -- the one actually
  sampled from -- so filtered-out ids have log mu = -inf.  With filters on, the
  trainer's ratio pi/mu then compares the unfiltered policy with a truncated
  behaviour policy: mu(k) >= softmax(z_q/tau)(k), and log-ratios are biased
  downwards on kept tokens (docs/sampler.md).  Filters are off by default (top_p=1, top_k=0).
* ``temperature == 0``: greedy (argmax of the logits); the returned
  log-probabilities are those of softmax(z) at tau = 1 (after the same filters),
  i.e. what the trainer computes with temperature 1.
* Reproducible: row ``i * n + j`` (sample j of prompt i) uses the key
  ``fold_in(fold_in(fold_in(PRNGKey(seed mod 2**32), seed >> 32), i), j)`` and token t
  ``fold_in(row_key, t)``,
  so the same request with the same seed gives the same output, independent of
  chunking into batches.  ``first_prompt_index=f`` keys prompt i of a request as prompt
  f + i: a request for prompts f..f+m-1 of a larger batch (per-host rollouts: each
  process samples its share of an RL step) draws the same tokens as the whole batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdm_jax import sharding as shd


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): the engine's batch and slot buckets."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def bucket(x: int, lo: int, hi: int) -> int:
    """``next_pow2(x)`` clipped to [lo, hi]: a prompt, new-token or batch bucket."""
    return int(min(max(next_pow2(x), lo), hi))


def shape_buckets(engine, longest_prompt: int, max_new: int) -> tuple:
    """The (prompt, new-token) lengths a batch compiles for: each the power-of-two bucket of the batch's longest
    prompt / ``max_new`` within the engine's bounds, or the bound itself where the bound is not a power of two
    (tokens, ints). Shared by the static and the continuous engine, so both compile the same shapes."""
    p = bucket(longest_prompt, engine.min_prompt_bucket, engine.max_prompt_length)
    if p < longest_prompt:  # max_prompt_length not a power of two
        p = engine.max_prompt_length
    t = bucket(max_new, engine.min_new_tokens_bucket, engine.max_new_tokens)
    if t < max_new:
        t = engine.max_new_tokens
    return p, t


def sampling_distribution(logits_BxV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
                          top_k_B: jax.Array, may_filter: bool = True) -> jax.Array:
    """log mu [B, V] f32: the distribution tokens are drawn from (see module docstring).

    log_softmax(z / tau) with tau = temperature (1 for greedy rows, temperature 0),
    then top-k (k > 0) and top-p (p < 1) filtering with renormalisation; filtered
    ids get -inf.  Ties at the top-k threshold are all kept.  ``may_filter=False`` (static):
    the caller knows that no row filters (top_p 1, top_k 0), and the filter is not even
    compiled (its sort and cumulative sum are a large share of a sampling step's compile).
    """
    z = logits_BxV.astype(jnp.float32)
    tau_B = jnp.where(temperature_B > 0, temperature_B, 1.0).astype(jnp.float32)
    logp_BxV = jax.nn.log_softmax(z / tau_B[:, None], axis=-1)

    def filtered(logp):
        v = logp.shape[-1]
        sorted_BxV = -jnp.sort(-logp, axis=-1)  # descending
        k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
        kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)[:, 0]
        keep = logp >= kth_B[:, None]
        # top-p on the top-k-filtered, renormalised distribution
        sorted_k = jnp.where(jnp.arange(v)[None, :] < k_B[:, None], sorted_BxV, -jnp.inf)
        sorted_k = sorted_k - jax.nn.logsumexp(sorted_k, axis=-1, keepdims=True)
        probs = jnp.exp(sorted_k)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        in_p = (mass_before < top_p_B[:, None]) & (jnp.arange(v)[None, :] < k_B[:, None])
        n_keep_B = jnp.maximum(jnp.sum(in_p, axis=-1), 1)
        pth_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
        keep = keep & (logp >= pth_B[:, None])
        masked = jnp.where(keep, logp, -jnp.inf)
        return masked - jax.nn.logsumexp(masked, axis=-1, keepdims=True)

    if not may_filter:
        return logp_BxV
    active = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
    return jax.lax.cond(active, filtered, lambda x: x, logp_BxV)


def sample_step(logits_BxV, keys_B, t, temperature_B, top_p_B, top_k_B, k_logprobs: int, may_filter: bool = True):
    """One sampling step: (token [B] i32, log mu(token) [B] f32, topk ids [B,K], topk log mu [B,K]).

    ``t``: the token index, a scalar (static batches: every row at the same index) or [B]
    (continuous batching: each slot at its own); row b's key is ``fold_in(keys_B[b], t[b])``.
    """
    logmu_BxV = sampling_distribution(logits_BxV, temperature_B, top_p_B, top_k_B, may_filter)
    t_B = jnp.broadcast_to(jnp.asarray(t), keys_B.shape[:1])
    step_keys_B = jax.vmap(jax.random.fold_in)(keys_B, t_B)
    drawn_B = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(step_keys_B, logmu_BxV)
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    token_B = jnp.where(temperature_B > 0, drawn_B, greedy_B).astype(jnp.int32)
    logp_B = jnp.take_along_axis(logmu_BxV, token_B[:, None], axis=-1)[:, 0]
    topk_lp_BxK, topk_ids_BxK = jax.lax.top_k(logmu_BxV, k_logprobs)
    return token_B, logp_B, topk_ids_BxK.astype(jnp.int32), topk_lp_BxK


def laid_out(cache):
    """The KV cache constrained to the active mesh's layout (`sharding.KV_CACHE_K_AXES` / ``_V_AXES``:
    rows over data, kv heads over tensor); the cache itself without a mesh (single-device engine)."""
    return type(cache)(k=tuple(shd.constrain(k, shd.KV_CACHE_K_AXES) for k in cache.k),
                       v=tuple(shd.constrain(v, shd.KV_CACHE_V_AXES) for v in cache.v))



def hoist_layer_slices(platform: str) -> bool:
    """Whether the decode programs slice every layer's weights out of the stacked ``[L, ...]`` parameters once,
    before their loops (`Qwen3ForCausalLM.decode_layers`), rather than inside each step (the default).

    True on XLA:CPU, which materialises a static slice of a loop-invariant operand at every iteration: a copy of
    every layer's weights per decoded token, as many bytes moved as the matmuls read (measured with
    ``bench/bench_decode.py``; `docs/benchmarks.md`). False on TPU: XLA:TPU reads the slices in place inside the
    loop, and slicing them before it holds a second copy of the layers for the whole program (compiled for the
    Qwen3-8B engine on v5p:4x4x4: 3.0 GiB more temporaries per device). False on GPU too, not measured there.
    """
    return platform == "cpu"


class Draw(NamedTuple):
    """One request's sampling as the batching runners take it (`SamplingEngine.generate` builds it once, after
    `validate_request`): temperature tau >= 0, top-p in (0, 1], top-k (0 = off), ``max_new`` new tokens at most,
    ``k`` top-K log-probabilities per token, ``stops`` the stop ids, ``seed`` in [0, 2**63), ``n`` samples per
    prompt, ``routing`` (MoE routing replay) and ``key_offset`` (``first_prompt_index``: added to each row's prompt
    index in its key)."""

    temperature: float
    top_p: float
    top_k: int
    max_new: int
    k: int
    stops: list
    seed: int
    n: int = 1
    routing: bool = False
    key_offset: int = 0
