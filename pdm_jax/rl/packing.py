"""Sequence packing for the RL update: a mini-batch's sequences laid end to end in rows of L tokens.

A padded step pays ``[B, P + T]`` per sequence. With ``rl.pack_sequences`` the host plans (:func:`plan_packing`,
first-fit decreasing) where each sequence's real tokens go in rows of ``L = rl.packed_length``; the step gathers them
(:func:`packed_rows`), runs the model with segment ids (attention within a sequence, positions restarting) and
computes the per-token terms at the packed positions, gathered back to ``[B, T]`` before aggregation: loss, mask,
gradient and metrics are the padded step's (tests/test_packing.py, 1e-5 in f32), the loss weighting each token as the
padded aggregation does (`objectives.token_loss_weights`). Rows form micro-batches of ``R = rl.micro_batch_size`` (0:
one, rounded up to a power of two), row ``r`` in micro-batch ``r % n``. Not packed: SFT, routing replay and
``param_jvp`` (refused by ``pdm_jax.config``); a MoE router aux loss is per micro-batch, so it differs from the
padded step's."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
import numpy as np

from pdm_jax.rollout import round_up


@flax.struct.dataclass
class PackingPlan:
    """Where each real token of a mini-batch goes in the packed rows (host numpy or device arrays).

    N = ``num_micro_batches`` x R packed rows of L tokens; B sequences of the padded batch with P prompt and T
    completion columns. Columns index ``concat(prompt, completion)`` ``[B, P + T]``.

    ================  ========  =======  ==================================================
    field             shape     dtype    meaning
    ================  ========  =======  ==================================================
    src_row           [N, L]    int32    the sequence b of each packed position (0 on padding)
    src_col           [N, L]    int32    its column in ``[B, P + T]`` (0 on padding)
    segment_ids       [N, L]    int32    1, 2, ... per sequence within a row; 0 on padding
    token_mask        [N, L]    bool     a real token (the model's attention mask)
    target_col        [N, L]    int32    the completion index t this position predicts
    target_mask       [N, L]    bool     it predicts a valid completion token
    unpack_index      [B, T]    int32    flat index into ``[N * L]`` of the position that
                                         predicts completion token t of sequence b (0 if invalid)
    ================  ========  =======  ==================================================
    """

    src_row: object
    src_col: object
    segment_ids: object
    token_mask: object
    target_col: object
    target_mask: object
    unpack_index: object
    num_micro_batches: int = flax.struct.field(pytree_node=False, default=1)
    #: (B, P, T) of the padded batch the plan was made for (checked by the step: `check_plan`).
    planned_for: tuple = flax.struct.field(pytree_node=False, default=())

    @property
    def fill(self) -> float:
        """Fraction of packed positions holding a real token (host plans)."""
        return float(np.mean(np.asarray(self.token_mask)))


@flax.struct.dataclass
class PackedRows:
    """The packed model input and, ``[N, L]``, the per-token fields ``TokenInputs.of`` reads at the positions that
    predict them: ``completion_ids`` the token (r, l) predicts, ``completion_mask`` whether it is valid,
    ``advantages`` its sequence's, ``loss_weights`` its weight in the padded step's aggregated loss."""

    input_ids: object
    token_mask: object
    segment_ids: object
    completion_ids: object
    completion_mask: object
    behavior_logprobs: object
    topk_ids: object
    topk_logprobs: object
    advantages: object
    loss_weights: object
    ref_logprobs: object = None


def _lengths(mask: np.ndarray, name: str, *, left: bool) -> np.ndarray:
    """Per-row count of True in a left- (``left``) or right-padded bool (or 0 / 1) mask; ValueError if it has holes,
    another shape than [B, width] or other values."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"{name} must be [B, width], got shape {mask.shape}")
    if mask.dtype != bool:
        if not (np.issubdtype(mask.dtype, np.number) and np.isin(mask, (0, 1)).all()):
            raise ValueError(f"{name} must be a bool (or 0 / 1) mask, got dtype {mask.dtype} with other values")
        mask = mask.astype(bool)
    n = mask.sum(axis=1)
    width = mask.shape[1]
    cols = np.arange(width)[None, :]
    want = cols >= (width - n)[:, None] if left else cols < n[:, None]
    bad = np.flatnonzero(np.any(mask != want, axis=1))
    if bad.size:
        side = "left" if left else "right"
        raise ValueError(f"{name} of row {int(bad[0])} is not {side}-padded (its True entries are not one "
                         f"contiguous run at the {'end' if left else 'start'}); packing needs {side}-padded rows")
    return n.astype(np.int64)


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list:
    """Bins (lists of item indices, fullest first) of a first-fit-decreasing packing of ``lengths``."""
    order = np.argsort(-lengths, kind="stable")
    room = np.zeros(0, np.int64)
    bins: list = []
    for i in order:
        fits = np.flatnonzero(room >= lengths[i])
        if fits.size:
            k = int(fits[0])
        else:
            k = len(bins)
            bins.append([])
            room = np.append(room, capacity)
        bins[k].append(int(i))
        room[k] -= lengths[i]
    return [bins[k] for k in np.argsort(room, kind="stable")]


def plan_packing(prompt_mask, completion_mask, *, row_length: int, rows_per_micro_batch: int = 0,
                 row_multiple: int = 1) -> PackingPlan:
    """The packing of one mini-batch's sequences into rows of ``row_length`` tokens (numpy).

    Each sequence's real prompt and valid completion tokens go in order into one row (first-fit decreasing); one
    without a valid completion token is left out. Rows go fullest first, row r in micro-batch ``r % n``.

    Args:
      prompt_mask: ``[B, P]`` bool, left-padded; completion_mask: ``[B, T]`` bool, right-padded.
      row_length: L, tokens per packed row (``rl.packed_length``).
      rows_per_micro_batch: R > 0 (``rl.micro_batch_size``); 0: one micro-batch of the next power of two rows.
      row_multiple: the row count per micro-batch must divide into this many batch shards.

    Returns:
      a host `PackingPlan` of ``n x R`` rows, n the fewest micro-batches that hold every sequence.

    Raises:
      ValueError: a mask not [B, width] bool padded on its side, masks with different B, completion tokens without a
        prompt token, a sequence longer than ``row_length`` (naming ``rl.packed_length``), or
        ``rows_per_micro_batch`` not a multiple of ``row_multiple``."""
    p_len = _lengths(prompt_mask, "prompt_mask", left=True)
    c_len = _lengths(completion_mask, "completion_mask", left=False)
    if p_len.shape != c_len.shape:
        raise ValueError(f"prompt_mask has {p_len.shape[0]} rows, completion_mask {c_len.shape[0]}")
    b, p_width = np.shape(prompt_mask)
    t_width = np.shape(completion_mask)[1]

    def whole(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

    if not (whole(row_length) and row_length >= 1):
        raise ValueError(f"rl.packed_length must be an int >= 1 here, got {row_length!r}")
    if not (whole(row_multiple) and row_multiple >= 1):
        raise ValueError(f"row_multiple (the batch shards) must be an int >= 1, got {row_multiple!r}")
    if not (whole(rows_per_micro_batch) and rows_per_micro_batch >= 0) or rows_per_micro_batch % row_multiple:
        raise ValueError(f"rl.micro_batch_size = {rows_per_micro_batch!r} (packed rows per micro-batch) must be 0 or "
                         f"a positive multiple of the {row_multiple} batch shards")
    used = np.flatnonzero(c_len > 0)
    no_prompt = used[p_len[used] == 0]
    if no_prompt.size:
        raise ValueError(f"sequence {int(no_prompt[0])} has completion tokens but an empty prompt_mask: its first "
                         "completion token has no position to be predicted from")
    lengths = p_len + c_len
    too_long = used[lengths[used] > row_length]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"rl.packed_length = {row_length} is shorter than sequence {i} ({int(p_len[i])} prompt + "
                         f"{int(c_len[i])} completion tokens); it must be at least sampler.max_prompt_length + "
                         "rl.max_new_tokens")
    bins = [[int(used[i]) for i in bin_] for bin_ in _first_fit_decreasing(lengths[used], row_length)]
    if rows_per_micro_batch > 0:
        n = max(1, -(-len(bins) // rows_per_micro_batch))
        rows = rows_per_micro_batch
    else:
        n, rows = 1, round_up(1 << max(len(bins) - 1, 0).bit_length(), row_multiple)  # a power of two
    total, L = n * rows, int(row_length)
    if total * L >= 2 ** 31:
        raise ValueError(f"rl.packed_length = {L}: {total} packed rows x {L} tokens overflow the plan's int32 "
                         "indices (2**31 positions)")
    src_row = np.zeros((total, L), np.int32)
    src_col = np.zeros((total, L), np.int32)
    segment_ids = np.zeros((total, L), np.int32)
    token_mask = np.zeros((total, L), bool)
    target_col = np.zeros((total, L), np.int32)
    target_mask = np.zeros((total, L), bool)
    unpack_index = np.zeros((b, t_width), np.int32)
    for r, bin_ in enumerate(bins):  # fullest first: row r is in micro-batch r % n, so they share the full rows
        offset = 0
        for seg, s in enumerate(bin_, start=1):
            p, c = int(p_len[s]), int(c_len[s])
            span = slice(offset, offset + p + c)
            src_row[r, span] = s
            src_col[r, span] = np.concatenate([np.arange(p_width - p, p_width), p_width + np.arange(c)])
            segment_ids[r, span] = seg
            token_mask[r, span] = True
            pred = slice(offset + p - 1, offset + p - 1 + c)  # the last prompt token predicts completion token 0
            target_col[r, pred] = np.arange(c)
            target_mask[r, pred] = True
            unpack_index[s, :c] = r * L + offset + p - 1 + np.arange(c)
            offset += p + c
    return PackingPlan(src_row=src_row, src_col=src_col, segment_ids=segment_ids, token_mask=token_mask,
                       target_col=target_col, target_mask=target_mask, unpack_index=unpack_index,
                       num_micro_batches=n, planned_for=(int(b), int(p_width), int(t_width)))


def check_plan(batch, plan: PackingPlan) -> None:
    """ValueError (at trace time) unless ``plan`` was made for ``batch``'s shapes: B, P, T and the gathered per-token
    fields, naming the field (a plan from other masks of the same shapes is not detected)."""
    b, p = np.shape(batch.prompt_ids)
    t = np.shape(batch.completion_ids)[1]
    if plan.planned_for and tuple(plan.planned_for) != (b, p, t):
        pb, pp, pt = plan.planned_for
        raise ValueError(f"StepBatch.packing was planned for {pb} sequences of {pp} prompt + {pt} completion "
                         f"columns; the batch has {b} of {p} + {t}: plan the packing of these rows")
    fields = dict(completion_mask=(b, t), behavior_logprobs=(b, t), topk_ids=None, topk_logprobs=None,
                  ref_logprobs=(b, t))
    for name, want in fields.items():
        x = getattr(batch, name)
        if x is None:
            continue
        shape = np.shape(x)
        if (want is None and shape[:2] != (b, t)) or (want is not None and shape != want):
            raise ValueError(f"{name} must have shape {want or (b, t, 'K')}, got {shape}")
    if np.shape(batch.advantages) not in ((b,), (b, t)):
        raise ValueError(f"advantages must have shape {(b,)} or {(b, t)}, got {np.shape(batch.advantages)}")


def packed_rows(batch, plan: PackingPlan, loss_weights) -> PackedRows:
    """The `PackedRows` ``[N, L]`` (top-K ``[N, L, K]``) of a device batch (``batch`` the padded ``StepBatch``, ``plan``
    its `PackingPlan`, ``loss_weights`` ``[B, T]`` f32), gathered inside the jitted step; 0 / False where
    ``plan.target_mask`` is False."""
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
    b, t = plan.src_row, plan.target_col
    tm = plan.target_mask

    def at_target(x, fill=0):
        v = jnp.asarray(x)[b, t]
        m = tm.reshape(tm.shape + (1,) * (v.ndim - tm.ndim))
        return jnp.where(m, v, jnp.asarray(fill, v.dtype))

    advantages = jnp.asarray(batch.advantages, jnp.float32)
    adv = advantages[b] if advantages.ndim == 1 else advantages[b, t]
    return PackedRows(
        input_ids=jnp.where(plan.token_mask, ids[b, plan.src_col], 0),
        token_mask=plan.token_mask, segment_ids=plan.segment_ids,
        completion_ids=at_target(batch.completion_ids), completion_mask=tm,
        behavior_logprobs=at_target(batch.behavior_logprobs), topk_ids=at_target(batch.topk_ids),
        topk_logprobs=at_target(batch.topk_logprobs), advantages=jnp.where(tm, adv, 0.0),
        loss_weights=at_target(loss_weights, 0.0),
        ref_logprobs=None if batch.ref_logprobs is None else at_target(batch.ref_logprobs))


def unpack(x_N, plan: PackingPlan, valid):
    """``[N, L, ...]`` per-position values (packed order) -> ``[B, T, ...]``; 0 / False where not ``valid``."""
    flat = jnp.asarray(x_N).reshape((-1,) + tuple(np.shape(x_N)[2:]))
    out = flat[plan.unpack_index]
    m = jnp.asarray(valid).reshape(np.shape(valid) + (1,) * (out.ndim - 2))
    return jnp.where(m, out, jnp.zeros((), out.dtype))
