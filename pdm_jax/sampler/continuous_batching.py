"""Continuous batching (``batching="continuous"``, `_continuous_program`): the request's
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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.rollout import ROUTING_PAD, left_pad, routing_dtype
from pdm_jax.sampler import defaults
from pdm_jax.sampler.sampling import Draw, laid_out, next_pow2, sample_step, shape_buckets


def copy_row(dst, i, src, j):
    """KV cache `dst` with row ``i``'s first W positions replaced by row ``j`` of cache `src`, W the shorter of the
    two caches' lengths (k and v of every layer; ``i``, ``j`` int32 scalars, traced), laid out by `laid_out`.
    Continuous batching moves a row this way: prefill store -> slot (admit), slot -> park (the park holds the
    first phase's P + T/4 slots of a row), park -> slot."""
    zero = jnp.int32(0)

    def put(d, s, axis):  # axis: the cache-slot axis (k: 3, v: 2)
        row = jax.lax.dynamic_slice_in_dim(s, j, 1, axis=0)
        row = jax.lax.slice_in_dim(row, 0, min(row.shape[axis], d.shape[axis]), axis=axis)
        return jax.lax.dynamic_update_slice(d, row, (i, zero, zero, zero))
    return laid_out(type(dst)(k=tuple(put(d, s, 3) for d, s in zip(dst.k, src.k)),
                               v=tuple(put(d, s, 2) for d, s in zip(dst.v, src.v))))


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
    """The program's outputs per queue row: tokens / log mu [N, T], top-K ids / log mu [N, T x K] (flat: XLA:TPU
    lays a [N, T, K] buffer out with K = 20 as the minor dimension, padded to 128 lanes, 6.4x the bytes; `run`
    hands out [N, T, K]), ``length`` and ``stopped`` [N]; ``routed`` [N, P + T, L, k] with routing replay, else
    None."""

    tokens: jax.Array
    logp: jax.Array
    topk_ids_NxTK: jax.Array
    topk_logp_NxTK: jax.Array
    length: jax.Array
    stopped: jax.Array
    routed: Optional[jax.Array] = None

    def record(self, rows_B, t_B, tok_B, lp_B, ids_BxK, lps_BxK, stop_B) -> "_Outputs":
        """Token ``t_B[b]`` of row ``rows_B[b]`` written (a row index >= N is dropped)."""
        at = dict(mode="drop")
        k = ids_BxK.shape[1]
        top = (rows_B[:, None], t_B[:, None] * k + jnp.arange(k, dtype=t_B.dtype))  # [B, K] entries of [N, T x K]
        return self.replace(tokens=self.tokens.at[rows_B, t_B].set(tok_B, **at),
                            logp=self.logp.at[rows_B, t_B].set(lp_B, **at),
                            topk_ids_NxTK=self.topk_ids_NxTK.at[top].set(ids_BxK, **at),
                            topk_logp_NxTK=self.topk_logp_NxTK.at[top].set(lps_BxK, **at),
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
        """`sample_step`'s per-row sampling parameters for ``b`` rows."""
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
    sample1 = functools.partial(sample_step, **req.sampling(1))
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
    cache = laid_out(cache)
    tok, lp, ids, lps = sample_step(logits_Bx1xV[:, 0, :], sl.key, t_B, **req.sampling(b))
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
    return c.replace(cache=laid_out(type(cache)(k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)))),
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


class ContinuousQueue(NamedTuple):
    """`_continuous_program`'s arrays: U prompts ``prompt_ids_UxP`` / ``prompt_mask_UxP`` (left-padded int32 / bool
    [U, P]); the queue of N rows (int32 / uint32 [N]: row r reads prompt-store entry ``row_entry_N[r]``, keys sample
    j = ``row_sample_N[r]`` of prompt i = ``row_prompt_N[r]``, makes ``max_new_N[r]`` new tokens at most; rows
    ``>= num_rows`` are padding, never run); ``seed_2`` uint32 [2] (the seed's low and high words); the sampling
    parameters ``temperature`` / ``top_p`` (f32 scalars), ``top_k`` (int32 scalar); ``stop_ids_S`` int32 [S]
    (-1 = unused); ``num_rows`` int32 scalar."""

    prompt_ids_UxP: jax.Array
    prompt_mask_UxP: jax.Array
    row_entry_N: jax.Array
    row_prompt_N: jax.Array
    row_sample_N: jax.Array
    seed_2: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    max_new_N: jax.Array
    stop_ids_S: jax.Array
    num_rows: jax.Array


@dataclasses.dataclass(frozen=True)
class ContinuousShape:
    """`_continuous_program`'s static settings (hashable: the jit's static argument; one compile each): ``slots``
    cache slots, ``num_new`` the new-token bucket T, ``k_logprobs`` K, ``cache_dtype`` the KV cache's dtype,
    ``routing`` (MoE routing replay), ``min_phase`` (`cache_phases`; None: `_MIN_PHASE`), ``park`` (park entries
    per slot; 0: off), ``slice_layers_once`` (`hoist_layer_slices`), ``may_filter`` (top-p / top-k filter traced),
    ``tail`` (stop the main loop for the tail; False: run every row to its end) and ``prefill_chunk`` (prompts
    prefilled at once, `prefill_rows_at_once`; 0: all)."""

    slots: int
    num_new: int
    k_logprobs: int
    cache_dtype: Any
    routing: bool = False
    min_phase: Optional[int] = None
    park: int = 0
    slice_layers_once: bool = False
    may_filter: bool = True
    tail: bool = True
    prefill_chunk: int = 0

    @classmethod
    def for_engine(cls, spec, **settings) -> "ContinuousShape":
        """The shape of ``settings`` with the park and prefill chunk of `EngineSpec` ``spec`` (``settings`` win)."""
        return cls(**{"park": spec.park_rows, "prefill_chunk": spec.prefill_chunk, **settings})


def park_entries(spec, slots: int, caps) -> int:
    """Park entries of a continuous program with ``slots`` slots and cache phases ``caps`` (`cache_phases`) for
    `EngineSpec` ``spec``: ``park_rows x slots`` with more than one phase, else 0 (`_continuous_program`)."""
    return int(spec.park_rows) * int(slots) if len(caps) > 1 else 0


def prefill_rows_at_once(u: int, chunk: int, shards: int = 1) -> int:
    """Prompts a prefill of ``u`` prompts runs at once for `EngineSpec.prefill_chunk` ``chunk`` on an engine whose
    rows split ``shards`` ways (its data axis): the largest multiple of ``shards`` that divides ``u`` and is at most
    ``max(chunk, shards)`` (a chunk the data axis does not divide would be computed whole on every data device);
    ``u`` for ``chunk`` 0 or at least ``u``, or where no multiple of ``shards`` divides ``u``."""
    if not chunk or chunk >= u:
        return int(u)
    fits = [x for x in range(shards, max(int(chunk), shards) + 1, shards) if u % x == 0]
    return max(fits) if fits else int(u)


def _prefill(model, ids_UxP, positions_UxP, mask_UxP, *, cache_dtype, routing: bool, chunk: int):
    """The prompt store: U prompts ([U, P] int32 ids, int32 rotary positions, bool mask; left-padded) through
    ``model.decode`` into a KV cache of P slots, ``chunk`` prompts at a time (`prefill_rows_at_once`: a
    ``fori_loop`` over the U / chunk chunks, each prefilled into a cache of its own and written into the store;
    ``chunk`` = U: one call). A prompt's entries do not depend on the other prompts of its chunk, so the chunks only
    bound the attention's f32 ``[chunk, heads, P, P]`` scores. Returns (last position's logits [U, V] f32, the
    store, the prefill's routing [U, P, L, k] int32 with ``routing``, else None)."""
    u, p = ids_UxP.shape
    kw = dict(return_routing=True) if routing else {}

    def run(ids, positions, mask):
        cache = model.init_cache(ids.shape[0], p, dtype=cache_dtype)
        logits, cache, *routed = model.decode(ids, positions, cache, jnp.int32(0), mask, last_logits_only=True, **kw)
        return logits[:, -1, :], cache, (routed[0] if routing else None)
    if chunk >= u:
        return run(ids_UxP, positions_UxP, mask_UxP)
    part = jax.eval_shape(run, ids_UxP[:chunk], positions_UxP[:chunk], mask_UxP[:chunk])
    last, store, routed = jax.tree.map(lambda a: jnp.zeros((u,) + a.shape[1:], a.dtype), part)
    full = (last, laid_out(store), routed)

    def body(i, acc):
        start = i * chunk
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=0)  # noqa: E731
        out = run(take(ids_UxP), take(positions_UxP), take(mask_UxP))
        return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, start, axis=0), acc, out)
    return jax.lax.fori_loop(0, u // chunk, body, full)


def _continuous_program(graphdef, state, q: ContinuousQueue, shape: ContinuousShape):
    """Continuous batching: N queued rows decoded in ``slots`` slots of one static KV cache.

    Inputs: the prompts, the row queue and the sampling parameters (`ContinuousQueue`); the bucket's static
    settings (`ContinuousShape`).

    1. Prefill: every prompt once ([U, P] through ``model.decode`` into a prompt store of
       P slots, ``shape.prefill_chunk`` prompts at a time: `_prefill`; shared prefill: a prompt's n rows all read
       its entry): the `_Request`.
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
    slots, num_new, k_logprobs, cache_dtype, routing = (shape.slots, shape.num_new, shape.k_logprobs,
                                                        shape.cache_dtype, shape.routing)
    prompt_ids_UxP, prompt_mask_UxP, row_entry_N = q.prompt_ids_UxP, q.prompt_mask_UxP, q.row_entry_N
    model = nnx.merge(graphdef, state)
    layers = model.decode_layers() if shape.slice_layers_once else None  # `hoist_layer_slices`
    u, p = prompt_ids_UxP.shape
    n_pad = row_entry_N.shape[0]
    positions_UxP = jnp.maximum(jnp.cumsum(prompt_mask_UxP, axis=-1) - 1, 0).astype(jnp.int32)
    last_UxV, store, store_routed = _prefill(model, prompt_ids_UxP, positions_UxP, prompt_mask_UxP,
                                             cache_dtype=cache_dtype, routing=routing,
                                             chunk=prefill_rows_at_once(u, shape.prefill_chunk))
    base_key = jax.random.fold_in(jax.random.PRNGKey(q.seed_2[0]), q.seed_2[1])
    caps = cache_phases(num_new, shape.min_phase)  # P + caps[i] cache slots in phase i
    park_n = int(shape.park) * slots if len(caps) > 1 else 0
    outs = _Outputs(tokens=jnp.zeros((n_pad, num_new), jnp.int32), logp=jnp.zeros((n_pad, num_new), jnp.float32),
                    topk_ids_NxTK=jnp.zeros((n_pad, num_new * k_logprobs), jnp.int32),
                    topk_logp_NxTK=jnp.zeros((n_pad, num_new * k_logprobs), jnp.float32),
                    length=jnp.zeros((n_pad,), jnp.int32), stopped=jnp.zeros((n_pad,), bool))
    if routing:  # [N, P + num_new, L, k] (see `_generate_program`)
        store_routed = store_routed.astype(routing_dtype(model.config.num_experts))
        outs = outs.replace(routed=jnp.full((n_pad, p + num_new) + store_routed.shape[2:], ROUTING_PAD,
                                            store_routed.dtype))
    req = _Request(store=store, last_UxV=last_UxV,  # the LM head on the last prompt position only
                   store_routed=store_routed if routing else None, prompt_mask_UxP=prompt_mask_UxP,
                   prompt_len_U=jnp.sum(prompt_mask_UxP, axis=-1).astype(jnp.int32), row_entry_N=row_entry_N,
                   row_prompt_N=q.row_prompt_N, row_sample_N=q.row_sample_N, max_new_N=q.max_new_N,
                   stop_ids_S=jnp.asarray(q.stop_ids_S, jnp.int32), num_rows=q.num_rows, base_key=base_key,
                   temperature=q.temperature, top_p=q.top_p, top_k=q.top_k, p=p, num_new=num_new,
                   k_logprobs=k_logprobs, n_pad=n_pad, caps=tuple(caps), park_n=park_n, may_filter=shape.may_filter)
    carry = _DecodeState(cache=laid_out(model.init_cache(slots, p + num_new, dtype=cache_dtype)),
                         kv_mask=jnp.zeros((slots, p + num_new), bool), slots=_Slots.empty(slots, base_key),
                         outs=outs, queue=jnp.int32(0), steps=jnp.int32(0), parked=jnp.int32(0), phase=jnp.int32(0))
    if park_n:
        carry = carry.replace(park=_Park(cache=laid_out(model.init_cache(park_n, p + caps[0], dtype=cache_dtype)),
                                         slots=_Slots.empty(park_n, base_key, ones=False), n=jnp.int32(0)))

    # Level 0 runs every slot while rows are pending, in cache-length phases, all in one loop: a step of the
    # current phase (attention reads its P + caps[i] slots), then `_settle` refills free slots and moves to the next
    # phase while the current one cannot run (`_runs`). Once the queue is empty and at most half the slots are
    # live, the loop ends; `_continuous_compact` and `_continuous_tail` run what is left.
    levels = tail_levels(slots, num_new) if shape.tail else [slots]  # without a tail the loop runs every row to its end
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
    dict, but top-K [N, T x K]: `run` reshapes them on the host; ``routed`` with routing replay)."""
    outs = carry.outs
    return dict(tokens=outs.tokens, logp=outs.logp, topk_ids=outs.topk_ids_NxTK, topk_logp=outs.topk_logp_NxTK,
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
_CONTINUOUS_JIT = jax.jit(_continuous_program, static_argnums=(0, 3))
_CONTINUOUS_COMPACT_JIT = jax.jit(_continuous_compact, static_argnames=("slots",))
_CONTINUOUS_TAIL_JIT = jax.jit(_continuous_tail, static_argnums=(0,), static_argnames=("slots", "slice_layers_once"))


def run(engine, state, prompts, rows, draw: Draw, row_max_new=None) -> dict:
    """The whole request through `_continuous_program` with `draw`'s sampling; returns `static_batching.run`'s dict
    for all rows.

    ``row_max_new``: per-row limits (each <= ``draw.max_new``) instead of max_new for all (tests).

    Static shapes (few, to bound compiles): ``max_slots`` slots, or max_slots / 4 with no tail for a request
    of at most that many rows (a smaller request leaves slots empty), the row queue next_pow2(N) (at least the
    slots), the prompt store next_pow2(U) (at least max_slots / 4), the prompt and new-token buckets of
    `_run_chunk`. The tail (`_continuous_compact`, then `_continuous_tail`) runs, and compiles, only when rows are
    left after the main loop.
    """
    temperature, top_p, top_k, max_new, k, stops, seed, _, routing, key_offset = draw
    n_rows = len(rows)
    slots = engine.max_slots
    # A request of at most slots / 4 rows runs in a cache of that many slots, with no tail and one cache phase
    # (no park): one decode loop without phase branches to compile, attention over all P + T slots.
    small = (slots // _SMALL_REQUEST >= 1 and n_rows <= slots // _SMALL_REQUEST
             and (slots // _SMALL_REQUEST) % engine.row_shards == 0)
    if small:
        slots //= _SMALL_REQUEST
    n_pad = max(next_pow2(n_rows), slots)
    if engine.share_prefill:  # one prompt-store entry per prompt, read by its n rows
        entries = [i for i, _ in rows]
        uniq = list(range(len(prompts)))
    else:  # one entry per row: every row prefilled
        entries = list(range(n_rows))
        uniq = [i for i, _ in rows]
    u_pad = max(next_pow2(len(uniq)), engine.max_slots // 4)
    engine.prefill_rows += u_pad
    engine.prefill_rows_unshared += n_pad
    longest = max(len(prompts[i]) for i in uniq)
    p, t = shape_buckets(engine, longest, max_new)
    ids, mask = left_pad([prompts[i] for i in uniq], p, rows=u_pad)
    mask[len(uniq):, -1] = True  # padding entries: one dummy token, never a fully masked row
    per_row = lambda values, dtype: np.pad(np.asarray(values, dtype), (0, n_pad - n_rows))  # noqa: E731
    stop_arr = np.full((engine.max_stop_tokens,), -1, np.int32)
    stop_arr[:len(stops)] = stops
    min_phase = t if small else engine.min_cache_phase
    phases = () if min_phase == _MIN_PHASE else (("min_phase", min_phase),)
    may_filter = top_p < 1.0 or top_k > 0  # else the program has no top-p / top-k filter (`sampling_distribution`)
    park, chunk = engine.spec.park_rows, prefill_rows_at_once(u_pad, engine.spec.prefill_chunk, engine.row_shards)
    engine._note_program(("continuous", slots, n_pad, u_pad, p, t, k, str(engine.compute_dtype))
                         + ("routing",) * routing + phases
                         + ((("park", park),) if park != defaults.PARK_ROWS else ())
                         + ((("prefill chunk", chunk),) if chunk < u_pad else ())
                         + (("top_p/top_k filter",) if may_filter else ()))
    with engine._layout():
        queue = ContinuousQueue(
            prompt_ids_UxP=jnp.asarray(ids), prompt_mask_UxP=jnp.asarray(mask),
            row_entry_N=jnp.asarray(per_row(entries, np.int32)),
            row_prompt_N=jnp.asarray(per_row([key_offset + i for i, _ in rows], np.uint32)),
            row_sample_N=jnp.asarray(per_row([j for _, j in rows], np.uint32)),
            seed_2=jnp.asarray(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)),
            temperature=jnp.float32(temperature), top_p=jnp.float32(top_p), top_k=jnp.int32(top_k),
            max_new_N=jnp.asarray(per_row([max_new] * n_rows if row_max_new is None else row_max_new, np.int32)),
            stop_ids_S=jnp.asarray(stop_arr), num_rows=jnp.int32(n_rows))
        shape = ContinuousShape(slots=slots, num_new=t, k_logprobs=k, cache_dtype=engine.compute_dtype,
                                routing=routing, min_phase=min_phase, park=park,
                                slice_layers_once=engine.slice_layers_once, may_filter=may_filter, tail=not small,
                                prefill_chunk=chunk)
        carry, req = _CONTINUOUS_JIT(engine._graphdef, state, queue, shape)
        rows_left = not small and len(tail_levels(slots, t)) > 1 and np.any(jax.device_get(carry.slots.live))
        if rows_left:  # the tail; the full cache is dropped before its program runs
            carry = _CONTINUOUS_COMPACT_JIT(carry, slots=slots)
            out = _CONTINUOUS_TAIL_JIT(engine._graphdef, state, carry, req, slots=slots,
                                       slice_layers_once=engine.slice_layers_once)
        else:
            out = _outputs(carry)
    out = jax.device_get(out)
    engine.last_decode_steps = int(out["steps"])
    engine.parked_rows += int(out["parked"])
    out = {key: np.asarray(v)[:n_rows] for key, v in out.items() if key not in ("steps", "parked")}
    for key in ("topk_ids", "topk_logp"):  # [N, T x K] on the device (`_Outputs`) -> [N, T, K]
        out[key] = out[key].reshape(n_rows, t, k)
    return out
