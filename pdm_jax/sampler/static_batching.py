"""Static batching (``batching="static"``): a chunk of rows decoded together until its longest row stops.

Shapes are static per bucket: batch (powers of two up to ``max_batch_size``;
larger requests are split into chunks), prompt length (powers of two, at least
``min_prompt_bucket``, up to ``max_prompt_length``, prompts left-padded) and the
number of new tokens (powers of two up to ``max_new_tokens``).  One bucket
compiles once.  Prefill runs the whole (left-padded) prompt through
``Qwen3ForCausalLM.decode`` at cache slot 0; the decode loop is a
``jax.lax.while_loop`` inside the same jitted program (no host round-trip per
token on CPU), writing token t's key/value at slot ``P + t`` and stopping as soon
as every row has finished (stop token or its ``max_new_tokens``).  The cache
grows in doubling segments (``P + 64``, ``P + 128``, ... slots; one while-loop
per segment) so that attention costs track the live context length, and keeps
one key and one value array per layer in the layouts the decode matmuls read
(``models.qwen3.KVCache``), so a step reads the cache in place and never copies
it: the cost per token stays near constant (``bench/bench_sampler.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.rollout import ROUTING_PAD, left_pad, routing_dtype
from pdm_jax.sampler.sampling import Draw, bucket, laid_out, sample_step, shape_buckets


def _routing_buffer(model, prefill_routed: list, rows: int, width: int):
    """The ``routed`` output [rows, width, L, k] (`rollout.routing_dtype`, `ROUTING_PAD` where no token is
    fed) holding the prefill's routing ``prefill_routed[0]`` [rows, P, L, k] in its first P columns; None
    when ``prefill_routed`` is empty (no routing requested)."""
    if not prefill_routed:
        return None
    r = prefill_routed[0].astype(routing_dtype(model.config.num_experts))
    return jax.lax.dynamic_update_slice(jnp.full((rows, width) + r.shape[2:], ROUTING_PAD, r.dtype), r, (0, 0, 0, 0))


def _put_routing(routed, step_routed: list, column):
    """``routed`` with a decode step's routing ``step_routed[0]`` [B, 1, L, k] written at ``column`` of every
    row (static batching: all rows at one index); unchanged when there is no routing."""
    if routed is None:
        return routed
    return jax.lax.dynamic_update_slice(routed, step_routed[0].astype(routed.dtype), (0, column, 0, 0))


def cache_segments(num_new: int, first_segment: int) -> list:
    """Ends of the decode segments: first_segment, 2*first_segment, ... < num_new, then num_new."""
    ends, e = [], max(int(first_segment), 1)
    while e < num_new:
        ends.append(e)
        e *= 2
    return ends + [int(num_new)]


class StaticBatch(NamedTuple):
    """`_generate_program`'s arrays for B rows: ``prompt_ids_BxP`` / ``prompt_mask_BxP`` (left-padded int32 / bool
    [B, P]), ``seeds_Bx2`` uint32 [B, 2] (each row's seed, low and high words), ``prompt_idx_B`` / ``sample_idx_B``
    uint32 [B] (a row's key indices), ``temperature_B`` / ``top_p_B`` f32 [B], ``top_k_B`` / ``max_new_B`` int32 [B]
    (``max_new_B`` 0: a padding row), ``stop_ids_BxS`` int32 [B, S] (-1 = unused)."""

    prompt_ids_BxP: jax.Array
    prompt_mask_BxP: jax.Array
    seeds_Bx2: jax.Array
    prompt_idx_B: jax.Array
    sample_idx_B: jax.Array
    temperature_B: jax.Array
    top_p_B: jax.Array
    top_k_B: jax.Array
    max_new_B: jax.Array
    stop_ids_BxS: jax.Array


@dataclasses.dataclass(frozen=True)
class StaticShape:
    """`_generate_program`'s static settings (hashable: the jit's static argument): ``num_new`` the new-token bucket
    T, ``k_logprobs`` K, ``cache_dtype``, ``first_segment`` (`cache_segments`), ``group`` (shared prefill: rows per
    prompt), ``routing`` (MoE routing replay), ``slice_layers_once`` (`hoist_layer_slices`)."""

    num_new: int
    k_logprobs: int
    cache_dtype: Any
    first_segment: int
    group: int = 1
    routing: bool = False
    slice_layers_once: bool = False


def _generate_program(graphdef, state, batch: StaticBatch, shape: StaticShape):
    """The jitted prefill + while-loop decode for one (B, P, T=num_new, K) bucket.

    ``routing`` (MoE models, routing replay): also return ``routed`` [B, P + num_new, L, k]
    (`rollout.routing_dtype`): the experts every layer ran for prompt slot s < P (from the
    prefill) and for generated token t at column P + t (from the decode step that feeds it);
    `rollout.ROUTING_PAD` where no token was fed (a row's last token).

    Long on purpose: one traced program whose prefill, cache segments and decode loops share
    one carry (tokens, cache, per-row state, outputs, routing); split into module functions
    they would pass all of it each way.

    Shared prefill (``group`` = g > 1): rows ``g*u .. g*u + g-1`` hold the same prompt
    (the caller guarantees it), so only rows ``0, g, 2g, ...`` are prefilled ([B/g, P]
    tokens) and their KV cache and last logits are repeated g times: 1/g of the prefill
    work, the same numbers per row.

    The KV cache grows in segments (`cache_segments`): segment i decodes tokens
    up to ``ends[i]`` with a cache of ``P + ends[i]`` slots, then the cache is
    zero-padded to the next size.  Attention therefore runs over at most twice
    the live context instead of always over ``P + num_new`` slots, keeping the
    per-token cost close to constant; rows stop early in any segment.
    """
    (prompt_ids_BxP, prompt_mask_BxP, seeds_Bx2, prompt_idx_B, sample_idx_B, temperature_B, top_p_B, top_k_B,
     max_new_B, stop_ids_BxS) = batch
    num_new, k_logprobs, cache_dtype, group = shape.num_new, shape.k_logprobs, shape.cache_dtype, shape.group
    model = nnx.merge(graphdef, state)
    layers = model.decode_layers() if shape.slice_layers_once else None
    b, p = prompt_ids_BxP.shape
    ends = cache_segments(num_new, shape.first_segment)
    cache = laid_out(model.init_cache(b, p + ends[0], dtype=cache_dtype))
    prompt_len_B = jnp.sum(prompt_mask_BxP, axis=-1).astype(jnp.int32)
    positions_BxP = jnp.maximum(jnp.cumsum(prompt_mask_BxP, axis=-1) - 1, 0).astype(jnp.int32)
    kv_mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.ones((b, num_new), bool)], axis=-1)
    rkw = dict(return_routing=True) if shape.routing else {}
    if group > 1:
        cache_u = model.init_cache(b // group, p + ends[0], dtype=cache_dtype)
        logits_Ux1xV, cache_u, *routed_u = model.decode(prompt_ids_BxP[::group], positions_BxP[::group], cache_u,
                                                        jnp.int32(0), kv_mask_BxS[::group, :p + ends[0]],
                                                        last_logits_only=True, **rkw)
        prefill_routed = [jnp.repeat(r, group, axis=0) for r in routed_u]
        cache = laid_out(jax.tree.map(lambda a: jnp.repeat(a, group, axis=0), cache_u))
        last_logits_BxV = jnp.repeat(logits_Ux1xV[:, -1, :], group, axis=0)
    else:
        logits_Bx1xV, cache, *prefill_routed = model.decode(prompt_ids_BxP, positions_BxP, cache, jnp.int32(0),
                                                            kv_mask_BxS[:, :p + ends[0]], last_logits_only=True, **rkw)
        last_logits_BxV = logits_Bx1xV[:, -1, :]
    routed = _routing_buffer(model, prefill_routed, b, p + num_new)  # None without routing

    def row_key(seed_2, i, j):
        key = jax.random.fold_in(jax.random.PRNGKey(seed_2[0]), seed_2[1])
        return jax.random.fold_in(jax.random.fold_in(key, i), j)
    row_keys_B = jax.vmap(row_key)(seeds_Bx2, prompt_idx_B, sample_idx_B)
    sample = functools.partial(sample_step, temperature_B=temperature_B, top_p_B=top_p_B, top_k_B=top_k_B,
                               k_logprobs=k_logprobs)

    tokens_BxT = jnp.zeros((b, num_new), jnp.int32)
    logp_BxT = jnp.zeros((b, num_new), jnp.float32)
    topk_ids_BxTxK = jnp.zeros((b, num_new, k_logprobs), jnp.int32)
    topk_lp_BxTxK = jnp.zeros((b, num_new, k_logprobs), jnp.float32)

    def record(carry_out, t, done_B, length_B, stopped_B, logits_BxV):
        tokens, logp, tk_ids, tk_lp = carry_out
        tok_B, lp_B, ids_BxK, lps_BxK = sample(logits_BxV, row_keys_B, t)
        tokens = jax.lax.dynamic_update_slice(tokens, tok_B[:, None], (0, t))
        logp = jax.lax.dynamic_update_slice(logp, lp_B[:, None], (0, t))
        tk_ids = jax.lax.dynamic_update_slice(tk_ids, ids_BxK[:, None, :], (0, t, 0))
        tk_lp = jax.lax.dynamic_update_slice(tk_lp, lps_BxK[:, None, :], (0, t, 0))
        live_B = ~done_B
        is_stop_B = jnp.any(tok_B[:, None] == stop_ids_BxS, axis=-1)
        length_B = jnp.where(live_B, t + 1, length_B)
        stopped_B = stopped_B | (live_B & is_stop_B)
        done_B = done_B | is_stop_B | (t + 1 >= max_new_B)
        return (tokens, logp, tk_ids, tk_lp), tok_B, done_B, length_B, stopped_B

    done0_B = max_new_B <= 0  # batch-padding rows never keep the loop alive
    outs, tok_B, done_B, length_B, stopped_B = record(
        (tokens_BxT, logp_BxT, topk_ids_BxTxK, topk_lp_BxTxK), jnp.int32(0), done0_B,
        jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), last_logits_BxV)

    carry = (jnp.int32(1), tok_B, cache, done_B, length_B, stopped_B, outs, routed)
    prev_end = ends[0]
    for end in ends:
        if end > prev_end:  # grow the cache: zero slots p+prev_end .. p+end-1 (masked until written)
            pad = end - prev_end
            grown = laid_out(carry[2].grow(pad))
            carry = carry[:2] + (grown,) + carry[3:]
            prev_end = end
        kv_mask_seg = kv_mask_BxS[:, :p + end]

        def cond(c, end=end):
            t, _, _, done, *_ = c
            return (t < end) & ~jnp.all(done)

        def body(c, kv_mask_seg=kv_mask_seg):
            t, prev_B, cache, done, length, stopped, outs, routed = c
            pos_Bx1 = (prompt_len_B + t - 1)[:, None]
            logits_Bx1xV, cache, *step_routed = model.decode(prev_B[:, None], pos_Bx1, cache,
                                                             (p + t - 1).astype(jnp.int32), kv_mask_seg,
                                                             layers=layers, **rkw)
            routed = _put_routing(routed, step_routed, p + t - 1)  # token t - 1 was fed now
            cache = laid_out(cache)
            outs, tok, done, length, stopped = record(outs, t, done, length, stopped, logits_Bx1xV[:, 0, :])
            return t + 1, tok, cache, done, length, stopped, outs, routed

        carry = jax.lax.while_loop(cond, body, carry)
    t_final, _, _, _, length_B, stopped_B, outs, routed = carry
    tokens_BxT, logp_BxT, topk_ids_BxTxK, topk_lp_BxTxK = outs
    return dict(tokens=tokens_BxT, logp=logp_BxT, topk_ids=topk_ids_BxTxK, topk_logp=topk_lp_BxTxK,
                length=length_B, stopped=stopped_B, steps=t_final, **({} if routed is None else dict(routed=routed)))




# One module-level jit: engines with equal configs (equal graphdefs) share compiled buckets.
_GENERATE_JIT = jax.jit(_generate_program, static_argnums=(0, 3))


def run(engine, state, prompts, chunk, draw: Draw) -> dict:
    """One chunk of rows ``[(prompt i, sample j), ...]`` through `_generate_program` with `draw`'s sampling; returns
    its outputs cut to the chunk's rows (``tokens`` / ``logp`` [rows, T], ``topk_ids`` / ``topk_logp`` [rows, T, K],
    ``length`` / ``stopped`` [rows], ``routed`` with routing). Buckets: `bucket` of the engine's limits."""
    temperature, top_p, top_k, max_new, k, stops, seed, n, routing, key_offset = draw
    n_rows = len(chunk)
    b = bucket(n_rows, engine.row_shards, engine.max_batch_size)
    # Rows come in groups of n samples of one prompt (rows = [(i, 0..n-1) for each prompt i]).
    group = n if (engine.share_prefill and n > 1 and n_rows % n == 0 and b % n == 0
                  and all(chunk[r][0] == chunk[r - r % n][0] for r in range(n_rows))) else 1
    engine.prefill_rows += b // group
    engine.prefill_rows_unshared += b
    longest = max(len(prompts[i]) for i, _ in chunk)
    p, t = shape_buckets(engine, longest, max_new)
    ids, mask = left_pad([prompts[i] for i, _ in chunk], p, rows=b)
    mask[n_rows:, -1] = True  # padding rows: one dummy token, never a fully masked row
    prompt_idx = np.zeros((b,), np.uint32)
    sample_idx = np.zeros((b,), np.uint32)
    for r, (i, j) in enumerate(chunk):
        prompt_idx[r], sample_idx[r] = key_offset + i, j
    max_new_b = np.zeros((b,), np.int32)
    max_new_b[:n_rows] = max_new
    stop_arr = np.full((b, engine.max_stop_tokens), -1, np.int32)
    stop_arr[:, :len(stops)] = stops
    engine._note_program(("static", b, p, t, k, group, engine.first_cache_segment, str(engine.compute_dtype))
                         + ("routing",) * routing)
    with engine._layout():
        batch = StaticBatch(
            prompt_ids_BxP=jnp.asarray(ids), prompt_mask_BxP=jnp.asarray(mask),
            seeds_Bx2=jnp.asarray(np.tile(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32), (b, 1))),
            prompt_idx_B=jnp.asarray(prompt_idx), sample_idx_B=jnp.asarray(sample_idx),
            temperature_B=jnp.full((b,), temperature, jnp.float32), top_p_B=jnp.full((b,), top_p, jnp.float32),
            top_k_B=jnp.full((b,), top_k, jnp.int32), max_new_B=jnp.asarray(max_new_b),
            stop_ids_BxS=jnp.asarray(stop_arr))
        shape = StaticShape(num_new=t, k_logprobs=k, cache_dtype=engine.compute_dtype,
                            first_segment=engine.first_cache_segment, group=group, routing=routing,
                            slice_layers_once=engine.slice_layers_once)
        out = _GENERATE_JIT(engine._graphdef, state, batch, shape)
    out = jax.device_get(out)
    engine.last_decode_steps = int(out["steps"])
    return {key: np.asarray(v)[:n_rows] for key, v in out.items() if key != "steps"}
