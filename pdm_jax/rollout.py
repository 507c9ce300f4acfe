"""`RolloutBatch`, the one contract between the sampler and the trainer (numpy only).

N sequences = prompts x samples, prompt-major (row ``i * n + j`` is sample ``j`` of prompt ``i``); P prompt length; T
completion length; K top-K. mu is softmax(z_q / tau) of the (quantized) sampler weights, the distribution the tokens
were drawn from (DESIGN.md section 1):

====================  =================  =========  ==========================================
field                 shape              dtype      meaning
====================  =================  =========  ==========================================
prompt_ids            [N, P]             int32      left-padded prompt token ids
prompt_mask           [N, P]             bool       True on real prompt tokens
completion_ids        [N, T]             int32      right-padded generated ids (stop token kept)
completion_mask       [N, T]             bool       True on generated tokens (incl. the stop token)
behavior_logprobs     [N, T]             float32    log mu(y_t) of the sampled token (0 on pads)
topk_ids              [N, T, K]          int32      the sampler's K most likely ids, rank order
topk_logprobs         [N, T, K]          float32    their log mu, descending (0 on pads)
weights_version       [N]                int32      policy version that sampled each sequence
group_ids             [N]                int32      index of the prompt within the batch
finish_reason         [N]                str        "stop" (stop token) or "length"
rewards               [N] or None        float32    verifier rewards, filled in by the trainer
routed_experts        [N, P+T, L, k]     int8/16/32 MoE routing replay (None unless requested); -1
                      or None                       (`ROUTING_PAD`) where the sampler fed no token
====================  =================  =========  ==========================================

A jitted train step takes `pdm_jax.rl.step_batch.StepBatch`, built from it; numpy only, so the sampler service and
the wire codec read it without JAX."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

FINISH_REASONS = ("stop", "length")
ROUTING_PAD = -1  # routed_experts where the sampler fed no token: replay uses the router's own top-k there


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer dtype of ``routed_experts`` for ``num_experts`` experts (ids and -1)."""
    for dt in (np.int8, np.int16):
        if num_experts <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    """What a generate request asks besides its prompts: the one record every `Sampler.generate` (the engine, the
    HTTP and vLLM clients, the supervisor) takes, so a new request field touches this record and its consumer.

    ``n`` samples per prompt; ``temperature`` tau >= 0 (0: greedy); ``max_new_tokens`` (None: the backend's limit);
    ``top_k_logprobs`` K; ``stop_token_ids``; ``seed`` in [0, 2**63) (None: a fresh one); ``top_p`` / ``top_k``
    filters (off: 1.0 / 0); ``first_prompt_index`` (prompt i draws with the key of prompt f + i: per-host rollouts);
    ``return_routing`` (MoE routing replay). Values are carried as given: the engine's `validate_request` checks
    them (naming the wire field)."""

    n: int = 1
    temperature: float = 1.0
    max_new_tokens: Optional[int] = None
    top_k_logprobs: int = 20
    stop_token_ids: Sequence[int] = ()
    seed: Optional[int] = None
    top_p: float = 1.0
    top_k: int = 0
    first_prompt_index: int = 0
    return_routing: bool = False

    @classmethod
    def of(cls, params: Optional["GenerateParams"] = None, **fields) -> "GenerateParams":
        """``params`` (None: the defaults) with ``fields`` replaced. Raises TypeError naming an unknown field."""
        return dataclasses.replace(params if params is not None else cls(), **fields)


@dataclasses.dataclass
class RolloutBatch:
    """Host-side rollouts with behaviour log-probabilities (module docstring); ValueError naming the field and the value
    or shape for inconsistent shapes, lossy dtypes, an unknown finish reason, or non-finite rewards."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    behavior_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    weights_version: np.ndarray
    group_ids: np.ndarray
    finish_reason: np.ndarray
    rewards: Optional[np.ndarray] = None
    routed_experts: Optional[np.ndarray] = None

    def __post_init__(self):
        self.prompt_ids = _as(self.prompt_ids, np.int32, "prompt_ids", 2)
        self.prompt_mask = _as(self.prompt_mask, bool, "prompt_mask", 2)
        self.completion_ids = _as(self.completion_ids, np.int32, "completion_ids", 2)
        self.completion_mask = _as(self.completion_mask, bool, "completion_mask", 2)
        self.behavior_logprobs = _as(self.behavior_logprobs, np.float32, "behavior_logprobs", 2)
        self.topk_ids = _as(self.topk_ids, np.int32, "topk_ids", 3)
        self.topk_logprobs = _as(self.topk_logprobs, np.float32, "topk_logprobs", 3)
        self.weights_version = _as(self.weights_version, np.int32, "weights_version", 1)
        self.group_ids = _as(self.group_ids, np.int32, "group_ids", 1)
        self.finish_reason = np.asarray(self.finish_reason, dtype=object).reshape(-1)
        n, t = self.completion_ids.shape
        k = self.topk_ids.shape[-1]
        expect = {
            "prompt_ids": (n, self.prompt_ids.shape[1]),
            "prompt_mask": (n, self.prompt_ids.shape[1]),
            "completion_mask": (n, t),
            "behavior_logprobs": (n, t),
            "topk_ids": (n, t, k),
            "topk_logprobs": (n, t, k),
            "weights_version": (n,),
            "group_ids": (n,),
            "finish_reason": (n,),
        }
        for name, shape in expect.items():
            got = getattr(self, name).shape
            if tuple(got) != shape:
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(got)}, expected {shape}")
        bad = [r for r in self.finish_reason if r not in FINISH_REASONS]
        if bad:
            raise ValueError(f"RolloutBatch.finish_reason has {bad[0]!r}; expected one of {FINISH_REASONS}")
        if self.rewards is not None:
            self.rewards = _as(self.rewards, np.float32, "rewards", 1)
            if self.rewards.shape != (n,):
                raise ValueError(f"RolloutBatch.rewards has shape {self.rewards.shape}, expected {(n,)}")
            nonfinite = np.flatnonzero(~np.isfinite(self.rewards))
            if nonfinite.size:
                i = int(nonfinite[0])
                raise ValueError(f"RolloutBatch.rewards[{i}] (sample {i}, group {int(self.group_ids[i])}) "
                                 f"is {self.rewards[i]}")
        if self.routed_experts is not None:
            r = np.asarray(self.routed_experts)
            if r.dtype.kind not in "iu" or r.ndim != 4 or r.shape[:2] != (n, self.prompt_ids.shape[1] + t):
                raise ValueError(f"RolloutBatch.routed_experts must be an integer array [N, P + T, L, k] with "
                                 f"[N, P + T] = {[n, self.prompt_ids.shape[1] + t]}, got {r.dtype} {r.shape}")
            self.routed_experts = r

    @property
    def num_sequences(self) -> int:
        """N, the number of sequences (prompts x samples per prompt)."""
        return int(self.completion_ids.shape[0])

    @property
    def top_k(self) -> int:
        """K, the number of top-K behaviour log-probabilities per token."""
        return int(self.topk_ids.shape[-1])

    def replace(self, **changes) -> "RolloutBatch":
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows) -> "RolloutBatch":
        """The sub-batch of the given row indices (int array or slice)."""
        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kw[f.name] = None if v is None else v[rows]
        return RolloutBatch(**kw)

    @staticmethod
    def concatenate(batches) -> "RolloutBatch":
        """Concatenates batches along N, left-padding P and right-padding T (id 0, mask False, logprobs 0); `group_ids`
        are offset to stay distinct. ValueError if the batches disagree on K or on whether rewards are set."""
        batches = list(batches)
        if not batches:
            raise ValueError("RolloutBatch.concatenate needs at least one batch")
        ks = {b.top_k for b in batches}
        if len(ks) != 1:
            raise ValueError(f"RolloutBatch.concatenate: batches have different top_k {sorted(ks)}")
        if len({b.rewards is None for b in batches}) != 1:
            raise ValueError("RolloutBatch.concatenate: some batches have rewards and some do not")
        p = max(b.prompt_ids.shape[1] for b in batches)
        t = max(b.completion_ids.shape[1] for b in batches)

        def rpad(x, width):
            pad = [(0, 0)] * x.ndim
            pad[1] = (0, width - x.shape[1])
            return np.pad(x, pad)

        def lpad(x, width):
            pad = [(0, 0)] * x.ndim
            pad[1] = (width - x.shape[1], 0)
            return np.pad(x, pad)

        routed = {b.routed_experts is None for b in batches}
        if len(routed) != 1:
            raise ValueError("RolloutBatch.concatenate: some batches have routed_experts and some do not")

        def routing(b):  # prompt columns left-padded to p, completion columns right-padded to t
            r, pb = b.routed_experts, b.prompt_ids.shape[1]
            fill = lambda width: np.full((r.shape[0], width) + r.shape[2:], ROUTING_PAD, r.dtype)  # noqa: E731
            return np.concatenate([fill(p - pb), r, fill(t - (r.shape[1] - pb))], axis=1)

        offset, gids = 0, []
        for b in batches:
            gids.append(b.group_ids + offset)
            offset += int(b.group_ids.max()) + 1 if b.num_sequences else 0
        cat = np.concatenate
        return RolloutBatch(
            prompt_ids=cat([lpad(b.prompt_ids, p) for b in batches]),
            prompt_mask=cat([lpad(b.prompt_mask, p) for b in batches]),
            completion_ids=cat([rpad(b.completion_ids, t) for b in batches]),
            completion_mask=cat([rpad(b.completion_mask, t) for b in batches]),
            behavior_logprobs=cat([rpad(b.behavior_logprobs, t) for b in batches]),
            topk_ids=cat([rpad(b.topk_ids, t) for b in batches]),
            topk_logprobs=cat([rpad(b.topk_logprobs, t) for b in batches]),
            weights_version=cat([b.weights_version for b in batches]),
            group_ids=cat(gids),
            finish_reason=cat([b.finish_reason for b in batches]),
            rewards=None if batches[0].rewards is None else cat([b.rewards for b in batches]),
            routed_experts=None if batches[0].routed_experts is None else cat([routing(b) for b in batches]),
        )


def _as(x, dtype, name, ndim):
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise ValueError(f"RolloutBatch.{name} must be numeric, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"RolloutBatch.{name} must have {ndim} dimensions, got shape {a.shape}")
    if dtype is bool:
        if a.dtype != bool:
            if not np.isin(a, (0, 1)).all():
                raise ValueError(f"RolloutBatch.{name} must be boolean (0/1), got values outside {{0,1}}")
            a = a.astype(bool)
        return a
    if np.issubdtype(np.dtype(dtype), np.integer):
        if not np.issubdtype(a.dtype, np.integer):
            if a.size and (not np.all(np.isfinite(a)) or not np.all(a == np.round(a))):
                raise ValueError(f"RolloutBatch.{name} must hold integers, got dtype {a.dtype}")
        info = np.iinfo(dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            bad = a.max() if a.max() > info.max else a.min()
            raise ValueError(f"RolloutBatch.{name} holds {bad}, outside the {np.dtype(dtype).name} range")
        return a.astype(dtype)
    with np.errstate(over="ignore"):  # an overflow to inf is named by the caller's finiteness check
        return a.astype(dtype)


def left_pad(prompts, length: Optional[int] = None, *, rows: Optional[int] = None):
    """The one prompt padding of the package: token-id sequences left-padded into a block.

    Args:
      prompts: a sequence of token-id sequences (ints).
      length: P, the block's width (default: the longest prompt); each prompt must fit.
      rows: the block's height (default ``len(prompts)``); rows past the prompts are all pads.
    Returns:
      ``(prompt_ids [rows, P] int32, prompt_mask [rows, P] bool)``: prompt ``i`` in the last ``len(prompts[i])`` columns
      of row ``i``, id 0 and mask False elsewhere.
    Raises:
      ValueError: a prompt longer than ``length``, or more prompts than ``rows``.
    """
    lens = np.array([len(p) for p in prompts], np.int64)
    width = int(lens.max(initial=0)) if length is None else int(length)
    height = len(prompts) if rows is None else int(rows)
    if height < len(prompts):
        raise ValueError(f"left_pad: {len(prompts)} prompts do not fit in {height} rows")
    if lens.size and lens.max() > width:
        i = int(np.argmax(lens))
        raise ValueError(f"left_pad: prompt {i} has {int(lens[i])} tokens, longer than P = {width}")
    ids = np.zeros((height, width), np.int32)
    mask = np.zeros((height, width), bool)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = True
    return ids, mask


def right_pad_rows(rows, width: Optional[int] = None, *, dtype=np.float32) -> np.ndarray:
    """Per-row arrays ``[t_r, ...]`` (same trailing shape) stacked right-padded with 0 into ``[N, width, ...]``.

    ``width`` defaults to max(1, longest row). Raises ValueError for a row longer than ``width``.
    """
    arrays = [np.asarray(r, dtype) for r in rows]
    trailing = arrays[0].shape[1:] if arrays else ()
    width = max([1] + [a.shape[0] for a in arrays]) if width is None else int(width)
    out = np.zeros((len(arrays), width) + tuple(trailing), dtype)
    for r, a in enumerate(arrays):
        if a.shape[0] > width:
            raise ValueError(f"right_pad_rows: row {r} has {a.shape[0]} entries, more than {width}")
        out[r, :a.shape[0]] = a
    return out


def build_batch(prompts, *, group_ids, lengths, completion_ids, behavior_logprobs, topk_ids, topk_logprobs,
                weights_version, finish_reason, routed_experts=None) -> RolloutBatch:
    """The one `RolloutBatch` builder from a sampler's per-row outputs (engine, wire decoders, vLLM client).

    Args:
      prompts: the request's prompts (token-id sequences).
      group_ids: [N] int prompt index of each row; lengths: [N] int tokens generated (stop token included), <= T_in.
      completion_ids: [N, T_in] int; behavior_logprobs: [N, T_in] float; topk_ids / topk_logprobs: [N, T_in, K]
        (entries past a row's length ignored).
      weights_version: [N] int, or one int; finish_reason: [N] of "stop" / "length".
      routed_experts: None, or [N, P + T_in, L, k] int, prompt columns right-aligned to the longest prompt P.
    Returns:
      RolloutBatch: prompts left-padded (`left_pad`), completions cut to T = max(1, longest) (id 0, log-prob 0, mask
        False
      past each length); ``routed_experts`` `ROUTING_PAD` on prompt pads and past each length.
    Raises:
      ValueError: a group id outside ``[0, len(prompts))``, a length outside ``[0, T_in]``, or a field `RolloutBatch`
        refuses (named)."""
    group_ids = np.asarray(group_ids).reshape(-1)
    lengths = np.asarray(lengths).reshape(-1)
    n_rows, t_in = np.shape(completion_ids)[:2]
    if group_ids.shape != (n_rows,) or lengths.shape != (n_rows,):
        raise ValueError(f"build_batch: group_ids {group_ids.shape} and lengths {lengths.shape} must be [{n_rows}]")
    if n_rows and (group_ids.min() < 0 or group_ids.max() >= len(prompts)):
        raise ValueError(f"build_batch: group_ids must lie in [0, {len(prompts)}), got "
                         f"{int(group_ids.min())}..{int(group_ids.max())}")
    if n_rows and (lengths.min() < 0 or lengths.max() > t_in):
        raise ValueError(f"build_batch: lengths must lie in [0, {t_in}], "
                         f"got {int(lengths.min())}..{int(lengths.max())}")
    t_out = int(max(lengths.max(initial=0), 1))
    if t_in < t_out:  # rows that all generated nothing, sent as [N, 0]: one masked column
        completion_ids, behavior_logprobs, topk_ids, topk_logprobs = (
            pad_axis(np.asarray(a), t_out, 1) for a in (completion_ids, behavior_logprobs, topk_ids, topk_logprobs))
    mask = np.arange(t_out)[None, :] < lengths[:, None]
    cut = lambda a, fill: np.where(mask.reshape(mask.shape + (1,) * (np.ndim(a) - 2)),  # noqa: E731
                                   np.asarray(a)[:, :t_out], fill)
    store_ids, store_mask = left_pad(prompts)  # each prompt padded once, then one gather per row
    prompt_mask = store_mask[group_ids]
    p_out = store_ids.shape[1]
    routed = None
    if routed_experts is not None:
        r = np.asarray(routed_experts)
        if r.ndim != 4 or r.shape[:2] != (n_rows, p_out + t_in):
            raise ValueError(f"RolloutBatch.routed_experts must be [{n_rows}, {p_out + t_in}, L, k], "
                             f"got {list(r.shape)}")
        routed = np.concatenate([r[:, :p_out], r[:, p_out:p_out + t_out]], axis=1)
        real = np.concatenate([prompt_mask, mask], axis=1)
        routed = np.where(real[:, :, None, None], routed, ROUTING_PAD).astype(r.dtype)
    version = np.asarray(weights_version)
    return RolloutBatch(
        prompt_ids=store_ids[group_ids], prompt_mask=prompt_mask, completion_ids=cut(completion_ids, 0),
        completion_mask=mask, behavior_logprobs=cut(behavior_logprobs, 0.0), topk_ids=cut(topk_ids, 0),
        topk_logprobs=cut(topk_logprobs, 0.0),
        weights_version=np.full((n_rows,), int(version), np.int32) if version.ndim == 0 else version,
        group_ids=group_ids, finish_reason=np.asarray(finish_reason, dtype=object), routed_experts=routed)


def pad_axis(x: np.ndarray, length: int, axis: int, *, left: bool = False, value=0) -> np.ndarray:
    """``x`` padded with ``value`` along ``axis`` to ``length`` (on the left if ``left``).

    Raises:
      ValueError: ``x`` is already longer than ``length`` along ``axis``.
    """
    extra = length - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of length {x.shape[axis]} to {length}")
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (extra, 0) if left else (0, extra)
    return np.pad(x, pad, constant_values=value)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n (at least ``multiple``): a static length bucket."""
    return max(multiple, -(-n // multiple) * multiple)


#: How far above 1 the top-K probabilities of a token may sum (float rounding of an f32 log-softmax).
TOPK_MASS_TOLERANCE = 1e-3
#: How far above 0 a log mu may round (f32).
LOGPROB_TOLERANCE = 1e-5


def check_answers(batch: RolloutBatch, prompts, *, n: int, max_new_tokens: int, top_k_logprobs: int,
                  vocab_size: Optional[int] = None) -> None:
    """Checks a sampler's rollouts against the request (any backend): ``len(prompts) * n`` rows prompt-major with the
    right groups and prompts, completions <= ``max_new_tokens``, ids in ``[0, V)``, sampled log mu finite and <= 0,
    top-K log mu <= 0 and not NaN with a mass <= 1 + `TOPK_MASS_TOLERANCE`, K = ``top_k_logprobs``.

    Raises:
      ValueError: naming the `RolloutBatch` field, the row and what is wrong."""
    rows = len(prompts) * int(n)
    if batch.num_sequences != rows:
        raise ValueError(f"RolloutBatch: {batch.num_sequences} rows for {len(prompts)} prompts x n = {n} "
                         f"(expected {rows})")
    if batch.top_k != int(top_k_logprobs):
        raise ValueError(f"RolloutBatch.topk_ids: K = {batch.top_k}, the request asked for {top_k_logprobs}")
    want_groups = np.repeat(np.arange(len(prompts), dtype=np.int32), int(n))
    wrong = np.flatnonzero(batch.group_ids != want_groups)
    if wrong.size:
        r = int(wrong[0])
        raise ValueError(f"RolloutBatch.group_ids[{r}] = {int(batch.group_ids[r])}: rows must be prompt-major "
                         f"(row {r} is a sample of prompt {int(want_groups[r])})")
    for r in range(rows):
        got = batch.prompt_ids[r][batch.prompt_mask[r]]
        want = np.asarray(prompts[r // int(n)], np.int32)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise ValueError(f"RolloutBatch.prompt_ids[{r}] is not the ids of prompt {r // int(n)} "
                             f"({got.size} tokens, the request's has {want.size})")
    lengths = batch.completion_mask.sum(axis=1)
    if lengths.size and int(lengths.max()) > int(max_new_tokens):
        r = int(np.argmax(lengths))
        raise ValueError(f"RolloutBatch.completion_mask[{r}]: {int(lengths[r])} tokens, more than the request's "
                         f"max_new_tokens = {max_new_tokens}")
    valid = batch.completion_mask
    hi = np.iinfo(np.int32).max if vocab_size is None else int(vocab_size)
    for name, ids, mask in (("completion_ids", batch.completion_ids, valid),
                            ("topk_ids", batch.topk_ids, np.broadcast_to(valid[..., None], batch.topk_ids.shape))):
        bad = mask & ((ids < 0) | (ids >= hi))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"RolloutBatch.{name}{list(where)} = {int(ids[where])}: outside [0, {hi})")
    lp = batch.behavior_logprobs
    bad = valid & ~(np.isfinite(lp) & (lp <= LOGPROB_TOLERANCE))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"RolloutBatch.behavior_logprobs{list(where)} = {float(lp[where])}: a sampled token's "
                         "log mu must be finite and <= 0")
    tk = batch.topk_logprobs
    bad = valid[..., None] & (np.isnan(tk) | (tk > LOGPROB_TOLERANCE))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"RolloutBatch.topk_logprobs{list(where)} = {float(tk[where])}: must be <= 0 (or -inf)")
    with np.errstate(over="ignore", under="ignore"):
        mass = np.exp(tk.astype(np.float64)).sum(axis=-1)
    bad = valid & (mass > 1.0 + TOPK_MASS_TOLERANCE)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"RolloutBatch.topk_logprobs{list(where)}: the top-K probabilities sum to "
                         f"{float(mass[where]):.4g} > 1")
