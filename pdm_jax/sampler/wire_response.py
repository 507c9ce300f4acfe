"""The sampler's responses: ``POST /v1/generate`` (`GenerateResponse`, in "choices" or "columns" form, and back
to a `RolloutBatch`), the weights-load and ``/health`` bodies."""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from pdm_jax.rollout import FINISH_REASONS, RolloutBatch, build_batch, right_pad_rows  # numpy only: stays JAX-free

from pdm_jax.sampler.limits import MAX_INT32
from pdm_jax.sampler.wire import (CHOICES, COLUMNS, COMPILE_STATS, COMPLETION_TOKENS, FINISH_REASON, IDS, INDEX,
                                  LENGTHS, LOGPROBS, MAX_NEW_TOKENS, MODEL, OBJECT, OK, PATH, PROMPT_INDEX,
                                  PROMPT_TOKENS, RESPONSE_FORMAT, RESPONSE_FORMATS, ROUTED_EXPERTS, STATUS,
                                  TEXT_COMPLETION, TOKEN_IDS, TOP_LOGPROBS, USAGE, VERSION, WEIGHTS_VERSION)
from pdm_jax.sampler.wire_codec import _kind, _show
from pdm_jax.sampler.wire_request import _is_int


# ============================================================================= generation response
@dataclasses.dataclass(frozen=True)
class GenerateResponse:
    """A ``POST /v1/generate`` response: the RolloutBatch plus the model name and prompt usage.

    Attributes:
      batch: RolloutBatch (N rows; completion_* [N, T], topk_* [N, T, K]).
      model: the model's name (``/health``'s ``model``).
      prompt_tokens: tokens over all prompts, each prompt counted once (as vLLM).
    """

    batch: "RolloutBatch"
    model: str = ""
    prompt_tokens: int = 0

    @property
    def weights_version(self) -> int:
        """The response-level ``weights_version``: that of the first row."""
        return int(self.batch.weights_version[0])

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over all rows (``usage.completion_tokens``)."""
        return int(self.batch.completion_mask.sum())

    def to_wire(self, response_format: str = CHOICES) -> dict:
        """The response body (a dict for `dumps`; arrays stay numpy, `dumps` packs them).

        ``"choices"``: choice r carries row r of the batch cut to its completion length T_r.
        ``"columns"``: `COLUMNS` holds one array per field for all rows: the per-token fields packed, each row's
        T_r entries after the previous row's (completion ids, log mu [sum T_r], top-K [sum T_r, K], [0, 0] for K = 0;
        no padding: a mixed-length batch's columns are its tokens' size, not N x T), lengths, prompt indices, versions
        [N], finish reasons; routed experts [N, P + T, L, k] when present: a handful of arrays instead of ~4 per row.
        """
        if response_format not in RESPONSE_FORMATS:
            raise ValueError(f"{RESPONSE_FORMAT}: must be one of {RESPONSE_FORMATS}, got {_kind(response_format)}")
        if response_format == "columns":
            return self._header(self._columns())
        b = self.batch
        lengths = b.completion_mask.sum(axis=1)
        p_out, plen = b.prompt_ids.shape[1], b.prompt_mask.sum(axis=1)
        choices = []
        for r in range(b.num_sequences):
            t = int(lengths[r])
            if b.routed_experts is not None:  # the row's real prompt tokens and its completion
                choices.append({ROUTED_EXPERTS: b.routed_experts[r, p_out - int(plen[r]):p_out + t]})
            else:
                choices.append({})
            choices[-1].update({
                INDEX: r, PROMPT_INDEX: int(b.group_ids[r]),
                TOKEN_IDS: b.completion_ids[r, :t], LOGPROBS: b.behavior_logprobs[r, :t],
                TOP_LOGPROBS: {IDS: b.topk_ids[r, :t], LOGPROBS: b.topk_logprobs[r, :t]},
                FINISH_REASON: str(b.finish_reason[r]), WEIGHTS_VERSION: int(b.weights_version[r])})
        return self._header({CHOICES: choices})

    def _header(self, rows: dict) -> dict:
        """The body around the rows (``choices`` or ``columns``): object, model, version, usage."""
        return {OBJECT: TEXT_COMPLETION, MODEL: self.model, WEIGHTS_VERSION: self.weights_version, **rows,
                USAGE: {PROMPT_TOKENS: int(self.prompt_tokens), COMPLETION_TOKENS: self.completion_tokens}}

    def _columns(self) -> dict:
        b = self.batch
        lengths = b.completion_mask.sum(axis=1).astype(np.int32)
        real = np.arange(b.completion_ids.shape[1])[None, :] < lengths[:, None]  # each row's first T_r, row after row
        if b.topk_ids.shape[-1]:
            top = {IDS: b.topk_ids[real], LOGPROBS: b.topk_logprobs[real]}
        else:  # K = 0: no table; [sum T_r, 0] would be refused by `loads` past MAX_EMPTY_ARRAY_ITEMS tokens
            top = {IDS: np.zeros((0, 0), np.int32), LOGPROBS: np.zeros((0, 0), np.float32)}
        cols = {TOKEN_IDS: b.completion_ids[real], LENGTHS: lengths, LOGPROBS: b.behavior_logprobs[real],
                TOP_LOGPROBS: top,
                PROMPT_INDEX: b.group_ids, FINISH_REASON: [str(x) for x in b.finish_reason],
                WEIGHTS_VERSION: b.weights_version}
        if b.routed_experts is not None:
            cols[ROUTED_EXPERTS] = b.routed_experts
        return {COLUMNS: cols}

    @classmethod
    def from_wire(cls, body: Mapping, prompts: Sequence[Sequence[int]], *, top_k_logprobs: int,
                  rows: Optional[int] = None, max_new_tokens: Optional[int] = None) -> "GenerateResponse":
        """Decodes a response body (JSON- or msgpack-decoded) for the request's `prompts` and K.

        The batch is rebuilt as the engine builds it: prompts left-padded to the
        longest (int32 / bool mask [N, P]), completions right-padded to
        T = max(1, longest completion) with id 0 / log-prob 0 / mask False,
        topk_* [N, T, K]; JSON nulls (-inf log-probs) become -inf.  ``model``
        and ``usage`` may be absent (then "" and the prompts' token count).

        A ``columns`` body (`to_wire`) gives the same batch as its ``choices`` form.

        ``rows`` (the request's prompts x n) and ``max_new_tokens``, when given (`SamplerClient` gives both): a body
        with another number of rows, or a row longer than that, is refused before any [N, T] array is built, so a
        small body cannot make the decoder allocate rows x longest row beyond what the request allows.

        Raises:
          KeyError, ValueError: a body missing ``choices`` fields, or arrays whose
            sizes do not match K and the token counts; for ``columns``, a ValueError naming
            the column (``columns.lengths``) and what is wrong with it; rows or lengths beyond ``rows`` /
            ``max_new_tokens``; a ``top_k_logprobs`` that is not an integer >= 0.
        """
        k = top_k_logprobs
        if not _is_int(k) or k < 0:
            raise ValueError(f"top_k_logprobs: must be an integer >= 0 (the request's {LOGPROBS}), got {_show(k, 24)}")
        if COLUMNS in body:
            return cls._from_columns(body, prompts, int(k), rows=rows, max_new_tokens=max_new_tokens)
        raw = body[CHOICES]
        if not isinstance(raw, list) or not all(isinstance(c, Mapping) for c in raw):
            raise ValueError(f"{CHOICES}: must be a list of maps, got {_kind(raw)}")
        _check_request_bounds(CHOICES, len(raw), None, rows, max_new_tokens)
        for r, c in enumerate(raw):
            if not _is_int(c.get(INDEX)):
                raise ValueError(f"{CHOICES}[{r}].{INDEX}: must be an integer, got {_show(c.get(INDEX), 24)}")
        choices = sorted(raw, key=lambda c: c[INDEX])
        toks = []
        for r, c in enumerate(choices):
            i = c.get(PROMPT_INDEX)
            if not _is_int(i) or not 0 <= i < len(prompts):
                raise ValueError(f"{CHOICES}[{r}].{PROMPT_INDEX}: must be an integer in [0, {len(prompts)}) (the "
                                 f"request's prompts), got {_show(i, 24)}")
            toks.append(_column(c, TOKEN_IDS, 1, where=f"{CHOICES}[{r}]"))
        lengths = np.array([len(x) for x in toks], np.int64)
        _check_request_bounds(f"{CHOICES}[*].{TOKEN_IDS}", len(raw), lengths, rows, max_new_tokens)
        t_in = int(max(1, lengths.max(initial=0)))
        top_ids, top_logp, logp = [], [], []
        for r, (c, x) in enumerate(zip(choices, toks)):
            logp.append(_column(c, LOGPROBS, 1, (len(x),), floats=True, where=f"{CHOICES}[{r}]"))
            if not (k and len(x)):
                top_ids.append(np.zeros((len(x), k), np.int32))
                top_logp.append(np.zeros((len(x), k), np.float32))
                continue
            tp, where = c.get(TOP_LOGPROBS), f"{CHOICES}[{r}].{TOP_LOGPROBS}"
            if not isinstance(tp, Mapping):
                raise ValueError(f"{where}: must be a map of {IDS} and {LOGPROBS} ({k} per token), got {_kind(tp)}")
            top_ids.append(_column(tp, IDS, 2, (len(x), k), where=where))
            top_logp.append(_column(tp, LOGPROBS, 2, (len(x), k), floats=True, where=where))
        top_ids = right_pad_rows(top_ids, t_in, dtype=np.int32)
        top_logp = right_pad_rows(top_logp, t_in)
        logp = right_pad_rows(logp, t_in)
        _check_logprobs(logp, f"{CHOICES}[*].{LOGPROBS}")
        _check_logprobs(top_logp, f"{CHOICES}[*].{TOP_LOGPROBS}.{LOGPROBS}")
        batch = build_batch(
            prompts, group_ids=np.array([int(c[PROMPT_INDEX]) for c in choices], np.int64), lengths=lengths,
            completion_ids=right_pad_rows(toks, t_in, dtype=np.int32), behavior_logprobs=logp, topk_ids=top_ids,
            topk_logprobs=top_logp,
            weights_version=_versions([c.get(WEIGHTS_VERSION, body[WEIGHTS_VERSION]) for c in choices],
                                      f"{CHOICES}[*].{WEIGHTS_VERSION}"),
            finish_reason=np.array([c[FINISH_REASON] for c in choices], dtype=object),
            routed_experts=_routed_experts(choices, prompts, max(len(p) for p in prompts), t_in))
        return cls._with_header(body, prompts, batch)

    @classmethod
    def _with_header(cls, body: Mapping, prompts, batch) -> "GenerateResponse":
        """The response of a decoded `batch` with the body's ``model`` and ``usage`` (checked; defaults when absent)."""
        usage, model = body.get(USAGE) or {}, body.get(MODEL, "")
        if not isinstance(usage, Mapping):
            raise ValueError(f"{USAGE}: must be a map, got {_kind(usage)}")
        prompt_tokens = usage.get(PROMPT_TOKENS, sum(len(p) for p in prompts))
        if not _is_int(prompt_tokens) or prompt_tokens < 0:
            raise ValueError(f"{USAGE}.{PROMPT_TOKENS}: must be an integer >= 0, got {_kind(prompt_tokens)}")
        if not isinstance(model, str):
            raise ValueError(f"{MODEL}: must be a string, got {_kind(model)}")
        return cls(batch=batch, model=model, prompt_tokens=int(prompt_tokens))

    @classmethod
    def _from_columns(cls, body: Mapping, prompts: Sequence[Sequence[int]], k: int, *, rows: Optional[int] = None,
                      max_new_tokens: Optional[int] = None) -> "GenerateResponse":
        """`from_wire` of a ``columns`` body: every column's shape and range checked, rows cut as the choices are."""
        cols = body[COLUMNS]
        if CHOICES in body:
            raise ValueError(f"a response carries {CHOICES!r} or {COLUMNS!r}, not both")
        if not isinstance(cols, Mapping):
            raise ValueError(f"{COLUMNS}: must be a map, got {_kind(cols)}")
        if not isinstance(cols.get(TOP_LOGPROBS), Mapping):
            raise ValueError(f"{COLUMNS}.{TOP_LOGPROBS}: must be a map, got {_kind(cols.get(TOP_LOGPROBS))}")
        raw = cols.get(TOKEN_IDS)
        padded = (raw.ndim == 2) if isinstance(raw, np.ndarray) else bool(raw) and isinstance(raw, list) and isinstance(
            raw[0], list)  # [N, T(, K)]: servers before the packed columns
        ids = _column(cols, TOKEN_IDS, 2 if padded else 1)
        if padded:
            n_rows, t_in = shape = ids.shape
            if n_rows == 0 or t_in == 0:
                raise ValueError(f"{COLUMNS}.{TOKEN_IDS}: must be [rows >= 1, tokens >= 1], got {list(ids.shape)}")
            lengths = _column(cols, LENGTHS, 1, (n_rows,))
        else:  # packed: row r's lengths[r] entries after row r - 1's
            lengths, shape = _column(cols, LENGTHS, 1), ids.shape
            n_rows, t_in = lengths.shape[0], int(max(lengths.max(initial=0), 1))
            if n_rows == 0 or lengths.min() < 0 or int(lengths.sum()) != shape[0]:
                raise ValueError(f"{COLUMNS}.{LENGTHS}: must be one count >= 0 per row, summing to the {shape[0]} "
                                 f"packed {COLUMNS}.{TOKEN_IDS}; got {_show(lengths.tolist())}")
        _check_request_bounds(f"{COLUMNS}.{LENGTHS}", n_rows, lengths, rows, max_new_tokens)
        index = _column(cols, PROMPT_INDEX, 1, (n_rows,))
        versions = _versions(_column(cols, WEIGHTS_VERSION, 1, (n_rows,)), f"{COLUMNS}.{WEIGHTS_VERSION}")
        reasons = cols.get(FINISH_REASON)
        if not isinstance(reasons, list) or len(reasons) != n_rows or not all(x in FINISH_REASONS for x in reasons):
            raise ValueError(f"{COLUMNS}.{FINISH_REASON}: must be a list of {n_rows} of {FINISH_REASONS}, "
                             f"got {_kind(reasons)}")
        if lengths.min() < 0 or lengths.max() > t_in:
            raise ValueError(f"{COLUMNS}.{LENGTHS}: must lie in [0, {t_in}], got {_show(lengths.tolist())}")
        if index.min() < 0 or index.max() >= len(prompts):
            raise ValueError(f"{COLUMNS}.{PROMPT_INDEX}: must lie in [0, {len(prompts)}), got {_show(index.tolist())}")
        logp = _check_logprobs(_column(cols, LOGPROBS, len(shape), shape, floats=True), f"{COLUMNS}.{LOGPROBS}")
        top = cols[TOP_LOGPROBS]
        if k == 0 and not padded:  # no table (`_columns`: [0, 0]; [sum T_r, 0] from earlier servers)
            for name in (IDS, LOGPROBS):
                v = top.get(name)
                earlier = (v.shape == shape + (0,)) if isinstance(v, np.ndarray) else (
                    isinstance(v, list) and len(v) == shape[0] > 0 and all(x == [] for x in v))
                _column(top, name, 2, shape + (0,) if earlier else (0, 0), floats=name == LOGPROBS,
                        where=f"{COLUMNS}.{TOP_LOGPROBS}")
            top_ids, top_logp = np.zeros(shape + (0,), np.int32), np.zeros(shape + (0,), np.float32)
        else:
            top_ids = _column(top, IDS, len(shape) + 1, shape + (k,), where=f"{COLUMNS}.{TOP_LOGPROBS}")
            top_logp = _check_logprobs(_column(top, LOGPROBS, len(shape) + 1, shape + (k,), floats=True,
                                               where=f"{COLUMNS}.{TOP_LOGPROBS}"),
                                       f"{COLUMNS}.{TOP_LOGPROBS}.{LOGPROBS}")
        if not padded:  # back to [N, T(, K)], zeros past each row's length (build_batch masks them)
            real = np.arange(t_in)[None, :] < lengths[:, None]
            ids, logp, top_ids, top_logp = (_unpack(a, real) for a in (ids, logp, top_ids, top_logp))
        p_out = max(len(p) for p in prompts)
        routed = None
        if ROUTED_EXPERTS in cols:
            routed = _column(cols, ROUTED_EXPERTS, 4)
            if routed.shape[:2] != (n_rows, p_out + t_in):
                raise ValueError(f"{COLUMNS}.{ROUTED_EXPERTS}: must be [{n_rows}, {p_out + t_in}, L, k], "
                                 f"got {list(routed.shape)}")
        batch = build_batch(prompts, group_ids=index, lengths=lengths, completion_ids=ids, behavior_logprobs=logp,
                            topk_ids=top_ids, topk_logprobs=top_logp, weights_version=versions,
                            finish_reason=np.array(reasons, dtype=object), routed_experts=routed)
        return cls._with_header(body, prompts, batch)


def _versions(values, where: str) -> np.ndarray:
    """A response's per-row weights versions as int64 [N]: integers in [0, `MAX_INT32`] (versions travel as
    int32; a negative one would make the logged staleness wrong).

    Raises:
      ValueError: naming `where` and the first bad value.
    """
    for v in (values.tolist() if isinstance(values, np.ndarray) else values):
        if not _is_int(v) or not 0 <= v <= MAX_INT32:
            raise ValueError(f"{where}: must be integers in [0, {MAX_INT32}] (weights versions), got "
                             f"{_show(v, 24)}")
    return np.asarray(values, np.int64)


def _check_request_bounds(where: str, n_rows: int, lengths: Optional[np.ndarray], rows: Optional[int],
                          max_new_tokens: Optional[int]) -> None:
    """A response's ``n_rows`` rows and their ``lengths`` ([N] tokens each) against the request's ``rows`` and
    ``max_new_tokens`` (each checked when not None).

    Raises:
      ValueError: naming ``where``, the value and the request's bound.
    """
    if rows is not None and n_rows != rows:
        raise ValueError(f"{where}: the request asked for {rows} rows (prompts x n), the response has {n_rows}")
    if max_new_tokens is not None and lengths is not None and lengths.size and int(lengths.max()) > max_new_tokens:
        raise ValueError(f"{where}: a row of {int(lengths.max())} tokens, beyond the request's max_new_tokens "
                         f"{max_new_tokens}")


def _unpack(flat: np.ndarray, real: np.ndarray) -> np.ndarray:
    """A packed column ([sum T_r(, K)], row after row) placed into [N, T(, K)] at ``real`` ([N, T] bool), zeros
    elsewhere."""
    out = np.zeros(real.shape + flat.shape[1:], flat.dtype)
    out[real] = flat
    return out


def _check_logprobs(a: np.ndarray, where: str) -> np.ndarray:
    """Log-probabilities: NaN, +inf and values above 0 (beyond float32 rounding) are refused; -inf is allowed.

    Raises:
      ValueError: naming `where`, the first bad value and its position.
    """
    bad = np.isnan(a) | (a > 1e-3)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{where}: not a log-probability at {list(at)}: {float(a[at])} (NaN or above 0)")
    return a


def _column(cols: Mapping, name: str, ndim: int, shape: Optional[tuple] = None, *, floats: bool = False,
            where: str = COLUMNS) -> np.ndarray:
    """Column `name` of a ``columns`` response as int32 (or float32: JSON nulls = -inf), checked.

    Plain lists (JSON, or msgpack without packing) may hold only ints (and, for floats, floats and
    null): no bools, strings or bytes, which numpy would otherwise convert. Integers must fit int32
    (routed experts keep their packed integer dtype).

    Raises:
      ValueError: naming ``where.name``: missing, not numeric, not `ndim`-dimensional, not of `shape`, or
        an integer outside int32.
    """
    if name not in cols:
        raise ValueError(f"{where}.{name}: missing")
    value, field = cols[name], f"{where}.{name}"
    a = value
    if not isinstance(value, np.ndarray):
        try:
            a = np.array(value, dtype=object)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{field}: not a regular array ({type(e).__name__}: {e})") from None
        allowed = (int, float, type(None)) if floats else (int,)
        odd = next((x for x in a.reshape(-1) if type(x) not in allowed), None)
        if odd is not None:
            raise ValueError(f"{field}: must hold {'numbers or null' if floats else 'integers'}, got {_kind(odd)}")
        try:
            a = np.where(np.equal(a, None), -np.inf, a).astype(np.float32) if floats else np.array(a.tolist())
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"{field}: not a regular numeric array ({type(e).__name__}: {e})") from None
    if shape is not None and a.size == 0 and 0 in shape and a.ndim < ndim:  # an empty JSON list of any depth
        a = a.reshape(shape)
    if a.ndim != ndim or (shape is not None and a.shape != shape):
        want = f"shape {list(shape)}" if shape is not None else f"{ndim} dimensions"
        raise ValueError(f"{field}: must have {want}, got shape {list(a.shape)}")
    if a.dtype.kind not in ("fiu" if floats else "iu") and a.size:
        raise ValueError(f"{field}: must hold {'numbers' if floats else 'integers'}, got {a.dtype}")
    if floats:
        return a.astype(np.float32)
    if a.size and (int(a.min()) < -MAX_INT32 - 1 or int(a.max()) > MAX_INT32):
        raise ValueError(f"{field}: integers must fit int32, got {int(a.min())} .. {int(a.max())}")
    return a.astype(a.dtype if name == ROUTED_EXPERTS and a.dtype.kind == "i" else np.int32)


def _routed_experts(choices, prompts, p_out: int, t_out: int) -> Optional[np.ndarray]:
    """``RolloutBatch.routed_experts`` [N, p_out + t_out, L, k] from the choices' ``routed_experts``
    ([P_i + T_r, L, k] each: placed at columns p_out - P_i .. p_out + T_r, -1 elsewhere), or None
    when no choice has them.

    Raises:
      ValueError: some choices have them and others not, or a choice's array is not
        [P_i + T_r, L, k] integers with the same L, k as the others.
    """
    have = [ROUTED_EXPERTS in c for c in choices]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{CHOICES}[{have.index(False)}] has no {ROUTED_EXPERTS} while other choices do")
    arrays = [np.asarray(c[ROUTED_EXPERTS]) for c in choices]
    lk = arrays[0].shape[1:]
    dtype = np.result_type(*[a.dtype for a in arrays]) if all(a.dtype.kind in "iu" for a in arrays) else None
    out = np.full((len(choices), p_out + t_out) + tuple(lk), -1, dtype or np.int32)
    for r, (c, a) in enumerate(zip(choices, arrays)):
        pl, t = len(prompts[int(c[PROMPT_INDEX])]), len(np.asarray(c[TOKEN_IDS]).reshape(-1))
        if dtype is None or a.shape != (pl + t,) + tuple(lk) or len(lk) != 2:
            raise ValueError(f"{CHOICES}[{r}].{ROUTED_EXPERTS} must be [prompt + completion tokens, L, k] = "
                             f"{[pl + t] + list(lk)} integers, got {a.dtype} {list(a.shape)}")
        out[r, p_out - pl:p_out + t] = a
    return out


def response_to_batch(prompts: Sequence[Sequence[int]], resp: Mapping, *, top_k_logprobs: int) -> "RolloutBatch":
    """The RolloutBatch of a /v1/generate response body (`GenerateResponse.from_wire(...).batch`)."""
    return GenerateResponse.from_wire(resp, prompts, top_k_logprobs=top_k_logprobs).batch


def weights_loaded(*, version: int, path: str, seconds: float, reloaded: bool) -> dict:
    """What a weights load reports (`SamplingEngine.load_weights`): ``{"version", "path", "seconds", "reloaded"}``."""
    return {VERSION: version, PATH: path, "seconds": seconds, "reloaded": reloaded}


def weights_response(info: Mapping, compile_stats: Optional[Mapping] = None) -> dict:
    """The ``POST /v1/weights`` response body: ``{"status": "ok", **info}``, plus ``"compile_stats"``
    (the server's `pdm_jax.profiling.CompileCounter` snapshot) when given."""
    body = {STATUS: OK, **info}
    if compile_stats is not None:
        body[COMPILE_STATS] = dict(compile_stats)
    return body


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    """An engine's ``/health`` fields (`SamplingEngine.health`); `health_body` writes them, status "ok".

    ``weight_noise`` / ``weight_noise_seed`` are the relative std and the seed of the copy's fixed perturbation
    (``--weight_noise``, 0 = none; ``--weight_noise_seed``). ``loading`` is None, or ``{"version", "since"}``
    (time.monotonic) while a weights load reads its files: the body shows ``{"version", "seconds"}`` (a load stuck
    on a slow mount shows there, while generation goes on with the current version).
    """

    model: str
    quantization: str
    version: int
    compute_dtype: str
    vocab_size: int
    max_prompt_length: int
    max_new_tokens: int
    weights_path: Optional[str]
    loading: Optional[Mapping] = None
    weight_noise: float = 0.0
    weight_noise_seed: int = 0


def health_body(h: EngineHealth) -> dict:
    """The ``/health`` body of `EngineHealth` ``h``."""
    busy = None if h.loading is None else {VERSION: int(h.loading["version"]),
                                            "seconds": round(time.monotonic() - float(h.loading["since"]), 3)}
    return {STATUS: OK, MODEL: h.model, "quantization": h.quantization, "weight_noise": h.weight_noise,
            "weight_noise_seed": h.weight_noise_seed, VERSION: h.version,
            "compute_dtype": h.compute_dtype, "vocab_size": h.vocab_size, "max_prompt_length": h.max_prompt_length,
            MAX_NEW_TOKENS: h.max_new_tokens, "weights_path": h.weights_path, "loading": busy}


def health_with_stats(health: Mapping, *, requests: int, generated_tokens: int, uptime_s: float) -> dict:
    """The server's ``/health`` body: the engine's fields plus its request counters and uptime."""
    return {**health, "requests": requests, "generated_tokens": generated_tokens, "uptime_s": uptime_s}
