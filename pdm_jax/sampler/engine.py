"""Batched, jitted KV-cache generation with behaviour log-probabilities and top-K.

`SamplingEngine` holds a quantized copy of the policy (see `quantize.py`) and
turns prompts into a `RolloutBatch`: for every generated token the sampled id,
log mu of it, and the K most likely ids with their log mu, where
mu = softmax(z_q / tau) is *the distribution the token was drawn from*
(DESIGN.md section 1).

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

Continuous batching (``batching="continuous"``, `_continuous_program`): the request's
rows queue for ``max_slots`` slots of one KV cache of static shape [slots, P + T]
(every prompt prefilled once into a prompt store); a slot whose row stops (stop id or
its max) is refilled inside the same while-loop with the next pending row (its prompt's
entry copied in, token 0 sampled from the stored last logits), so rows of mixed
lengths do not wait for the longest one. Attention reads the first P + T/4 slots of the
cache, then P + T/2 and P + T once a live row needs them (`cache_phases`: early steps read a
shorter cache; one decode loop for all phases, each layer's attention a ``lax.switch`` over
the widths); once no row is pending and at most half the slots are live, the live rows
move into a cache of half the slots, then a quarter, an eighth as more rows end (the tail: programs of
their own, compiled and run only when a request leaves rows to them; requests under 64 new tokens
keep one tail level of a quarter). A request of at most slots/4 rows runs in a cache of slots/4 slots
with one phase and no tail, and a request without top-p / top-k filtering runs a program without the
filter: a bucket's first call compiles one decode loop. The row keys above make its tokens the static
engine's (tests). One program per (slots, queue, prompt store, P, T, K, filter) bucket (and
its tail's two, compiled when a request first needs them); the shapes an engine ran are counted in
``program_shapes`` and logged.

Finish reasons: ``"stop"`` when a stop token was generated (it is kept in the
completion and in the mask), ``"length"`` when ``max_new_tokens`` was reached.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax import sharding as shd
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.rollout import ROUTING_PAD, RolloutBatch, build_batch, left_pad, pad_axis, routing_dtype
from pdm_jax.sampler import quantize as quant
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler import wire
# Request validation lives with the wire schema (its errors name wire fields); re-exported here.
from pdm_jax.sampler import defaults
from pdm_jax.sampler.defaults import BATCHING_MODES
from pdm_jax.sampler.wire import MAX_SEED, MIN_TEMPERATURE, RequestError, validate_request  # noqa: F401

log = logging.getLogger(__name__)

def resolve_compute_dtype(compute_dtype, quantization: str, backend: Optional[str] = None):
    """The sampler's compute dtype: an explicit float32/bfloat16, or the choice of ``"auto"`` / None.

    ``auto``: float32 for quantization ``none`` (bit-compatible with the trainer);
    for ``bf16`` / ``fp8`` float32 on the CPU backend -- XLA:CPU has no fast bf16
    matmul (bf16 decode measured 3x slower than f32 at batch 32, ``bench/bench_sampler.py``),
    and the weights keep their bf16/fp8/int8/int4 values exactly in f32 -- and bfloat16 on
    TPU/GPU (`backend`, default ``jax.default_backend()``).

    Raises:
      ValueError: naming ``compute_dtype`` and its value for anything else.
    """
    quant.check_quantization(quantization)
    if compute_dtype is None or (isinstance(compute_dtype, str) and compute_dtype == "auto"):
        if quantization == "none" or (backend or jax.default_backend()) == "cpu":
            return jnp.dtype(jnp.float32)
        return jnp.dtype(jnp.bfloat16)
    try:
        dtype = jnp.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"compute_dtype = {compute_dtype!r}: must be one of {quant.COMPUTE_DTYPES}")
    return dtype


class StaleWeightsError(wts.WeightsError):
    """A weights load with a version that is not newer than the current one."""


def abstract_engine_model(config, dtype) -> Qwen3ForCausalLM:
    """The engine's model as abstract arrays (``nnx.eval_shape``) in ``dtype``; the dry run compiles the same.

    A MoE model's experts run with ``moe_implementation="auto"``: the grouped-matmul kernel for the
    platform the engine's programs are compiled for (`pdm_jax.models.moe.resolve_implementation`:
    megablox on TPU, row blocks on GPU, ``ragged_dot`` on CPU).
    """
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                                                   moe_implementation="auto"))


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): the engine's batch and slot buckets."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _bucket(x: int, lo: int, hi: int) -> int:
    return int(min(max(next_pow2(x), lo), hi))


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


def _sample_step(logits_BxV, keys_B, t, temperature_B, top_p_B, top_k_B, k_logprobs: int, may_filter: bool = True):
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


def _laid_out(cache):
    """The KV cache constrained to the active mesh's layout (`sharding.KV_CACHE_K_AXES` / ``_V_AXES``:
    rows over data, kv heads over tensor); the cache itself without a mesh (single-device engine)."""
    return type(cache)(k=tuple(shd.constrain(k, shd.KV_CACHE_K_AXES) for k in cache.k),
                       v=tuple(shd.constrain(v, shd.KV_CACHE_V_AXES) for v in cache.v))


def copy_row(dst, i, src, j):
    """KV cache `dst` with row ``i``'s first W positions replaced by row ``j`` of cache `src`, W the shorter of the
    two caches' lengths (k and v of every layer; ``i``, ``j`` int32 scalars, traced), laid out by `_laid_out`.
    Continuous batching moves a row this way: prefill store -> slot (admit), slot -> park (the park holds the
    first phase's P + T/4 slots of a row), park -> slot."""
    zero = jnp.int32(0)

    def put(d, s, axis):  # axis: the cache-slot axis (k: 3, v: 2)
        row = jax.lax.dynamic_slice_in_dim(s, j, 1, axis=0)
        row = jax.lax.slice_in_dim(row, 0, min(row.shape[axis], d.shape[axis]), axis=axis)
        return jax.lax.dynamic_update_slice(d, row, (i, zero, zero, zero))
    return _laid_out(type(dst)(k=tuple(put(d, s, 3) for d, s in zip(dst.k, src.k)),
                               v=tuple(put(d, s, 2) for d, s in zip(dst.v, src.v))))


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


def _generate_program(graphdef, state, prompt_ids_BxP, prompt_mask_BxP, seeds_Bx2, prompt_idx_B, sample_idx_B,
                      temperature_B, top_p_B, top_k_B, max_new_B, stop_ids_BxS, *, num_new: int, k_logprobs: int,
                      cache_dtype, first_segment: int, group: int = 1, routing: bool = False,
                      slice_layers_once: bool = False):
    """The jitted prefill + while-loop decode for one (B, P, T=num_new, K) bucket.

    ``slice_layers_once`` (static): slice every layer's weights out of the stacks once, before the loops
    (`hoist_layer_slices`).

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
    model = nnx.merge(graphdef, state)
    layers = model.decode_layers() if slice_layers_once else None
    b, p = prompt_ids_BxP.shape
    ends = cache_segments(num_new, first_segment)
    cache = _laid_out(model.init_cache(b, p + ends[0], dtype=cache_dtype))
    prompt_len_B = jnp.sum(prompt_mask_BxP, axis=-1).astype(jnp.int32)
    positions_BxP = jnp.maximum(jnp.cumsum(prompt_mask_BxP, axis=-1) - 1, 0).astype(jnp.int32)
    kv_mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.ones((b, num_new), bool)], axis=-1)
    rkw = dict(return_routing=True) if routing else {}
    if group > 1:
        cache_u = model.init_cache(b // group, p + ends[0], dtype=cache_dtype)
        logits_Ux1xV, cache_u, *routed_u = model.decode(prompt_ids_BxP[::group], positions_BxP[::group], cache_u,
                                                        jnp.int32(0), kv_mask_BxS[::group, :p + ends[0]],
                                                        last_logits_only=True, **rkw)
        prefill_routed = [jnp.repeat(r, group, axis=0) for r in routed_u]
        cache = _laid_out(jax.tree.map(lambda a: jnp.repeat(a, group, axis=0), cache_u))
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
    sample = functools.partial(_sample_step, temperature_B=temperature_B, top_p_B=top_p_B, top_k_B=top_k_B,
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
            grown = _laid_out(carry[2].grow(pad))
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
            cache = _laid_out(cache)
            outs, tok, done, length, stopped = record(outs, t, done, length, stopped, logits_Bx1xV[:, 0, :])
            return t + 1, tok, cache, done, length, stopped, outs, routed

        carry = jax.lax.while_loop(cond, body, carry)
    t_final, _, _, _, length_B, stopped_B, outs, routed = carry
    tokens_BxT, logp_BxT, topk_ids_BxTxK, topk_lp_BxTxK = outs
    return dict(tokens=tokens_BxT, logp=logp_BxT, topk_ids=topk_ids_BxTxK, topk_logp=topk_lp_BxTxK,
                length=length_B, stopped=stopped_B, steps=t_final, **({} if routed is None else dict(routed=routed)))


# One module-level jit: engines with equal configs (equal graphdefs) share compiled buckets.
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


_GENERATE_JIT = jax.jit(_generate_program, static_argnums=(0,),
                        static_argnames=("num_new", "k_logprobs", "cache_dtype", "first_segment", "group", "routing",
                                         "slice_layers_once"))


# ---------------------------------------------------------------- continuous batching: the typed decode state
@flax.struct.dataclass
class _Slots:
    """Per-slot state of continuous batching, each field [S] (S = the cache's slots, or the park's entries)."""

    row: jax.Array  # int32: the queue row the slot runs
    t: jax.Array  # int32: tokens sampled so far (the slot samples token t next)
    live: jax.Array  # bool: the slot runs a row that has not stopped
    prev: jax.Array  # int32: the last sampled token (fed to the model at the next step)
    key: jax.Array  # [S, 2] uint32: the row's key (token t draws with fold_in(key, t))
    plen: jax.Array  # int32: the row's prompt length (positions are plen + t - 1)
    max_new: jax.Array  # int32: the row's new-token limit

    @classmethod
    def empty(cls, n: int, key, *, ones=True) -> "_Slots":
        """``n`` free slots (``t`` and ``plen`` start at 1 in the cache's slots, at 0 in the park's)."""
        fill = jnp.ones if ones else jnp.zeros
        return cls(row=jnp.zeros((n,), jnp.int32), t=fill((n,), jnp.int32), live=jnp.zeros((n,), bool),
                   prev=jnp.zeros((n,), jnp.int32), key=jnp.zeros((n,) + key.shape, key.dtype),
                   plen=fill((n,), jnp.int32), max_new=jnp.zeros((n,), jnp.int32))


@flax.struct.dataclass
class _Outputs:
    """The program's outputs per queue row: tokens / log mu [N, T], top-K ids / log mu [N, T, K], ``length`` and
    ``stopped`` [N]; ``routed`` [N, P + T, L, k] with routing replay, else None."""

    tokens: jax.Array
    logp: jax.Array
    topk_ids: jax.Array
    topk_logp: jax.Array
    length: jax.Array
    stopped: jax.Array
    routed: Optional[jax.Array] = None

    def record(self, rows_B, t_B, tok_B, lp_B, ids_BxK, lps_BxK, stop_B) -> "_Outputs":
        """Token ``t_B[b]`` of row ``rows_B[b]`` written (a row index >= N is dropped)."""
        at = dict(mode="drop")
        return self.replace(tokens=self.tokens.at[rows_B, t_B].set(tok_B, **at),
                            logp=self.logp.at[rows_B, t_B].set(lp_B, **at),
                            topk_ids=self.topk_ids.at[rows_B, t_B].set(ids_BxK, **at),
                            topk_logp=self.topk_logp.at[rows_B, t_B].set(lps_BxK, **at),
                            length=self.length.at[rows_B].set(t_B + 1, **at),
                            stopped=self.stopped.at[rows_B].set(stop_B, **at))


@flax.struct.dataclass
class _Park:
    """Rows parked out of the first cache phase: their ``P + caps[0]`` cache slots, slot state, and count ``n``
    (entries [0, n) hold rows)."""

    cache: object
    slots: _Slots
    n: jax.Array


@flax.struct.dataclass
class _DecodeState:
    """The carry of continuous batching's loops: the KV cache [slots, P + T] (`KVCache`), its mask, the slots,
    the outputs, the next queue row, decode steps run, rows parked so far, the cache phase i (attention reads
    P + caps[i] slots) and the park (None when off)."""

    cache: object
    kv_mask: jax.Array
    slots: _Slots
    outs: _Outputs
    queue: jax.Array
    steps: jax.Array
    parked: jax.Array
    phase: jax.Array
    park: Optional[_Park] = None


@flax.struct.dataclass
class _Request:
    """What the loops read and never change: the prefilled prompt store (KV cache [U, P], last logits [U, V],
    prompt routing), the queue (row r: prompt-store entry, key indices, new-token limit), the stop ids, the
    sampling parameters (scalars), and the static sizes (P, T = num_new, K, queue rows N, cache phases, park
    entries)."""

    store: object
    last_UxV: jax.Array
    store_routed: Optional[jax.Array]
    prompt_mask_UxP: jax.Array
    prompt_len_U: jax.Array
    row_entry_N: jax.Array
    row_prompt_N: jax.Array
    row_sample_N: jax.Array
    max_new_N: jax.Array
    stop_ids_S: jax.Array
    num_rows: jax.Array
    base_key: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    p: int = flax.struct.field(pytree_node=False, default=0)
    num_new: int = flax.struct.field(pytree_node=False, default=0)
    k_logprobs: int = flax.struct.field(pytree_node=False, default=0)
    n_pad: int = flax.struct.field(pytree_node=False, default=0)
    caps: tuple = flax.struct.field(pytree_node=False, default=())
    park_n: int = flax.struct.field(pytree_node=False, default=0)
    may_filter: bool = flax.struct.field(pytree_node=False, default=True)

    def sampling(self, b: int) -> dict:
        """`_sample_step`'s per-row sampling parameters for ``b`` rows."""
        return dict(temperature_B=jnp.full((b,), self.temperature, jnp.float32),
                    top_p_B=jnp.full((b,), self.top_p, jnp.float32),
                    top_k_B=jnp.full((b,), self.top_k, jnp.int32), k_logprobs=self.k_logprobs,
                    may_filter=self.may_filter)

    def is_stop(self, tok_B):
        """[B] bool: the token is one of the request's stop ids."""
        return jnp.any(tok_B[:, None] == self.stop_ids_S[None, :], axis=-1)

    def row_kv_mask(self, r, width: int):
        """Row r's kv mask over ``width`` cache slots: its prompt's mask, then every generated slot."""
        return jnp.concatenate([self.prompt_mask_UxP[self.row_entry_N[r]], jnp.ones((width - self.p,), bool)])


def _admit_one(req: _Request, c: _DecodeState, sample1) -> _DecodeState:
    """The next queued row into the first free slot: its prompt's store entry copied into the slot's first P cache
    slots, its kv mask set, its token 0 sampled from the prompt's last logits."""
    r = c.queue
    b = jnp.argmin(c.slots.live).astype(jnp.int32)  # the first free slot
    i = req.row_entry_N[r]
    key = jax.random.fold_in(jax.random.fold_in(req.base_key, req.row_prompt_N[r]), req.row_sample_N[r])
    zero = jnp.int32(0)
    cache = copy_row(c.cache, b, req.store, i)
    row_mask = req.row_kv_mask(r, c.kv_mask.shape[1])
    kv_mask = jax.lax.dynamic_update_slice(c.kv_mask, row_mask[None, :], (b, zero))
    tok, lp, ids, lps = sample1(jax.lax.dynamic_slice_in_dim(req.last_UxV, i, 1, axis=0), key[None], zero)
    stop = req.is_stop(tok)
    outs = c.outs.record(r[None], zero[None], tok, lp, ids, lps, stop)
    if req.store_routed is not None:  # the row's prompt routing, from its prompt's prefill
        outs = outs.replace(routed=jax.lax.dynamic_update_slice(
            outs.routed, jax.lax.dynamic_slice_in_dim(req.store_routed, i, 1, axis=0), (r, zero, zero, zero)))
    live = ~(stop[0] | (req.max_new_N[r] <= 1))
    sl = c.slots
    sl = sl.replace(row=sl.row.at[b].set(r), t=sl.t.at[b].set(1), live=sl.live.at[b].set(live),
                    prev=sl.prev.at[b].set(tok[0]), key=sl.key.at[b].set(key),
                    plen=sl.plen.at[b].set(req.prompt_len_U[i]), max_new=sl.max_new.at[b].set(req.max_new_N[r]))
    return c.replace(cache=cache, kv_mask=kv_mask, slots=sl, outs=outs, queue=r + 1)


def _overflow(req: _Request, c: _DecodeState):
    """[slots] bool: live rows past the first cache phase (token t would be fed into slot P + t - 1)."""
    return c.slots.live & (c.slots.t > req.caps[0])


def _park_one(req: _Request, c: _DecodeState) -> _DecodeState:
    """The first live row past the first phase moved into park entry n (its slot freed)."""
    b = jnp.argmax(_overflow(req, c)).astype(jnp.int32)
    pk, n = c.park, c.park.n
    pslots = jax.tree.map(lambda a, v: a.at[n].set(v[b]), pk.slots, c.slots)
    slots = c.slots.replace(live=c.slots.live.at[b].set(False))
    return c.replace(slots=slots, park=_Park(cache=copy_row(pk.cache, n, c.cache, b), slots=pslots, n=n + 1),
                     parked=c.parked + 1)


def _unpark_one(req: _Request, c: _DecodeState) -> _DecodeState:
    """Park entry n - 1 back into the first free slot of the (grown) cache."""
    pk, n, zero = c.park, c.park.n - 1, jnp.int32(0)
    b = jnp.argmin(c.slots.live).astype(jnp.int32)
    slots = jax.tree.map(lambda a, v: a.at[b].set(v[n]), c.slots, pk.slots)
    kv_mask = jax.lax.dynamic_update_slice(c.kv_mask, req.row_kv_mask(pk.slots.row[n], c.kv_mask.shape[1])[None, :],
                                           (b, zero))
    return c.replace(cache=copy_row(c.cache, b, pk.cache, n), kv_mask=kv_mask, slots=slots, park=pk.replace(n=n))


def _admit(req: _Request, c: _DecodeState) -> _DecodeState:
    """Free slots refilled: parked rows first (past the first phase: they are the oldest), then queued ones."""
    if c.park is not None:
        c = jax.lax.while_loop(lambda c: (c.phase > 0) & (c.park.n > 0) & ~jnp.all(c.slots.live),
                               functools.partial(_unpark_one, req), c)
    sample1 = functools.partial(_sample_step, **req.sampling(1))
    return jax.lax.while_loop(lambda c: (c.queue < req.num_rows) & ~jnp.all(c.slots.live),
                              lambda c: _admit_one(req, c, sample1), c)


def _pending(req: _Request, c: _DecodeState):
    """Rows not yet admitted: the queue's, and (past the first phase) the park's."""
    return (c.queue < req.num_rows) | (((c.park.n > 0) & (c.phase > 0)) if c.park is not None else False)


def _decode_step(model, layers, req: _Request, c: _DecodeState, *, windowed: bool = False,
                 parking: bool = False) -> _DecodeState:
    """Every slot decodes one token (``windowed``: attention reads the P + caps[phase] slots of the cache phase);
    a row stops on a stop id or its max; then (``parking``, in the first phase) rows past the first phase are
    parked while rows are pending."""
    sl = c.slots
    t_B = sl.t
    b = t_B.shape[0]
    p, routing = req.p, c.outs.routed is not None
    index_B = jnp.minimum(p + t_B - 1, c.kv_mask.shape[1] - 1)  # free slots: any in-range slot (never read)
    window = dict(kv_window=(c.phase, tuple(p + cap for cap in req.caps))) if windowed and len(req.caps) > 1 else {}
    logits_Bx1xV, cache, *step_routed = model.decode(
        sl.prev[:, None], (sl.plen + t_B - 1)[:, None], c.cache, index_B, c.kv_mask, layers=layers,
        **window, **(dict(return_routing=True) if routing else {}))
    cache = _laid_out(cache)
    tok, lp, ids, lps = _sample_step(logits_Bx1xV[:, 0, :], sl.key, t_B, **req.sampling(b))
    stop = req.is_stop(tok)
    rows_B = jnp.where(sl.live, sl.row, req.n_pad)
    outs = c.outs.record(rows_B, jnp.minimum(t_B, req.num_new - 1), tok, lp, ids, lps, stop)
    if routing:  # token t - 1 of each live row was fed now: column P + t - 1
        outs = outs.replace(routed=outs.routed.at[rows_B, p + t_B - 1].set(
            step_routed[0][:, 0].astype(outs.routed.dtype), mode="drop"))
    done = stop | (t_B + 1 >= sl.max_new)
    sl = sl.replace(t=jnp.where(sl.live, t_B + 1, t_B), live=sl.live & ~done, prev=jnp.where(sl.live, tok, sl.prev))
    c = c.replace(cache=cache, slots=sl, outs=outs, steps=c.steps + 1)
    if parking:
        c = jax.lax.while_loop(
            lambda c: (c.phase == 0) & (c.queue < req.num_rows) & (c.park.n < req.park_n) & jnp.any(_overflow(req, c)),
            functools.partial(_park_one, req), c)
    return c


def _compact(c: _DecodeState, m: int) -> _DecodeState:
    """The live slots (at most m) moved into a cache of m slots: the tail runs a smaller batch."""
    keep = jnp.argsort(~c.slots.live, stable=True)[:m]
    take = lambda a: jnp.take(a, keep, axis=0)  # noqa: E731
    cache = c.cache
    return c.replace(cache=_laid_out(type(cache)(k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)))),
                     kv_mask=take(c.kv_mask), slots=jax.tree.map(take, c.slots))


def _settle(req: _Request, c: _DecodeState, *, nxt: int) -> _DecodeState:
    """Free slots refilled (`_admit`); then, while the current cache phase cannot run a step (`_runs`) and a later
    one exists, the next phase, and its refill (parked rows come back from phase 1 on). The phases thus change
    between two steps of one decode loop; the step runs unconditionally in that loop's body (a ``lax.cond`` around
    it changed XLA:CPU's fusion and the log-probabilities' last bits)."""
    def body(cf):
        c, first = cf
        return _admit(req, c.replace(phase=c.phase + jnp.where(first, 0, 1))), jnp.bool_(False)
    more = lambda cf: cf[1] | (~_runs(req, cf[0], nxt) & (cf[0].phase < len(req.caps) - 1))  # noqa: E731
    return jax.lax.while_loop(more, body, (c, jnp.bool_(True)))[0]


def _runs(req: _Request, c: _DecodeState, nxt: int):
    """Whether the loop of the current cache phase runs another step: a slot is live, every live row's next token
    fits the phase's P + caps[phase] slots, and rows are pending or more than ``nxt`` slots are live (the next
    level's size; in the first phase with a park, only while the park is empty)."""
    live = c.slots.live
    caps = jnp.asarray(req.caps, jnp.int32)
    fits = jnp.all(~live | (c.slots.t <= caps[c.phase]))  # token t is fed into slot P + t - 1
    many = jnp.sum(live) > nxt
    if c.park is not None:
        many = many & ((c.park.n == 0) | (c.phase > 0))
    return jnp.any(live) & (_pending(req, c) | many) & fits


def _continuous_program(graphdef, state, prompt_ids_UxP, prompt_mask_UxP, row_entry_N, row_prompt_N, row_sample_N, seed_2,
                        temperature, top_p, top_k, max_new_N, stop_ids_S, num_rows, *, slots: int, num_new: int,
                        k_logprobs: int, cache_dtype, routing: bool = False, min_phase: Optional[int] = None,
                        park: int = 0, slice_layers_once: bool = False, may_filter: bool = True, tail: bool = True):
    """Continuous batching: N queued rows decoded in ``slots`` slots of one static KV cache.

    Inputs: U prompts ``prompt_ids_UxP`` / ``prompt_mask_UxP`` (left-padded, [U, P]); the
    queue of N rows (row r: prompt-store entry ``row_entry_N[r]``, sample j = ``row_sample_N[r]``
    of prompt i = ``row_prompt_N[r]`` (its key), ``max_new_N[r]`` new tokens at most; rows ``>= num_rows``
    are padding, never run); the request's sampling parameters (scalars) and stop ids ``stop_ids_S``
    (-1 = unused).

    1. Prefill: every prompt once ([U, P] through ``model.decode`` into a prompt store of
       P slots; shared prefill: a prompt's n rows all read its entry): the `_Request`.
    2. One KV cache [slots, P + T] (per layer, `KVCache` layouts) and per-slot state
       (`_Slots`: row, tokens so far, last token, prompt length, key), carried with the outputs in a
       `_DecodeState`.  Row b keeps the static engine's layout: the prompt in slots 0..P-1, token t's
       key/value at slot P + t - 1 (``model.decode`` with a per-row ``cache_index``), so attention sees the
       same entries as in `_generate_program`.
    3. Admission (`_admit`, an inner while-loop): while a slot is free and rows are pending, the
       next row is copied in (its prompt's store entry into the slot's first P slots,
       its kv mask set), and its token 0 is sampled from the prompt's last logits.
    4. Decode (`_decode_step`, the outer while-loop, one step per iteration while any slot is live):
       all slots decode one token; a row stops on a stop id or its max; its outputs are
       scattered to row ``r`` of the [N, num_new(, K)] outputs; then admission refills.
       Cache-length phases (`cache_phases`), all in the same loop: in phase i attention reads only the first
       P + caps[i] slots (``decode(kv_window=...)``) while every live row's next token fits in them (`_runs`);
       after each step's refill, `_settle` moves to the next phase when the current one cannot run.
       With ``park`` > 0 (and more than one phase), a row that outgrows the first phase while rows
       are pending is parked instead (`_park_one`): its P + caps[0] cache slots and state are copied into a
       `_Park` of ``park x slots`` entries and its slot is refilled, so the first phase's short cache
       serves the queue; parked rows come back (`_unpark_one`, before pending ones) in the later phases.
       The first phase ends when the queue is empty or the park is full.
    5. Tail: once the queue is empty and at most slots/2 rows are live, this program returns; if rows are left,
       `_continuous_compact` gathers the live slots into a cache of slots/2 (`_compact`) and `_continuous_tail`
       decodes them there, then in slots/4 and slots/8 as more rows end (`tail_levels`: `_TAIL_SHRINK`,
       `_TAIL_LEVELS`; no admission there): the last long rows run in smaller batches. Both are programs of their
       own, compiled the first time a request needs them.

    Token t of row (i, j) uses the key ``fold_in(row_key(i, j), t)`` as in
    `_generate_program`, so rows get the same samples whichever slot or step runs them.
    Returns ``(carry, req)``: the `_DecodeState` after the main loop (without the park, empty by then) and the
    `_Request` without its prompt store, which `_continuous_tail` takes (the carry through `_continuous_compact`);
    `_outputs` of the carry (or the tail's) is `_generate_program`'s dict (``steps``: decode steps run;
    ``parked``: rows parked; with ``routing`` ``routed`` [N, P + num_new, L, k]: a row's prompt routing copied from
    its prompt's prefill at admission, token t's written by the step that feeds it).
    """
    model = nnx.merge(graphdef, state)
    layers = model.decode_layers() if slice_layers_once else None  # `hoist_layer_slices`
    u, p = prompt_ids_UxP.shape
    n_pad = row_entry_N.shape[0]
    positions_UxP = jnp.maximum(jnp.cumsum(prompt_mask_UxP, axis=-1) - 1, 0).astype(jnp.int32)
    store = model.init_cache(u, p, dtype=cache_dtype)
    logits_Ux1xV, store, *store_routed = model.decode(prompt_ids_UxP, positions_UxP, store, jnp.int32(0), prompt_mask_UxP,
                                                      last_logits_only=True, **(dict(return_routing=True) if routing else {}))
    base_key = jax.random.fold_in(jax.random.PRNGKey(seed_2[0]), seed_2[1])
    caps = cache_phases(num_new, min_phase)  # the cache holds P + caps[i] slots in main phase i (the last: P + num_new)
    park_n = int(park) * slots if len(caps) > 1 else 0
    outs = _Outputs(tokens=jnp.zeros((n_pad, num_new), jnp.int32), logp=jnp.zeros((n_pad, num_new), jnp.float32),
                    topk_ids=jnp.zeros((n_pad, num_new, k_logprobs), jnp.int32),
                    topk_logp=jnp.zeros((n_pad, num_new, k_logprobs), jnp.float32),
                    length=jnp.zeros((n_pad,), jnp.int32), stopped=jnp.zeros((n_pad,), bool))
    if routing:  # [N, P + num_new, L, k] (see `_generate_program`)
        store_routed = store_routed[0].astype(routing_dtype(model.config.num_experts))
        outs = outs.replace(routed=jnp.full((n_pad, p + num_new) + store_routed.shape[2:], ROUTING_PAD,
                                            store_routed.dtype))
    req = _Request(store=store, last_UxV=logits_Ux1xV[:, -1, :],  # the LM head on the last prompt position only
                   store_routed=store_routed if routing else None, prompt_mask_UxP=prompt_mask_UxP,
                   prompt_len_U=jnp.sum(prompt_mask_UxP, axis=-1).astype(jnp.int32), row_entry_N=row_entry_N,
                   row_prompt_N=row_prompt_N, row_sample_N=row_sample_N, max_new_N=max_new_N,
                   stop_ids_S=jnp.asarray(stop_ids_S, jnp.int32), num_rows=num_rows, base_key=base_key,
                   temperature=temperature, top_p=top_p, top_k=top_k, p=p, num_new=num_new, k_logprobs=k_logprobs,
                   n_pad=n_pad, caps=tuple(caps), park_n=park_n, may_filter=may_filter)
    carry = _DecodeState(cache=_laid_out(model.init_cache(slots, p + num_new, dtype=cache_dtype)),
                         kv_mask=jnp.zeros((slots, p + num_new), bool), slots=_Slots.empty(slots, base_key),
                         outs=outs, queue=jnp.int32(0), steps=jnp.int32(0), parked=jnp.int32(0), phase=jnp.int32(0))
    if park_n:
        carry = carry.replace(park=_Park(cache=_laid_out(model.init_cache(park_n, p + caps[0], dtype=cache_dtype)),
                                         slots=_Slots.empty(park_n, base_key, ones=False), n=jnp.int32(0)))

    # Level 0 runs every slot while rows are pending, in cache-length phases, all in one loop: a step of the
    # current phase (attention reads its P + caps[i] slots), then `_settle` refills free slots and moves to the next
    # phase while the current one cannot run (`_runs`). Once the queue is empty and at most half the slots are
    # live, the loop ends; `_continuous_compact` and `_continuous_tail` run what is left.
    levels = tail_levels(slots, num_new) if tail else [slots]  # without a tail the loop runs every row to its end
    nxt = levels[1] if len(levels) > 1 else 0
    settle = functools.partial(_settle, req, nxt=nxt)
    step = functools.partial(_decode_step, model, layers, req, windowed=True, parking=park_n > 0)
    carry = jax.lax.while_loop(lambda c: _runs(req, c, nxt), lambda c: settle(step(c)), settle(carry))
    # The tail runs in `_continuous_tail`, its own program, only when rows are left: the request's prompt store,
    # last logits and the (now empty) park are not passed on.
    return carry.replace(park=None), req.replace(store=None, last_UxV=None, store_routed=None)


def _continuous_compact(carry: _DecodeState, *, slots: int) -> _DecodeState:
    """The main loop's carry (`_continuous_program`: the queue empty, at most slots / 2 live) gathered into a cache of
    slots / 2 (`_compact`). A program of its own, before `_continuous_tail`: while it runs the full cache and the
    half one are live, and nothing else of a decode step; the tail program then holds only the half cache (and its
    smaller levels), not the full one beside them."""
    return _compact(carry, tail_levels(slots, carry.outs.tokens.shape[1])[1])


def _continuous_tail(graphdef, state, carry: _DecodeState, req: _Request, *, slots: int,
                     slice_layers_once: bool = False):
    """Continuous batching's tail (`_continuous_program` step 5): the live rows of ``carry`` (`_DecodeState` at the
    last cache phase, the queue empty, already in a cache of slots / 2: `_continuous_compact`) decoded to the end in
    halving caches (slots / 2, slots / 4, ...: `tail_levels`; each loop runs while more than the next level's slots
    are live, then `_compact` moves the live rows down a level; no admission there). A program of its own, so that a
    request whose rows all end in the main loop (uniform lengths, or more rows than slots) never compiles it.
    Returns `_outputs`' dict."""
    model = nnx.merge(graphdef, state)
    layers = model.decode_layers() if slice_layers_once else None  # `hoist_layer_slices`
    levels = tail_levels(slots, req.num_new)
    for li, level in enumerate(levels[1:], start=1):
        if li > 1:
            carry = _compact(carry, level)
        nxt = levels[li + 1] if li + 1 < len(levels) else 0
        carry = jax.lax.while_loop(lambda c, nxt=nxt: _runs(req, c, nxt),
                                   functools.partial(_decode_step, model, layers, req), carry)
    return _outputs(carry)


def _outputs(carry: _DecodeState) -> dict:
    """The continuous program's result: the rows' outputs, decode steps run and rows parked (`_generate_program`'s
    dict; ``routed`` with routing replay)."""
    outs = carry.outs
    return dict(tokens=outs.tokens, logp=outs.logp, topk_ids=outs.topk_ids, topk_logp=outs.topk_logp,
                length=outs.length, stopped=outs.stopped, steps=carry.steps, parked=carry.parked,
                **({} if outs.routed is None else dict(routed=outs.routed)))


def tail_levels(slots: int, num_new: int) -> list:
    """Continuous batching's slot counts for requests of ``num_new`` (the bucket T) new tokens: ``slots``, then the
    tail's. For T >= `_HALVING_MIN_NEW`: slots / 2, slots / 4, ... (`_TAIL_SHRINK`, at most `_TAIL_LEVELS` levels in
    all, none under 1). Shorter requests keep one tail level of slots / 4: their rows cannot run long at low
    occupancy, so more levels would add loops to compile and little else."""
    if num_new < _HALVING_MIN_NEW:
        return [int(slots)] + ([int(slots) // 4] if slots >= 4 else [])
    levels = [int(slots)]
    while len(levels) < _TAIL_LEVELS and levels[-1] // _TAIL_SHRINK >= 1:
        levels.append(levels[-1] // _TAIL_SHRINK)
    return levels


def cache_phases(num_new: int, min_phase: Optional[int] = None) -> list:
    """Continuous batching's cache-length phases: new-token capacities [T/4, T/2, T] of the KV cache (P + cap
    slots read) for T = num_new >= 4 * min_phase (default `_MIN_PHASE`), [T/2, T] for T >= 2 * min_phase, else [T].
    Attention reads the first P + cap slots of every row, so the first steps of a request (no row past T/4 tokens
    yet) read P + T/4 slots instead of P + T. The phases share one decode loop: only each layer's attention is
    compiled once per phase (a ``lax.switch`` over the widths)."""
    lo = _MIN_PHASE if min_phase is None else int(min_phase)
    caps = [c for c in (num_new // 4, num_new // 2) if c >= max(lo, 1)]
    return caps + [int(num_new)]


_MIN_PHASE = 32  # continuous batching: no cache phase shorter than this many new tokens
_TAIL_SHRINK = 2  # continuous batching: the tail's cache shrinks by this factor per level ...
_TAIL_LEVELS = 4  # ... into at most this many slot counts (slots, slots/2, slots/4, slots/8): the main loop, then the
#                   tail program's loops (with fewer live rows than slots, every slot still pays a step's sampling
#                   and attention: halving the cache as rows end keeps the last, longest rows of a mixed-length
#                   request cheap)
_HALVING_MIN_NEW = 64  # ... for requests of at least this many new tokens (shorter ones: one level, slots / 4)
_SMALL_REQUEST = 4  # a request of at most max_slots / this many rows runs in a cache of that many slots, one phase
_CONTINUOUS_JIT = jax.jit(_continuous_program, static_argnums=(0,),
                          static_argnames=("slots", "num_new", "k_logprobs", "cache_dtype", "routing", "min_phase",
                                           "park", "slice_layers_once", "may_filter", "tail"))
_CONTINUOUS_COMPACT_JIT = jax.jit(_continuous_compact, static_argnames=("slots",))
_CONTINUOUS_TAIL_JIT = jax.jit(_continuous_tail, static_argnums=(0,), static_argnames=("slots", "slice_layers_once"))


def make_sampler_mesh(data: int = 1, tensor: int = 1, devices=None):
    """The sharded engine's mesh: ``data`` x ``tensor`` devices (fsdp 1) over ``pdm_jax.sharding.MESH_AXES``.

    ``devices``: the first ``data * tensor`` of them are used (default ``jax.devices()``): a colocated
    engine takes a sub-mesh of the trainer's devices (or all of them), a server its own.
    Returns None for 1 x 1 (the single-device engine).
    Raises:
      ValueError: naming ``data`` / ``tensor`` for sizes < 1 or more devices than there are.
    """
    for name, v in (("data", data), ("tensor", tensor)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"sampler mesh: {name} must be an integer >= 1, got {v!r}")
    if data * tensor == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if data * tensor > len(devices):
        raise ValueError(f"sampler mesh: data x tensor = {data} x {tensor} = {data * tensor} devices, "
                         f"but only {len(devices)} are available")
    return shd.make_mesh(data=int(data), fsdp=1, tensor=int(tensor), devices=devices[:data * tensor])


def check_engine_mesh(config, mesh, *, max_batch_size: int, max_slots: int) -> int:
    """Refuses a mesh the engine cannot split evenly; returns the row shards (data x fsdp).

    The tensor axis must divide the attention heads, the kv heads (the KV cache's sharded axis)
    and the MLP widths (``intermediate_size``; MoE also ``moe_intermediate_size``); the row shards must divide
    ``max_batch_size`` and ``max_slots`` (rows are split over them).  ``pdm_jax.sharding`` would
    silently replicate a non-dividing axis; a sampler that was asked to shard says so instead.
    Raises:
      ValueError: naming the model field or limit, its value and the axis size.
    """
    sizes = dict(mesh.shape)
    missing = [a for a in shd.MESH_AXES if a not in sizes]
    if missing:
        raise ValueError(f"SamplingEngine: mesh axes {tuple(sizes)} lack {missing} (use make_sampler_mesh)")
    t, rows = sizes["tensor"], sizes["data"] * sizes["fsdp"]
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size"]
    fields += ["moe_intermediate_size"] if getattr(config, "num_experts", 0) else []
    for field, v in ((f, getattr(config, f)) for f in fields):
        if v % t:
            raise ValueError(f"SamplingEngine: model {field} = {v} is not divisible by the mesh's tensor axis "
                             f"({t}); pick sampler.mesh.tensor dividing it")
    for field, v in (("max_batch_size", max_batch_size), ("max_slots", max_slots)):
        if v % rows:
            raise ValueError(f"SamplingEngine: {field} = {v} is not divisible by the mesh's row shards "
                             f"(data x fsdp = {rows}); rows are split over them")
    return rows


class SamplingEngine:
    """Quantized-copy sampler with KV-cache decode; produces `RolloutBatch`es.

    Args:
      config: ``pdm_jax.models.qwen3.Qwen3Config``.
      params: trainer weights: an ``nnx.Module``, ``nnx.State`` or nested pure
        dict of arrays (any float dtype; f32 expected).
      quantization: ``"none"`` (f32, bit-compatible with the trainer), ``"bf16"``,
        ``"fp8"`` (e4m3 weight-only, per-output-channel) or ``"int8"`` / ``"int4"`` / ``"int2"`` (weight-only, per
        channel; int2 a stress lever only; see quantize.py).
      version: weights version of `params`, reported per sequence.
      weight_noise: relative std of the fixed Gaussian perturbation of the sampler's copy
        (`quant.prepare_sampler_params`' ``weight_noise``; ``sampler.weight_noise``, the dialable
        behaviour/trainer mismatch lever), in [0, 1]; 0 = none.
      weight_noise_seed: its seed, an integer in [0, 2**32); the same draws for every version.
      weights_path: where `params` came from (for idempotent reloads), or None.
      compute_dtype: activations/weights/KV-cache dtype of the sampler forward:
        ``None``/``"auto"`` (`resolve_compute_dtype`: f32 for none, and for bf16/fp8/int8/int4
        f32 on the CPU backend, bf16 on TPU/GPU), ``"float32"`` or ``"bfloat16"``.
        The bf16/fp8/int8/int4 weights are rounded / quantized-dequantized once per version
        and then held in this dtype, so f32 keeps their values exactly; logits are
        always f32.
      max_prompt_length: longest accepted prompt (tokens); also the largest prompt bucket.
      max_new_tokens: largest accepted ``max_new_tokens``; the largest decode bucket.
      max_batch_size: largest batch bucket; bigger requests run in chunks.
      min_prompt_bucket: smallest prompt bucket (fewer compiles for short prompts).
      min_new_tokens_bucket: smallest decode bucket (the loop still stops at the
        requested max_new_tokens; a larger bucket costs cache memory and attention
        over masked slots).
      first_cache_segment: the KV cache starts with ``P + first_cache_segment``
        slots and doubles while decoding (`cache_segments`); each extra segment
        adds one copy of the decode loop to the compiled program.
      max_stop_tokens: capacity of the per-row stop-id table.
      max_sequences: most sequences (prompts x n) one request may ask for.
      batching: ``"static"`` (chunks of up to ``max_batch_size`` rows, each run until its longest
        row stops, `_generate_program`) or ``"continuous"`` (the default, `pdm_jax.sampler.defaults`; `_continuous_program`:
        the whole request queued into ``max_slots`` slots of one static cache; a slot whose row
        stops takes the next pending row; same tokens and log mu as static, tests).
      max_slots: slots of the continuous cache (None: ``max_batch_size``; rounded up to a power
        of two); every continuous request runs in this many slots, or max_slots / 4 for a request of at most
        that many rows (when the row shards divide it; few shapes: bounded compiles).
      share_prefill: prefill each prompt once for its n samples and repeat its KV cache
        (`_generate_program`'s ``group``) when a batch chunk holds whole groups of n rows
        and its bucket is a multiple of n (n a power of two, ``max_batch_size`` a multiple
        of n); otherwise every row is prefilled. Same numbers either way (tests).
      device: a ``jax.Device`` that holds the sampler's weights and runs generation (a colocated
        engine: one of the trainer's devices). `set_params` then builds the copy there from
        parameters sharded anywhere (`quantize.prepare_sampler_params`' ``device``), never
        sharing a buffer with them, and counts NaN/inf in every leaf. None (a server, a
        file-fed engine): the default device.
      mesh: a ``jax.sharding.Mesh`` over ``pdm_jax.sharding.MESH_AXES`` (`make_sampler_mesh`): the
        sharded engine. Its weights (and their quantized copies) are placed by the model's logical-axis
        rules (`pdm_jax.sharding.param_shardings`: heads / kv heads / MLP / vocab over ``tensor``,
        ``embed`` over ``fsdp``), the programs are traced under `sharding.activation_sharding` (rows
        over ``data`` x ``fsdp``) and every KV cache is constrained to `sharding.KV_CACHE_K_AXES` /
        ``_V_AXES`` (rows over data, kv heads over tensor).  Batch buckets start at the row-shard
        count.  Same tokens as the single-device engine; log mu within float32 reduction-order
        rounding (tests/test_sampler_sharded.py).  Excludes `device`.  None: one device.
      park_rows: continuous batching parks up to ``park_rows x max_slots`` rows that outgrow the first
        cache phase while rows are pending (`_continuous_program`; 0: never), so the short first-phase
        cache serves the queue; the same tokens either way (tests), fewer attention reads with mixed
        lengths (bench/bench_continuous_batching.py), ``park_rows x slots x (P + T/4)`` more cache entries.
    Raises:
      ValueError: bad quantization or limits (prompt + new tokens beyond the
        model's ``max_position_embeddings``, non-positive sizes); with `mesh`, attention heads,
        kv heads or the MLP width not divisible by the ``tensor`` axis, or ``max_batch_size`` /
        ``max_slots`` not divisible by the row shards (`check_engine_mesh`).
    """

    def __init__(self, config, params, *, quantization: str = "none", version: int = 0,
                 weights_path: Optional[str] = None, compute_dtype=None, max_prompt_length: int = 512,
                 max_new_tokens: int = 256, max_batch_size: int = defaults.MAX_BATCH_SIZE, min_prompt_bucket: int = 8,
                 min_new_tokens_bucket: int = 16, first_cache_segment: int = 64, max_stop_tokens: int = wire.MAX_STOP_TOKEN_IDS,
                 max_sequences: int = 4096, share_prefill: bool = True,
                 output_axes_fn=quant.default_output_axes, device=None, batching: str = defaults.BATCHING,
                 max_slots: Optional[int] = None, mesh=None, park_rows: int = defaults.PARK_ROWS,
                 weight_noise: float = 0.0, weight_noise_seed: int = 0):
        quant.check_quantization(quantization)
        self.weight_noise = quant.check_weight_noise(weight_noise)
        self.weight_noise_seed = quant.check_noise_seed(weight_noise_seed)
        if batching not in BATCHING_MODES:
            raise ValueError(f"SamplingEngine: batching must be one of {BATCHING_MODES}, got {batching!r}")
        max_slots = max_batch_size if max_slots is None else max_slots
        for name, v in (("max_prompt_length", max_prompt_length), ("max_new_tokens", max_new_tokens),
                        ("max_batch_size", max_batch_size), ("min_prompt_bucket", min_prompt_bucket),
                        ("min_new_tokens_bucket", min_new_tokens_bucket), ("max_sequences", max_sequences),
                        ("first_cache_segment", first_cache_segment),
                        ("max_stop_tokens", max_stop_tokens), ("max_slots", max_slots)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"SamplingEngine: {name} must be an integer >= 1, got {v!r}")
        if max_prompt_length + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"SamplingEngine: max_prompt_length + max_new_tokens = {max_prompt_length + max_new_tokens} "
                             f"exceeds max_position_embeddings = {config.max_position_embeddings}")
        self.config = config
        self.quantization = quantization
        self.compute_dtype = resolve_compute_dtype(compute_dtype, quantization)
        self.max_prompt_length = int(max_prompt_length)
        self.max_new_tokens = int(max_new_tokens)
        self.max_batch_size = next_pow2(int(max_batch_size))
        self.min_prompt_bucket = int(min_prompt_bucket)
        self.min_new_tokens_bucket = int(min_new_tokens_bucket)
        self.max_stop_tokens = int(max_stop_tokens)
        self.max_sequences = int(max_sequences)
        self.first_cache_segment = int(first_cache_segment)
        self.share_prefill = bool(share_prefill)
        self.batching = batching
        self.max_slots = next_pow2(int(max_slots))
        if mesh is not None and device is not None:
            raise ValueError("SamplingEngine: give either device (one device) or mesh (sharded), not both")
        self.mesh = mesh
        self.row_shards = 1 if mesh is None else check_engine_mesh(
            config, mesh, max_batch_size=self.max_batch_size, max_slots=self.max_slots)
        self.program_shapes = set()  # distinct (program, static shapes) run: each one compiled once (logged)
        self.min_cache_phase = _MIN_PHASE  # continuous batching: shortest cache phase (`cache_phases`; tests lower it)
        self.last_decode_steps = 0  # decode steps of the last program run (bench)
        if not isinstance(park_rows, (int, np.integer)) or isinstance(park_rows, bool) or park_rows < 0:
            raise ValueError(f"SamplingEngine: park_rows must be an integer >= 0, got {park_rows!r}")
        self.park_rows = int(park_rows)
        self.parked_rows = 0  # rows parked so far by continuous programs (`park_rows`)
        self._output_axes_fn = output_axes_fn
        self.device = device
        self.slice_layers_once = hoist_layer_slices(device.platform if device is not None else
                                                   mesh.devices.flat[0].platform if mesh is not None else
                                                   jax.default_backend())
        dt = self.compute_dtype
        abstract_model = abstract_engine_model(config, dt)
        self._graphdef, self._abstract_state = nnx.split(abstract_model)
        self._shardings = None if mesh is None else nnx.to_pure_dict(
            shd.param_shardings(nnx.state(abstract_model, nnx.Param), mesh))
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()  # one weights load at a time; generation goes on while its files are read
        self.loading: Optional[dict] = None  # {"version", "since"} while a load reads its files (`health`)
        self._program = _GENERATE_JIT
        self.prefill_rows = 0  # prompt rows prefilled so far (padding rows included), with shared prefill
        self.prefill_rows_unshared = 0  # ... and what they would have been without it
        self._state = None
        self._version = None
        self._weights_path = None
        self.set_params(params, version=version, weights_path=weights_path)

    # ----------------------------------------------------------------- weights
    @property
    def version(self) -> int:
        """The weights version currently loaded."""
        return self._version

    @property
    def weights_path(self) -> Optional[str]:
        """The directory the current weights were loaded from (None if given in memory)."""
        return self._weights_path

    def set_params(self, params, *, version: int, weights_path: Optional[str] = None,
                   finite_checked: bool = False) -> None:
        """Quantizes `params` (module/state/pure dict, f32) and installs them as `version`.

        Raises:
          WeightsError: the quantizer refuses the weights (e.g. non-finite, fp8) or
            they do not fit the model; the current weights stay installed.
        """
        pure = wts.to_pure_dict(params)
        try:
            prepared = quant.prepare_sampler_params(pure, self.quantization, compute_dtype=self.compute_dtype,
                                                    check_finite=not finite_checked,
                                                    output_axes_fn=self._output_axes_fn, device=self.device,
                                                    check_all_finite=self.device is not None or self.mesh is not None,
                                                    shardings=self._shardings, weight_noise=self.weight_noise,
                                                    noise_seed=self.weight_noise_seed)
        except ValueError as e:  # e.g. a non-finite weight refused by the fp8 quantizer
            where = f" from {weights_path!r}" if weights_path else ""
            raise wts.WeightsError(f"weights version {version}{where} cannot be quantized "
                                   f"({self.quantization}): {e}") from e
        state = jax.tree.map(lambda x: x, self._abstract_state)
        try:
            nnx.replace_by_pure_dict(state, prepared)
        except Exception as e:
            raise wts.WeightsError(f"parameters do not match the model structure: {type(e).__name__}: {e}") from e
        bad = [(str(a.shape), str(b.shape)) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(self._abstract_state))
               if tuple(a.shape) != tuple(b.shape)]
        if bad:
            raise wts.WeightsError(f"parameter shapes do not match the model: got {bad[0][0]}, expected {bad[0][1]}")
        with self._lock:
            # prepared on self.device / on the mesh
            self._state = jax.device_put(state) if self.device is None and self.mesh is None else state
            self._version = int(version)
            self._weights_path = None if weights_path is None else os.path.realpath(weights_path)

    def load_weights(self, path: str, version: int, *, root: Optional[str] = None) -> dict:
        """Loads weights `version` from a `save_weights` directory and re-quantizes.

        Accepted when ``version > self.version``, or ``version == self.version``
        and `path` is the directory the current weights came from (idempotent
        reload: the output is then identical).  The files are read without the lock generation holds (a slow or
        stuck read never stops serving; `health` reports ``loading`` meanwhile); `root` confines every read to a
        directory (`weights.ConfinedDir`: no link followed, no FIFO, sizes checked before reading).
        Returns ``{"version", "path", "seconds", "reloaded"}``.
        Raises:
          StaleWeightsError: version <= current (except the idempotent case).
          WeightsError: missing/incomplete/damaged directory (`weights.load_weights`
            checks its manifest), its recorded version differs from `version`
            (`weights.VersionMismatchError`), non-finite values, or shapes that do
            not match the model.  On any error the current weights stay.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) \
                or not 0 <= version <= wts.MAX_VERSION:
            raise wts.WeightsError(f"version must be an integer in [0, 2**31), got {version!r}")
        real = os.path.realpath(path)
        with self._load_lock:
            self._check_not_stale(version, real)
            t0 = time.perf_counter()
            self.loading = {"version": int(version), "since": time.monotonic()}
            try:
                pure = wts.load_weights(real, abstract=wts.to_pure_dict(self._abstract_state_f32()), version=version,
                                        root=root)
                with self._lock:
                    same = self._check_not_stale(version, real)
                    self.set_params(pure, version=int(version), weights_path=real, finite_checked=True)  # load refused NaN/inf
            finally:
                self.loading = None
            return wire.weights_loaded(version=int(version), path=real, seconds=time.perf_counter() - t0,
                                       reloaded=bool(same))

    def _check_not_stale(self, version: int, real: str) -> bool:
        """Raises StaleWeightsError unless `version` may load from `real` (`load_weights`); True for a reload."""
        with self._lock:
            same = version == self._version and self._weights_path is not None and real == self._weights_path
            if version < self._version or (version == self._version and not same):
                raise StaleWeightsError(
                    f"stale weights version {version}: the sampler holds version {self._version}"
                    f" (from {self._weights_path!r}); a new load needs a higher version, or the same version "
                    f"and the same path")
            return same

    def _abstract_state_f32(self):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), self._abstract_state)

    @property
    def params(self) -> dict:
        """The sampler's (quantized, compute-dtype) parameters as a nested pure dict."""
        return nnx.to_pure_dict(self._state)

    def model(self):
        """An ``nnx`` Qwen3ForCausalLM holding the sampler's current (quantized) weights."""
        return nnx.merge(self._graphdef, self._state)

    def health(self) -> dict:
        """``{"status", "model", "quantization", "weight_noise", "weight_noise_seed", "version", "compute_dtype",
        limits...}``."""
        c = self.config
        return wire.health_body(
            model=f"qwen3(L={c.num_hidden_layers},H={c.hidden_size},V={c.vocab_size})",
            quantization=self.quantization, weight_noise=self.weight_noise, weight_noise_seed=self.weight_noise_seed,
            version=self._version, compute_dtype=str(self.compute_dtype),
            vocab_size=c.vocab_size, max_prompt_length=self.max_prompt_length, max_new_tokens=self.max_new_tokens,
            weights_path=self._weights_path, loading=self.loading)

    # -------------------------------------------------------------- generation
    def validate(self, prompts, *, n=1, temperature=1.0, max_new_tokens=None, top_k_logprobs=20,
                 stop_token_ids=(), seed=None, top_p=1.0, top_k=0, first_prompt_index=0, return_routing=False) -> list:
        """`validate_request` against this engine's limits (raises RequestError; ``return_routing``
        from a dense model is refused naming ``return_routing``)."""
        if return_routing and not self.config.is_moe:
            raise RequestError(wire.RETURN_ROUTING, "the served model is dense (num_experts = 0): it has no "
                                                    "expert routing to return")
        return validate_request(
            prompts, n=n, temperature=temperature,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            top_k_logprobs=top_k_logprobs, stop_token_ids=stop_token_ids, seed=seed, top_p=top_p, top_k=top_k,
            vocab_size=self.config.vocab_size, max_prompt_length=self.max_prompt_length,
            max_new_tokens_limit=self.max_new_tokens, max_stop_tokens=self.max_stop_tokens,
            max_sequences=self.max_sequences, first_prompt_index=first_prompt_index, return_routing=return_routing)

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, temperature: float = 1.0,
                 max_new_tokens: Optional[int] = None, top_k_logprobs: int = 20,
                 stop_token_ids: Sequence[int] = (), seed: Optional[int] = None, top_p: float = 1.0,
                 top_k: int = 0, first_prompt_index: int = 0, return_routing: bool = False) -> RolloutBatch:
        """Samples `n` completions per prompt; returns a RolloutBatch (rows prompt-major).

        Args:
          prompts: token-id lists, each 1..max_prompt_length long, ids in [0, V).
          n: samples per prompt (>= 1); row i*n+j is sample j of prompt i, group_ids = i.
          temperature: tau >= 0 (0 = greedy, logprobs then at tau = 1).
          max_new_tokens: 1..engine.max_new_tokens (default: the engine's).
          top_k_logprobs: K in [0, V]; topk_* arrays are [N, T, K] f32/int32.
          stop_token_ids: ids that end a sequence (kept, finish_reason "stop").
          seed: in [0, 2**63); None draws a fresh random seed.
          top_p, top_k: nucleus / top-k filters (off: 1.0 / 0).
          first_prompt_index: f >= 0: prompt i draws with the key of prompt f + i (module docstring);
            group_ids stay 0..len(prompts)-1.
          return_routing: MoE models only: also return ``routed_experts`` [N, P + T, L, k]
            (`rollout.routing_dtype`), the experts each layer ran for every prompt and completion
            token (routing replay, `RolloutBatch`); the tokens are the same either way.
        Returns:
          RolloutBatch with T = the longest completion; pads are id 0, logprob 0.
        Raises:
          RequestError: invalid request (names the field).
        """
        prompts = self.validate(prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                top_k_logprobs=top_k_logprobs, stop_token_ids=stop_token_ids, seed=seed,
                                top_p=top_p, top_k=top_k, first_prompt_index=first_prompt_index, return_routing=return_routing)
        routing = bool(return_routing)
        max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        seed = secrets.randbelow(MAX_SEED + 1) if seed is None else int(seed)
        rows = [(i, j) for i in range(len(prompts)) for j in range(int(n))]
        key_offset = int(first_prompt_index)
        with self._lock:
            version, state = self._version, self._state
            if self.batching == "continuous":
                part = self._run_continuous(state, prompts, rows, temperature=float(temperature), top_p=float(top_p),
                                            top_k=int(top_k), max_new=max_new, k=int(top_k_logprobs),
                                            stops=list(stop_token_ids or ()), seed=seed, routing=routing, key_offset=key_offset)
                return self._to_batch(prompts, rows, [part], version)
            parts = []
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start:start + self.max_batch_size]
                parts.append(self._run_chunk(state, prompts, chunk, temperature=float(temperature),
                                             top_p=float(top_p), top_k=int(top_k), max_new=max_new,
                                             k=int(top_k_logprobs), stops=list(stop_token_ids or ()), seed=seed,
                                             n=int(n), routing=routing, key_offset=key_offset))
        return self._to_batch(prompts, rows, parts, version)

    def _layout(self):
        """The context programs run in: `sharding.activation_sharding` on the engine's mesh (the
        model's activation constraints and `_laid_out` apply while tracing), or none."""
        return contextlib.nullcontext() if self.mesh is None else shd.activation_sharding(self.mesh)

    def _note_program(self, key: tuple) -> None:
        """Counts (``program_shapes``) and logs a program shape this engine has not run before: one compile
        each, plus a continuous bucket's tail program the first time a request needs it (engines of one model
        config share them: the jits are module-level)."""
        if key not in self.program_shapes:
            self.program_shapes.add(key)
            log.info("sampler: %d distinct generate programs; new: %s", len(self.program_shapes), key)

    def _run_continuous(self, state, prompts, rows, *, temperature, top_p, top_k, max_new, k, stops, seed, routing=False,
                        row_max_new=None, key_offset=0):
        """The whole request through `_continuous_program`; returns `_run_chunk`'s dict for all rows.

        ``row_max_new``: per-row limits (each <= max_new) instead of max_new for all (tests);
        ``key_offset``: added to each row's prompt index in its key (``first_prompt_index``).

        Static shapes (few, to bound compiles): ``max_slots`` slots, or max_slots / 4 with no tail for a request
        of at most that many rows (a smaller request leaves slots empty), the row queue next_pow2(N) (at least the
        slots), the prompt store next_pow2(U) (at least max_slots / 4), the prompt and new-token buckets of
        `_run_chunk`. The tail (`_continuous_compact`, then `_continuous_tail`) runs, and compiles, only when rows are
        left after the main loop.
        """
        n_rows = len(rows)
        slots = self.max_slots
        # A request of at most slots / 4 rows runs in a cache of that many slots, with no tail and one cache phase
        # (no park): one decode loop without phase branches to compile, attention over all P + T slots.
        small = (slots // _SMALL_REQUEST >= 1 and n_rows <= slots // _SMALL_REQUEST
                 and (slots // _SMALL_REQUEST) % self.row_shards == 0)
        if small:
            slots //= _SMALL_REQUEST
        n_pad = max(next_pow2(n_rows), slots)
        if self.share_prefill:  # one prompt-store entry per prompt, read by its n rows
            entries = [i for i, _ in rows]
            uniq = list(range(len(prompts)))
        else:  # one entry per row: every row prefilled
            entries = list(range(n_rows))
            uniq = [i for i, _ in rows]
        u_pad = max(next_pow2(len(uniq)), self.max_slots // 4)
        self.prefill_rows += u_pad
        self.prefill_rows_unshared += n_pad
        longest = max(len(prompts[i]) for i in uniq)
        p = _bucket(longest, self.min_prompt_bucket, self.max_prompt_length)
        if p < longest:  # max_prompt_length not a power of two
            p = self.max_prompt_length
        t = _bucket(max_new, self.min_new_tokens_bucket, self.max_new_tokens)
        if t < max_new:
            t = self.max_new_tokens
        ids, mask = left_pad([prompts[i] for i in uniq], p, rows=u_pad)
        mask[len(uniq):, -1] = True  # padding entries: one dummy token, never a fully masked row
        per_row = lambda values, dtype: np.pad(np.asarray(values, dtype), (0, n_pad - n_rows))  # noqa: E731
        stop_arr = np.full((self.max_stop_tokens,), -1, np.int32)
        stop_arr[:len(stops)] = stops
        min_phase = t if small else self.min_cache_phase
        phases = () if min_phase == _MIN_PHASE else (("min_phase", min_phase),)
        may_filter = top_p < 1.0 or top_k > 0  # else the program has no top-p / top-k filter (`sampling_distribution`)
        self._note_program(("continuous", slots, n_pad, u_pad, p, t, k, str(self.compute_dtype)) + ("routing",) * routing
                           + phases + ((("park", self.park_rows),) if self.park_rows != defaults.PARK_ROWS else ())
                           + (("top_p/top_k filter",) if may_filter else ()))
        with self._layout():
            carry, req = _CONTINUOUS_JIT(
                self._graphdef, state, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(per_row(entries, np.int32)),
                jnp.asarray(per_row([key_offset + i for i, _ in rows], np.uint32)), jnp.asarray(per_row([j for _, j in rows], np.uint32)),
                jnp.asarray(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)), jnp.float32(temperature),
                jnp.float32(top_p), jnp.int32(top_k), jnp.asarray(per_row([max_new] * n_rows if row_max_new is None else row_max_new, np.int32)),
                jnp.asarray(stop_arr), jnp.int32(n_rows), slots=slots, num_new=t, k_logprobs=k, routing=routing,
                cache_dtype=self.compute_dtype, min_phase=min_phase, park=self.park_rows,
                slice_layers_once=self.slice_layers_once, may_filter=may_filter, tail=not small)
            rows_left = not small and len(tail_levels(slots, t)) > 1 and np.any(jax.device_get(carry.slots.live))
            if rows_left:  # the tail; the full cache is dropped before its program runs
                carry = _CONTINUOUS_COMPACT_JIT(carry, slots=slots)
                out = _CONTINUOUS_TAIL_JIT(self._graphdef, state, carry, req, slots=slots,
                                           slice_layers_once=self.slice_layers_once)
            else:
                out = _outputs(carry)
        out = jax.device_get(out)
        self.last_decode_steps = int(out["steps"])
        self.parked_rows += int(out["parked"])
        return {key: np.asarray(v)[:n_rows] for key, v in out.items() if key not in ("steps", "parked")}

    def _run_chunk(self, state, prompts, chunk, *, temperature, top_p, top_k, max_new, k, stops, seed, routing=False, n=1,
                   key_offset=0):
        n_rows = len(chunk)
        b = _bucket(n_rows, self.row_shards, self.max_batch_size)
        # Rows come in groups of n samples of one prompt (rows = [(i, 0..n-1) for each prompt i]).
        group = n if (self.share_prefill and n > 1 and n_rows % n == 0 and b % n == 0
                      and all(chunk[r][0] == chunk[r - r % n][0] for r in range(n_rows))) else 1
        self.prefill_rows += b // group
        self.prefill_rows_unshared += b
        longest = max(len(prompts[i]) for i, _ in chunk)
        p = _bucket(longest, self.min_prompt_bucket, self.max_prompt_length)
        if p < longest:  # max_prompt_length not a power of two
            p = self.max_prompt_length
        t = _bucket(max_new, self.min_new_tokens_bucket, self.max_new_tokens)
        if t < max_new:
            t = self.max_new_tokens
        ids, mask = left_pad([prompts[i] for i, _ in chunk], p, rows=b)
        mask[n_rows:, -1] = True  # padding rows: one dummy token, never a fully masked row
        prompt_idx = np.zeros((b,), np.uint32)
        sample_idx = np.zeros((b,), np.uint32)
        for r, (i, j) in enumerate(chunk):
            prompt_idx[r], sample_idx[r] = key_offset + i, j
        max_new_b = np.zeros((b,), np.int32)
        max_new_b[:n_rows] = max_new
        stop_arr = np.full((b, self.max_stop_tokens), -1, np.int32)
        stop_arr[:, :len(stops)] = stops
        self._note_program(("static", b, p, t, k, group, self.first_cache_segment, str(self.compute_dtype)) + ("routing",) * routing)
        with self._layout():
            out = self._program(
                self._graphdef, state, jnp.asarray(ids), jnp.asarray(mask),
                jnp.asarray(np.tile(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32), (b, 1))),
                jnp.asarray(prompt_idx), jnp.asarray(sample_idx), jnp.full((b,), temperature, jnp.float32),
                jnp.full((b,), top_p, jnp.float32), jnp.full((b,), top_k, jnp.int32), jnp.asarray(max_new_b),
                jnp.asarray(stop_arr), num_new=t, k_logprobs=k, cache_dtype=self.compute_dtype,
                first_segment=self.first_cache_segment, group=group, routing=routing,
                slice_layers_once=self.slice_layers_once)
        out = jax.device_get(out)
        self.last_decode_steps = int(out["steps"])
        return {key: np.asarray(v)[:n_rows] for key, v in out.items() if key != "steps"}

    def _to_batch(self, prompts, rows, parts, version) -> RolloutBatch:
        cat = {k: [p[k] for p in parts] for k in parts[0]}
        length = np.concatenate(cat["length"])
        t_out = int(max(length.max(), 1))
        tr = lambda a: np.concatenate([pad_axis(x[:, :t_out], t_out, 1) for x in a])  # noqa: E731
        routed = None
        if "routed" in cat:
            p_out = max(len(p) for p in prompts)
            routed = np.concatenate([_routing_rows(r, x.shape[1], p_out, t_out)
                                     for r, x in zip(cat["routed"], cat["tokens"])])
            last = length > 0  # a row's last token was sampled, never fed through the model: no routing
            routed[np.flatnonzero(last), p_out + length[last] - 1] = ROUTING_PAD
        return build_batch(
            prompts, group_ids=np.array([i for i, _ in rows], np.int32), lengths=length,
            completion_ids=tr(cat["tokens"]), behavior_logprobs=tr(cat["logp"]), topk_ids=tr(cat["topk_ids"]),
            topk_logprobs=tr(cat["topk_logp"]), weights_version=version,
            finish_reason=np.array(["stop" if s else "length" for s in np.concatenate(cat["stopped"])], dtype=object),
            routed_experts=routed)


def _routing_rows(routed, t_bucket: int, p_out: int, t_out: int) -> np.ndarray:
    """A program's ``routed`` [n, P_bucket + T_bucket, L, k] -> [n, p_out + t_out, L, k]: its prompt
    columns cut (or left-padded with `ROUTING_PAD`) to the last p_out, its completion columns to t_out."""
    p_bucket = routed.shape[1] - t_bucket
    prompt = routed[:, max(p_bucket - p_out, 0):p_bucket]
    prompt = np.pad(prompt, [(0, 0), (p_out - prompt.shape[1], 0), (0, 0), (0, 0)], constant_values=ROUTING_PAD)
    return np.concatenate([prompt, pad_axis(routed[:, p_bucket:p_bucket + t_out], t_out, 1, value=ROUTING_PAD)], axis=1)


def check_weights_path(path: str, checkpoint_root: str) -> str:
    """Resolves `path` (absolute, or relative to the root) and checks it lies under `checkpoint_root`.

    Raises:
      wts.WeightsError: not a non-empty string, a NUL byte, a ``..`` component,
        or a resolved path (symlinks followed) outside the root.
    """
    if not isinstance(path, str) or not path:
        raise wts.WeightsError(f"path must be a non-empty string, got {path!r}")
    if "\x00" in path:
        raise wts.WeightsError(f"path {path[:200]!r} contains a NUL byte; refused")
    if ".." in path.replace("\\", "/").split("/"):
        raise wts.WeightsError(f"path {path!r} contains '..'; refused")
    root = os.path.realpath(checkpoint_root)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise wts.WeightsError(f"path {path!r} is outside the checkpoint root {root!r}; refused")
    return full
