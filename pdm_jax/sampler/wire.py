"""The sampler service's wire schema: field names, request/response encode/decode, body codecs.

This module is the one place that knows the HTTP bodies.  The server decodes a
request with it, calls the engine and encodes the answer with it; the client
encodes with it, posts, and decodes with it.  Python-side names differ from the
wire names in three places (the wire follows vLLM's completions API)::

    Python (SamplingEngine / SamplerClient / RolloutBatch)   wire
    max_new_tokens                                           max_tokens
    top_k_logprobs                                           logprobs
    RolloutBatch.group_ids                                   prompt_index (per choice)

Validation errors (`RequestError`) name fields by their *wire* names, e.g.
``"max_tokens: must be an integer in [1, 256], got 300"``.

Request (``POST /v1/generate``, shaped after vLLM's completions API with token ids)::

    {"prompt": [[int, ...], ...] | [int, ...], "n": 1, "temperature": 1.0, "top_p": 1.0,
     "top_k": 0 (-1 also means off), "max_tokens": 16, "stop_token_ids": [int, ...],
     "logprobs": K, "seed": int | null}
    ("model" is accepted and ignored; "stream": true is refused)

Response::

    {"object": "text_completion", "model": str, "weights_version": int,
     "choices": [{"index": r, "prompt_index": i, "token_ids": [T_r ints],
                  "logprobs": [T_r floats]                      (log mu of the sampled ids),
                  "top_logprobs": {"ids": [T_r x K ints], "logprobs": [T_r x K floats]},
                  "finish_reason": "stop" | "length", "weights_version": int}, ...],
     "usage": {"prompt_tokens": int, "completion_tokens": int}}
    (prompt_tokens counts each prompt once, as vLLM does, whatever n is)

``POST /v1/weights``: request ``{"path": str, "version": int}``, response
``{"status": "ok", "version", "path", "seconds", "reloaded"}``.

``GET /health``: ``{"status", "model", "quantization", "version", "compute_dtype",
"vocab_size", "max_prompt_length", "max_new_tokens", "weights_path"}`` (the
engine's `health_body`), plus ``requests``, ``generated_tokens``, ``uptime_s``
from the server.

Errors (any status >= 400): ``{"error": {"message": str, "field": str | null, "type": str}}``.

In msgpack bodies every numeric array is an ``{"__nd__": 1, "dtype", "shape",
"data": bytes}`` map (little-endian), so top-K tables travel as raw f32/int32.
In JSON bodies arrays are nested lists, and non-finite log-probabilities
(-inf: ids removed by top-k/top-p filtering) are written as ``null``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import msgpack as _msgpack  # aliased: `dumps`/`loads`/`to_plain` take a keyword named msgpack
import numpy as np

if TYPE_CHECKING:  # pdm_jax.rollout imports JAX; see GenerateResponse.from_wire
    from pdm_jax.rollout import RolloutBatch

# ----------------------------------------------------------------------------- content types
JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
ND_KEY = "__nd__"
_DTYPES = {"float32": "<f4", "int32": "<i4", "bool": "|b1", "float64": "<f8", "int64": "<i8"}

# ----------------------------------------------------------------------------- field names
# POST /v1/generate request
PROMPT = "prompt"
N = "n"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
MAX_TOKENS = "max_tokens"  # Python: max_new_tokens
STOP_TOKEN_IDS = "stop_token_ids"
LOGPROBS = "logprobs"  # Python: top_k_logprobs (also the per-choice sampled log mu in the response)
SEED = "seed"
MODEL = "model"  # accepted and ignored in a request; the model's name in responses and /health
STREAM = "stream"  # only false/absent is accepted
GENERATE_FIELDS = frozenset({PROMPT, N, TEMPERATURE, TOP_P, TOP_K, MAX_TOKENS, STOP_TOKEN_IDS, LOGPROBS, SEED,
                             MODEL, STREAM})
DEFAULT_MAX_TOKENS = 16  # max_tokens when a request omits it (vLLM's default)

# POST /v1/generate response
OBJECT = "object"
TEXT_COMPLETION = "text_completion"
WEIGHTS_VERSION = "weights_version"
CHOICES = "choices"
INDEX = "index"
PROMPT_INDEX = "prompt_index"  # Python: RolloutBatch.group_ids
TOKEN_IDS = "token_ids"
TOP_LOGPROBS = "top_logprobs"
IDS = "ids"
FINISH_REASON = "finish_reason"
USAGE = "usage"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"

# POST /v1/weights request and response; GET /health
PATH = "path"
VERSION = "version"
STATUS = "status"
OK = "ok"
MAX_NEW_TOKENS = "max_new_tokens"  # /health: the server's max_tokens limit

# error bodies
ERROR = "error"
MESSAGE = "message"
FIELD = "field"
TYPE = "type"

# ----------------------------------------------------------------------------- limits used by validation
MIN_TEMPERATURE = 1e-3  # smallest positive sampling temperature (z / tau must stay finite in f32)
MAX_SEED = 2**63 - 1


# ============================================================================= errors
class RequestError(ValueError):
    """An invalid generation or weights request; ``field`` is the offending field's *wire* name.

    ``str(e)`` is ``"<field>: <message>"``.  The server answers it with HTTP 422.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class BodyError(ValueError):
    """A request body that cannot be decoded; ``status`` is 400 (malformed) or 415 (content type)."""

    def __init__(self, status: int, message: str, kind: str):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_body(message: str, field: Optional[str], kind: str) -> dict:
    """The body of an error response: ``{"error": {"message", "field", "type"}}``."""
    return {ERROR: {MESSAGE: message, FIELD: field, TYPE: kind}}


def error_detail(body: Any) -> Any:
    """The ``error`` object of a decoded error body, or the body itself when it has none (e.g. plain text)."""
    return body.get(ERROR, body) if isinstance(body, dict) else body


def decode_error(body: Any) -> tuple:
    """``(message, field)`` of a decoded error body; message falls back to ``str(body)``, field to None."""
    err = body.get(ERROR, {}) if isinstance(body, dict) else {}
    return err.get(MESSAGE) or str(body), err.get(FIELD)


# ============================================================================= body codecs
def is_msgpack(content_type: str | None) -> bool:
    """True if a Content-Type / Accept header value names msgpack."""
    if not content_type:
        return False
    return any(t in content_type.lower() for t in MSGPACK_TYPES)


def response_is_msgpack(accept: Optional[str], content_type: Optional[str]) -> bool:
    """Whether to answer in msgpack: Accept names it, or Accept is absent/``*/*`` and the request was msgpack."""
    accept = accept or ""
    return is_msgpack(accept) or (not accept or "*/*" in accept) and is_msgpack(content_type)


def encode_array(a: np.ndarray) -> dict:
    """A numeric numpy array as a msgpack-friendly map (raw little-endian bytes).

    Raises:
      ValueError: a dtype other than float32/64, int32/64 or bool.
    """
    a = np.asarray(a)
    name = str(a.dtype)
    if name not in _DTYPES:
        raise ValueError(f"cannot encode array dtype {name}")
    return {ND_KEY: 1, "dtype": name, "shape": list(a.shape), "data": np.ascontiguousarray(a.astype(_DTYPES[name])).tobytes()}


def decode_array(d: dict) -> np.ndarray:
    """Inverse of `encode_array`.

    Raises:
      ValueError: unknown dtype, or data size not matching the shape.
    """
    name = d.get("dtype")
    if name not in _DTYPES:
        raise ValueError(f"unknown array dtype {name!r}")
    shape = tuple(int(s) for s in d["shape"])
    a = np.frombuffer(d["data"], dtype=_DTYPES[name])
    if a.size != int(np.prod(shape)):
        raise ValueError(f"array data has {a.size} items, shape {shape} needs {int(np.prod(shape))}")
    return a.reshape(shape).astype(name)


def to_plain(obj: Any, *, msgpack: bool) -> Any:
    """Numpy arrays/scalars -> wire objects (msgpack: packed arrays; JSON: lists, -inf/nan -> None)."""
    if isinstance(obj, dict):
        return {k: to_plain(v, msgpack=msgpack) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, msgpack=msgpack) for v in obj]
    if isinstance(obj, np.ndarray):
        if msgpack:
            return encode_array(obj)
        if obj.dtype.kind == "f":
            return [_finite_or_none(x) for x in obj.tolist()] if obj.ndim == 1 else [to_plain(r, msgpack=False) for r in obj]
        return obj.tolist()
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not msgpack:
        return _finite_or_none(obj)
    return obj


def _finite_or_none(x):
    return x if math.isfinite(x) else None


def from_plain(obj: Any) -> Any:
    """Decodes packed arrays (msgpack) recursively; JSON lists are left as lists."""
    if isinstance(obj, dict):
        if obj.get(ND_KEY) == 1:
            return decode_array(obj)
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    return obj


def dumps(obj: Any, *, msgpack: bool) -> bytes:
    """Serialises a response/request body (JSON is strict: no NaN/Infinity tokens)."""
    plain = to_plain(obj, msgpack=msgpack)
    if msgpack:
        return _msgpack.packb(plain, use_bin_type=True)
    return json.dumps(plain, allow_nan=False, separators=(",", ":")).encode()


def loads(body: bytes, *, msgpack: bool) -> Any:
    """Parses a body.

    Raises:
      ValueError: malformed JSON or msgpack (the message says which and why).
    """
    if msgpack:
        try:
            obj = _msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several exception types
            raise ValueError(f"malformed msgpack body: {type(e).__name__}: {e}") from e
        return from_plain(obj)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed JSON body: {e}") from e



def decode_body(body: bytes, content_type: Optional[str]) -> dict:
    """A request body (JSON or msgpack by `content_type`, JSON when absent) as a dict.

    Raises:
      BodyError: status 415 for a content type that is neither JSON nor msgpack,
        400 (kind "malformed_body") for unparsable bytes or a body that is not a map.
    """
    ctype = JSON if content_type is None else content_type
    if not (is_msgpack(ctype) or "json" in ctype.lower()):
        raise BodyError(415, f"unsupported Content-Type {ctype!r}; use {JSON} or {MSGPACK}", "invalid_request")
    try:
        obj = loads(body, msgpack=is_msgpack(ctype))
    except ValueError as e:
        raise BodyError(400, str(e), "malformed_body") from e
    if not isinstance(obj, dict):
        raise BodyError(400, f"body must be an object (map), got {type(obj).__name__}", "malformed_body")
    return obj


def float_list(x) -> np.ndarray:
    """A JSON list of floats/None (None = -inf) or a decoded array -> float32 array."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    return np.array([[(-np.inf if v is None else v) for v in r] if isinstance(r, list) else (-np.inf if r is None else r)
                     for r in x], dtype=np.float32)


# ============================================================================= generation request
@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A ``POST /v1/generate`` request, with the Python (SamplingEngine) field names.

    Attributes:
      prompts: token-id lists (wire ``prompt``; a single flat list is one prompt).
      n: samples per prompt.
      temperature, top_p, top_k: sampling parameters (top_k 0 = off; -1 on the wire is 0).
      max_new_tokens: wire ``max_tokens`` (default `DEFAULT_MAX_TOKENS`).
      top_k_logprobs: K, wire ``logprobs`` (null/absent = 0).
      stop_token_ids: ids that end a sequence.
      seed: int or None.

    Values are carried as given: types and ranges are checked by `validate_request`
    (the engine), only the body's structure by `from_wire`.
    """

    prompts: list
    n: Any = 1
    temperature: Any = 1.0
    max_new_tokens: Any = DEFAULT_MAX_TOKENS
    top_k_logprobs: Any = 0
    stop_token_ids: list = dataclasses.field(default_factory=list)
    seed: Any = None
    top_p: Any = 1.0
    top_k: Any = 0

    @classmethod
    def from_wire(cls, body: Mapping) -> "GenerateRequest":
        """Decodes a request body (a dict, numpy arrays allowed where msgpack packed them).

        Raises:
          RequestError: an unknown field (named), ``stream`` true, no ``prompt``,
            or a ``stop_token_ids`` that is not a list.
        """
        unknown = sorted(set(body) - GENERATE_FIELDS)
        if unknown:
            raise RequestError(unknown[0], f"unknown field(s) {unknown}")
        if body.get(STREAM):
            raise RequestError(STREAM, "streaming is not supported")
        if PROMPT not in body:
            raise RequestError(PROMPT, f"missing required field {PROMPT!r}")
        stops = body.get(STOP_TOKEN_IDS) or []
        if not isinstance(stops, list):
            raise RequestError(STOP_TOKEN_IDS, "must be a list of token ids")
        top_k = body.get(TOP_K, 0)
        return cls(prompts=_normalise_prompts(body[PROMPT]), n=body.get(N, 1),
                   temperature=body.get(TEMPERATURE, 1.0), max_new_tokens=body.get(MAX_TOKENS, DEFAULT_MAX_TOKENS),
                   top_k_logprobs=body.get(LOGPROBS, 0) or 0, stop_token_ids=stops, seed=body.get(SEED),
                   top_p=body.get(TOP_P, 1.0), top_k=0 if top_k == -1 else top_k)

    def to_wire(self) -> dict:
        """The request body (a dict for `dumps`); prompts and stop ids as lists."""
        return {PROMPT: [list(p) for p in self.prompts], N: self.n, TEMPERATURE: self.temperature,
                TOP_P: self.top_p, TOP_K: self.top_k, LOGPROBS: self.top_k_logprobs,
                STOP_TOKEN_IDS: list(self.stop_token_ids), SEED: self.seed, MAX_TOKENS: self.max_new_tokens}

    def engine_kwargs(self) -> dict:
        """The keyword arguments of `SamplingEngine.generate` / `.validate` (everything but the prompts)."""
        return dict(n=self.n, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                    top_k_logprobs=self.top_k_logprobs, stop_token_ids=self.stop_token_ids, seed=self.seed,
                    top_p=self.top_p, top_k=self.top_k)

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts, each prompt counted once (the response's ``usage.prompt_tokens``)."""
        return sum(len(p) for p in self.prompts)


def _normalise_prompts(prompts):
    """A packed array -> lists; a single flat list of ints -> one prompt (as vLLM accepts)."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        prompts = [prompts]
    return prompts


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _validate_prompts(prompts, *, vocab_size: int, max_prompt_length: int) -> list:
    """The prompts as a list of int lists; RequestError("prompt", ...) otherwise."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise RequestError(PROMPT, "must be a list of token-id lists")
    if len(prompts) == 0:
        raise RequestError(PROMPT, "is empty; need at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
            raise RequestError(PROMPT, f"prompt[{i}] must be a list of token ids, got {type(p).__name__}")
        p = list(p)
        if len(p) == 0:
            raise RequestError(PROMPT, f"prompt[{i}] is empty")
        if len(p) > max_prompt_length:
            raise RequestError(PROMPT, f"prompt[{i}] has {len(p)} tokens, longer than the context limit "
                               f"max_prompt_length={max_prompt_length}")
        for t in p:
            if not _is_int(t):
                raise RequestError(PROMPT, f"prompt[{i}] holds a non-integer token {t!r}")
            if not 0 <= int(t) < vocab_size:
                raise RequestError(PROMPT, f"prompt[{i}] holds token id {int(t)} outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def validate_request(prompts, *, n, temperature, max_new_tokens, top_k_logprobs, stop_token_ids, seed,
                     top_p, top_k, vocab_size: int, max_prompt_length: int, max_new_tokens_limit: int,
                     max_stop_tokens: int, max_sequences: int = 4096) -> list:
    """Checks a generation request (Python argument names); returns the prompts as a list of int lists.

    Raises:
      RequestError: naming the field by its wire name, for an empty prompt list or
        prompt, a prompt longer than `max_prompt_length`, ids outside
        [0, vocab_size) (``prompt``), n <= 0, len(prompts) * n > max_sequences
        (``n``), temperature < 0, non-finite or in (0, MIN_TEMPERATURE)
        (``temperature``), top_p outside (0, 1] (``top_p``), top_k < 0 (``top_k``),
        max_new_tokens outside [1, max_new_tokens_limit] (``max_tokens``),
        top_k_logprobs outside [0, vocab_size] (``logprobs``), more than
        `max_stop_tokens` stop ids or ids outside the vocabulary
        (``stop_token_ids``), a seed outside [0, 2**63) (``seed``).
    """
    out = _validate_prompts(prompts, vocab_size=vocab_size, max_prompt_length=max_prompt_length)
    if not _is_int(n) or n <= 0:
        raise RequestError(N, f"must be an integer >= 1, got {n!r}")
    if len(out) * int(n) > max_sequences:
        raise RequestError(N, f"{len(out)} prompts x n={n} = {len(out) * int(n)} sequences exceeds the limit "
                           f"of {max_sequences} per request")
    if not isinstance(temperature, (int, float, np.floating, np.integer)) or isinstance(temperature, bool) \
            or not math.isfinite(float(temperature)) or float(temperature) < 0:
        raise RequestError(TEMPERATURE, f"must be a finite number >= 0, got {temperature!r}")
    if 0 < float(temperature) < MIN_TEMPERATURE:
        raise RequestError(TEMPERATURE, f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (logits / temperature "
                                        f"overflows float32 below that), got {temperature!r}")
    if not isinstance(top_p, (int, float, np.floating, np.integer)) or not (0.0 < float(top_p) <= 1.0):
        raise RequestError(TOP_P, f"must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise RequestError(TOP_K, f"must be an integer >= 0 (0 = off), got {top_k!r}")
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens <= max_new_tokens_limit:
        raise RequestError(MAX_TOKENS, f"must be an integer in [1, {max_new_tokens_limit}], got {max_new_tokens!r}")
    if not _is_int(top_k_logprobs) or not 0 <= top_k_logprobs <= vocab_size:
        raise RequestError(LOGPROBS, f"K must be an integer in [0, vocab_size={vocab_size}], got {top_k_logprobs!r}")
    stops = list(stop_token_ids or ())
    if len(stops) > max_stop_tokens:
        raise RequestError(STOP_TOKEN_IDS, f"at most {max_stop_tokens} stop ids, got {len(stops)}")
    for s in stops:
        if not _is_int(s) or not 0 <= int(s) < vocab_size:
            raise RequestError(STOP_TOKEN_IDS, f"id {s!r} outside the vocabulary [0, {vocab_size})")
    if seed is not None and (not _is_int(seed) or not 0 <= int(seed) <= MAX_SEED):
        raise RequestError(SEED, f"must be an integer in [0, 2**63), got {seed!r}")
    return out


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

    def to_wire(self) -> dict:
        """The response body (a dict for `dumps`; arrays stay numpy, `dumps` packs them).

        Choice r carries row r of the batch cut to its completion length T_r.
        """
        b = self.batch
        lengths = b.completion_mask.sum(axis=1)
        choices = []
        for r in range(b.num_sequences):
            t = int(lengths[r])
            choices.append({
                INDEX: r, PROMPT_INDEX: int(b.group_ids[r]),
                TOKEN_IDS: b.completion_ids[r, :t], LOGPROBS: b.behavior_logprobs[r, :t],
                TOP_LOGPROBS: {IDS: b.topk_ids[r, :t], LOGPROBS: b.topk_logprobs[r, :t]},
                FINISH_REASON: str(b.finish_reason[r]), WEIGHTS_VERSION: int(b.weights_version[r])})
        return {OBJECT: TEXT_COMPLETION, MODEL: self.model, WEIGHTS_VERSION: self.weights_version,
                CHOICES: choices,
                USAGE: {PROMPT_TOKENS: int(self.prompt_tokens), COMPLETION_TOKENS: int(lengths.sum())}}

    @classmethod
    def from_wire(cls, body: Mapping, prompts: Sequence[Sequence[int]], *,
                  top_k_logprobs: int) -> "GenerateResponse":
        """Decodes a response body (JSON- or msgpack-decoded) for the request's `prompts` and K.

        The batch is rebuilt as the engine builds it: prompts left-padded to the
        longest (int32 / bool mask [N, P]), completions right-padded to
        T = max(1, longest completion) with id 0 / log-prob 0 / mask False,
        topk_* [N, T, K]; JSON nulls (-inf log-probs) become -inf.  ``model``
        and ``usage`` may be absent (then "" and the prompts' token count).

        Raises:
          KeyError, ValueError: a body missing ``choices`` fields, or arrays whose
            sizes do not match K and the token counts.
        """
        # pdm_jax.rollout imports JAX (heavy); imported here so that importing wire (the server's
        # parse_args / --help path) stays JAX-free.
        from pdm_jax.rollout import RolloutBatch

        choices = sorted(body[CHOICES], key=lambda c: c[INDEX])
        n_rows, k = len(choices), int(top_k_logprobs)
        toks = [np.asarray(c[TOKEN_IDS], np.int32).reshape(-1) for c in choices]
        t_out = max(1, max(len(x) for x in toks))
        p_out = max(len(p) for p in prompts)
        out = dict(
            prompt_ids=np.zeros((n_rows, p_out), np.int32), prompt_mask=np.zeros((n_rows, p_out), bool),
            completion_ids=np.zeros((n_rows, t_out), np.int32), completion_mask=np.zeros((n_rows, t_out), bool),
            behavior_logprobs=np.zeros((n_rows, t_out), np.float32), topk_ids=np.zeros((n_rows, t_out, k), np.int32),
            topk_logprobs=np.zeros((n_rows, t_out, k), np.float32))
        versions, groups, reasons = [], [], []
        for r, c in enumerate(choices):
            i, t = int(c[PROMPT_INDEX]), len(toks[r])
            pr = prompts[i]
            out["prompt_ids"][r, p_out - len(pr):] = pr
            out["prompt_mask"][r, p_out - len(pr):] = True
            out["completion_ids"][r, :t] = toks[r]
            out["completion_mask"][r, :t] = True
            out["behavior_logprobs"][r, :t] = float_list(c[LOGPROBS]).reshape(-1)
            if k and t:
                out["topk_ids"][r, :t] = np.asarray(c[TOP_LOGPROBS][IDS], np.int32).reshape(t, k)
                out["topk_logprobs"][r, :t] = float_list(c[TOP_LOGPROBS][LOGPROBS]).reshape(t, k)
            versions.append(int(c.get(WEIGHTS_VERSION, body[WEIGHTS_VERSION])))
            groups.append(i)
            reasons.append(c[FINISH_REASON])
        batch = RolloutBatch(**out, weights_version=np.array(versions, np.int32),
                             group_ids=np.array(groups, np.int32), finish_reason=np.array(reasons, dtype=object))
        usage = body.get(USAGE) or {}
        return cls(batch=batch, model=body.get(MODEL, ""),
                   prompt_tokens=int(usage.get(PROMPT_TOKENS, sum(len(p) for p in prompts))))


def response_to_batch(prompts: Sequence[Sequence[int]], resp: Mapping, *, top_k_logprobs: int) -> "RolloutBatch":
    """The RolloutBatch of a /v1/generate response body (`GenerateResponse.from_wire(...).batch`)."""
    return GenerateResponse.from_wire(resp, prompts, top_k_logprobs=top_k_logprobs).batch


# ============================================================================= weights and health
@dataclasses.dataclass(frozen=True)
class LoadWeightsRequest:
    """A ``POST /v1/weights`` request: load the `save_weights` directory `path` as `version`."""

    path: Any
    version: Any

    @classmethod
    def from_wire(cls, body: Mapping) -> "LoadWeightsRequest":
        """Decodes and checks a request body.

        Raises:
          RequestError: ``path`` not a non-empty string, or ``version`` not an integer >= 0.
        """
        path, version = body.get(PATH), body.get(VERSION)
        if not isinstance(path, str) or not path:
            raise RequestError(PATH, f"must be a non-empty string, got {path!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise RequestError(VERSION, f"must be an integer >= 0, got {version!r}")
        return cls(path=path, version=version)

    def to_wire(self) -> dict:
        """The request body."""
        return {PATH: self.path, VERSION: self.version}


def weights_loaded(*, version: int, path: str, seconds: float, reloaded: bool) -> dict:
    """What a weights load reports (`SamplingEngine.load_weights`): ``{"version", "path", "seconds", "reloaded"}``."""
    return {VERSION: version, PATH: path, "seconds": seconds, "reloaded": reloaded}


def weights_response(info: Mapping) -> dict:
    """The ``POST /v1/weights`` response body: ``{"status": "ok", **info}``."""
    return {STATUS: OK, **info}


def health_body(*, model: str, quantization: str, version: int, compute_dtype: str, vocab_size: int,
                max_prompt_length: int, max_new_tokens: int, weights_path: Optional[str]) -> dict:
    """An engine's ``/health`` fields (`SamplingEngine.health`), status "ok"."""
    return {STATUS: OK, MODEL: model, "quantization": quantization, VERSION: version,
            "compute_dtype": compute_dtype, "vocab_size": vocab_size, "max_prompt_length": max_prompt_length,
            MAX_NEW_TOKENS: max_new_tokens, "weights_path": weights_path}


def health_with_stats(health: Mapping, *, requests: int, generated_tokens: int, uptime_s: float) -> dict:
    """The server's ``/health`` body: the engine's fields plus its request counters and uptime."""
    return {**health, "requests": requests, "generated_tokens": generated_tokens, "uptime_s": uptime_s}
