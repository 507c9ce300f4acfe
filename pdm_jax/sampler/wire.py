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
     "logprobs": K, "seed": int | null, "first_prompt_index": int (optional, default 0)}
    ("model" is accepted and ignored; "stream": true is refused; ``first_prompt_index`` f: prompt i
    of the request is prompt f + i of a larger batch, whose index keys its samples' random draws, so
    a process sampling its share of an RL step's prompts gets the tokens the whole batch would)

    ``"return_routing": true`` (optional; MoE models only, else 422 naming it) asks for each
    choice's ``"routed_experts"`` (routing replay).

Response::

    {"object": "text_completion", "model": str, "weights_version": int,
     "choices": [{"index": r, "prompt_index": i, "token_ids": [T_r ints],
                  "logprobs": [T_r floats]                      (log mu of the sampled ids),
                  "top_logprobs": {"ids": [T_r x K ints], "logprobs": [T_r x K floats]},
                  "finish_reason": "stop" | "length", "weights_version": int,
                  "routed_experts": [P_i + T_r x L x k ints]    (only with return_routing: the
                      experts each layer ran for prompt i's P_i tokens and the choice's T_r tokens,
                      -1 on its last token, which the sampler never fed)}, ...],
     "usage": {"prompt_tokens": int, "completion_tokens": int}}
    (prompt_tokens counts each prompt once, as vLLM does, whatever n is)

``POST /v1/weights``: request ``{"path": str, "version": int}``, response
``{"status": "ok", "version", "path", "seconds", "reloaded"}``.

``GET /health``: ``{"status", "model", "quantization", "version", "compute_dtype",
"vocab_size", "max_prompt_length", "max_new_tokens", "weights_path", "loading"}`` (the
engine's `health_body`), plus ``requests``, ``generated_tokens``, ``uptime_s``
from the server.

Errors (any status >= 400): ``{"error": {"message": str, "field": str | null, "type": str}}``.

In msgpack bodies every numeric array is an ``{"__nd__": 1, "dtype", "shape",
"data": bytes}`` map (little-endian), so top-K tables travel as raw f32/int32.
In JSON bodies arrays are nested lists, and non-finite log-probabilities
(-inf: ids removed by top-k/top-p filtering) are written as ``null``.

Decoding (`loads`) trusts nothing: at most `MAX_DEPTH` levels of lists/maps
(checked without Python recursion), string map keys only, valid UTF-8, no
msgpack extension types, no JSON NaN/Infinity, and packed arrays whose header
is exactly the four fields with a known dtype, a shape of at most `MAX_NDIM`
non-negative ints, bytes of the matching size (empty arrays: at most
`MAX_EMPTY_ARRAY_ITEMS` rows).  Anything else is a `ValueError` naming the
location (``$.prompt.shape``), which the server answers with 400.  Field values
are then checked by type and range (`GenerateRequest.from_wire`,
`validate_request`, `LoadWeightsRequest.from_wire`; 422 naming the field):
bools are never numbers, integers travelling as int32 are bounded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import string
import time
from typing import Any, Mapping, Optional, Sequence

import msgpack as _msgpack  # aliased: `dumps`/`loads`/`to_plain` take a keyword named msgpack
import numpy as np

from pdm_jax.rollout import FINISH_REASONS, RolloutBatch, build_batch, right_pad_rows  # numpy only: wire stays JAX-free

# ----------------------------------------------------------------------------- content types
JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
ND_KEY = "__nd__"
_DTYPES = {"float32": "<f4", "int32": "<i4", "int8": "|i1", "int16": "<i2", "bool": "|b1", "float64": "<f8", "int64": "<i8"}
ND_FIELDS = frozenset({ND_KEY, "dtype", "shape", "data"})
_DTYPE_NAMES = {np.dtype(name): name for name in _DTYPES}  # numpy dtype -> wire name (str(dtype) is slow)
_WIRE_DTYPES = {name: np.dtype(code) for name, code in _DTYPES.items()}
MAX_DEPTH = 32  # most nesting levels of lists/maps in a body (requests need 3, responses 6)
MAX_NDIM = 32  # most dimensions of a packed array
MAX_EMPTY_ARRAY_ITEMS = 1 << 16  # an empty packed array's non-zero dimensions may multiply to at most this

# ----------------------------------------------------------------------------- field names
# POST /v1/generate request
PROMPT = "prompt"
N = "n"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
MAX_TOKENS = "max_tokens"  # Python: max_new_tokens
STOP_TOKEN_IDS = "stop_token_ids"
#: Stop ids a request may carry (the engine's default per-row stop table, ``SamplingEngine(max_stop_tokens=)``).
MAX_STOP_TOKEN_IDS = 8
LOGPROBS = "logprobs"  # Python: top_k_logprobs (also the per-choice sampled log mu in the response)
SEED = "seed"
RETURN_ROUTING = "return_routing"  # Python: return_routing (MoE routing replay)
ROUTED_EXPERTS = "routed_experts"  # per choice: [P_i + T_r, L, k] int, RolloutBatch.routed_experts
FIRST_PROMPT_INDEX = "first_prompt_index"  # per-host rollouts: the request's prompts start at this index
MODEL = "model"  # accepted and ignored in a request; the model's name in responses and /health
STREAM = "stream"  # only false/absent is accepted
#: How the response carries the rows: "choices" (default: one object per row, as vLLM) or "columns" (one packed
#: array per field for all rows, `COLUMNS`: what `SamplerClient` asks for, no per-row objects to build or check).
RESPONSE_FORMAT = "response_format"
RESPONSE_FORMATS = ("choices", "columns")
GENERATE_FIELDS = frozenset({PROMPT, N, TEMPERATURE, TOP_P, TOP_K, MAX_TOKENS, STOP_TOKEN_IDS, LOGPROBS, SEED,
                             FIRST_PROMPT_INDEX, RETURN_ROUTING, MODEL, STREAM, RESPONSE_FORMAT})
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
COLUMNS = "columns"  # response_format "columns": {token_ids [sum T_r], lengths [N], logprobs [sum T_r], top_logprobs
LENGTHS = "lengths"  # {ids, logprobs} [sum T_r, K] or [0, 0] for K = 0 (each row's T_r tokens, row after row;
#                      padded [N,T(,K)] read too), prompt_index [N], finish_reason [N] strings, weights_version [N]
#                      (, routed_experts [N,P+T,L,k])}
USAGE = "usage"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"

# POST /v1/weights request and response; GET /health
PATH = "path"
VERSION = "version"
STATUS = "status"
OK = "ok"
MAX_NEW_TOKENS = "max_new_tokens"  # /health: the server's max_tokens limit
COMPILE_STATS = "compile_stats"  # /v1/weights response: the server process's XLA compile counts so far

# error bodies
ERROR = "error"
MESSAGE = "message"
FIELD = "field"
TYPE = "type"

# ----------------------------------------------------------------------------- limits used by validation
MIN_TEMPERATURE = 1e-3  # smallest positive sampling temperature (z / tau must stay finite in f32)
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1  # largest top_k and weights version (both travel as int32)
MAX_PATH_LENGTH = 4096  # longest accepted /v1/weights path (PATH_MAX on Linux)


# ============================================================================= errors
class RequestError(ValueError):
    """An invalid generation or weights request; ``field`` is the offending field's *wire* name.

    ``str(e)`` is ``"<field>: <message>"`` (a field name over 100 characters -- an
    unknown field sent by a client -- is cut there).  The server answers it with HTTP 422.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field if len(field) <= 100 else field[:97] + '...'}: {message}")
        self.field = field


class BodyError(ValueError):
    """A request body that cannot be decoded; ``status`` is 400 (malformed) or 415 (content type).

    ``field`` is the top-level field the problem lies in (e.g. ``"prompt"`` for a
    bad packed array at ``$.prompt``), None when it concerns the body as a whole.
    """

    def __init__(self, status: int, message: str, kind: str, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.field = status, kind, field


class BodyStructureError(ValueError):
    """A parsed body whose structure is refused (see `check_tree`).

    Attributes:
      path: the location as a tuple of keys and list indices (``()`` = the body).
      field: ``path[0]`` when it is a map key (the top-level field), else None.
    """

    def __init__(self, message: str, path: tuple = ()):
        super().__init__(message)
        self.path = tuple(path)
        self.field = self.path[0] if self.path and isinstance(self.path[0], str) else None


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
    name = _DTYPE_NAMES.get(a.dtype)
    if name is None:
        raise ValueError(f"cannot encode array dtype {a.dtype}")
    # tobytes() writes C order whatever the strides; astype copies only for a byte-order change
    return {ND_KEY: 1, "dtype": name, "shape": list(a.shape), "data": a.astype(_WIRE_DTYPES[name], copy=False).tobytes()}


#: The characters of a bearer token (RFC 6750 ``b64token``), which an ``Authorization`` header carries as is.
TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~+/=")


def token_problem(token: str) -> Optional[str]:
    """Why ``token`` cannot serve as a shared bearer token, or None when it can.

    A token with a space, a control or a non-ASCII character would be accepted by a server at start-up
    and then match no client's ``Authorization: Bearer <token>`` header (HTTP strips the spaces, and
    clients encode headers as Latin-1 or refuse): every request would get 401. The message never
    repeats the token itself.
    """
    if not isinstance(token, str) or not token:
        return "must be a non-empty string"
    bad = sorted({c for c in token if c not in TOKEN_CHARS})
    if bad:
        return (f"holds {len(bad)} character(s) outside RFC 6750's token set (ASCII letters, digits and -._~+/=), "
                f"e.g. {ascii(bad[0])}: no client could send it, every request would be refused")
    return None


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to `limit` characters (error messages must stay short whatever was sent)."""
    try:
        text = repr(value)
    except RecursionError:  # a structure nested too deeply to print
        text = f"<{type(value).__name__} nested too deeply to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _kind(value: Any) -> str:
    """A value and its type for messages: ``"2.5 (float)"``."""
    return f"{_show(value)} ({type(value).__name__})"


def _where(path: tuple) -> str:
    """A location in a body as ``$.prompt[0]`` (``$`` is the body itself)."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def decode_array(d: Mapping, where: str | tuple = "$") -> np.ndarray:
    """Inverse of `encode_array`: a ``{"__nd__": 1, "dtype", "shape", "data"}`` map -> numpy array.

    Args:
      d: the map as msgpack decoded it.
      where: its location in the body, for messages: ``"$.prompt"``, or the path tuple
        (``("prompt",)``), formatted only when a message needs it (`check_tree` decodes
        every packed array of a body, most of them valid).
    Returns:
      the array, shape ``shape``, dtype ``dtype`` (native byte order).
    Raises:
      ValueError: naming `where` and the field: other keys than the four, ``__nd__``
        not the integer 1, ``dtype`` not one of float32/64, int32/64, bool, ``shape``
        not a list of at most `MAX_NDIM` integers >= 0, ``data`` not bytes or of a
        size that does not match the shape, or an empty array whose non-zero
        dimensions multiply to more than `MAX_EMPTY_ARRAY_ITEMS` (its list form
        would be a memory bomb).
    """
    if len(d) != len(ND_FIELDS) or not ND_FIELDS.issuperset(d):
        return _decode_array_checked(d, where if isinstance(where, str) else _where(where))
    name, shape, data = d["dtype"], d["shape"], d["data"]
    if (type(d[ND_KEY]) is int and d[ND_KEY] == 1 and type(name) is str and name in _DTYPES
            and type(shape) is list and len(shape) <= MAX_NDIM and all(type(s) is int and s >= 0 for s in shape)
            and type(data) is bytes):
        items = math.prod(shape)
        if len(data) == items * _WIRE_DTYPES[name].itemsize and items:
            return np.frombuffer(data, dtype=_WIRE_DTYPES[name]).reshape(shape).astype(name)
    return _decode_array_checked(d, where if isinstance(where, str) else _where(where))


def _decode_array_checked(d: Mapping, where: str) -> np.ndarray:
    """`decode_array` with every check in order, each failing with its message (the slow path: errors, empty arrays)."""
    extra = sorted(str(k) for k in d if k not in ND_FIELDS)
    if extra:
        raise ValueError(f"{where}: packed array has unknown field(s) {_show(extra)}; expected {sorted(ND_FIELDS)}")
    if type(d.get(ND_KEY)) is not int or d[ND_KEY] != 1:
        raise ValueError(f"{where}.{ND_KEY}: must be the integer 1, got {_kind(d.get(ND_KEY))}")
    for field in ND_FIELDS:
        if field not in d:
            raise ValueError(f"{where}.{field}: missing from a packed array")
    name, shape, data = d["dtype"], d["shape"], d["data"]
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"{where}.dtype: must be one of {sorted(_DTYPES)}, got {_kind(name)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM \
            or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{where}.shape: must be a list of at most {MAX_NDIM} integers >= 0, got {_kind(shape)}")
    if not isinstance(data, bytes):
        raise ValueError(f"{where}.data: must be bytes (msgpack bin), got {type(data).__name__}")
    itemsize = np.dtype(_DTYPES[name]).itemsize
    items = math.prod(shape)
    if len(data) != items * itemsize:
        raise ValueError(f"{where}.data: {len(data)} bytes, but shape {shape} of {name} needs {items * itemsize}")
    if items == 0 and math.prod(max(s, 1) for s in shape) > MAX_EMPTY_ARRAY_ITEMS:
        raise ValueError(f"{where}.shape: empty array of shape {_show(shape)} has more than "
                         f"{MAX_EMPTY_ARRAY_ITEMS} rows")
    return np.frombuffer(data, dtype=_DTYPES[name]).reshape(shape).astype(name)


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


def _check_leaf(value: Any, path: tuple) -> None:
    """A scalar of a decoded body: None, bool, int, float, str (valid UTF-8) or bytes; BodyStructureError otherwise."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyStructureError(f"{_where(path)}: string {_show(value)} is not valid UTF-8 (lone surrogate)",
                                     path) from None
    elif value is not None and not isinstance(value, (bool, int, float, bytes)):
        raise BodyStructureError(f"{_where(path)}: unsupported value {_kind(value)} (msgpack extension types are "
                                 f"refused)", path)


def check_tree(obj: Any, *, decode_arrays: bool, max_depth: int = MAX_DEPTH) -> Any:
    """Checks a freshly decoded body and (msgpack) replaces packed-array maps by numpy arrays.

    Walks the structure iteratively (no Python recursion, whatever the nesting),
    in place.  Packed arrays (maps holding ``"__nd__"``) are decoded by
    `decode_array` when `decode_arrays`, else left as maps.

    Args:
      obj: what ``json.loads`` / ``msgpack.unpackb`` returned.
      decode_arrays: True for msgpack bodies.
      max_depth: most levels of lists/maps (the body itself is level 1).
    Returns:
      `obj` with packed arrays decoded (the root itself may be one).
    Raises:
      BodyStructureError: naming the location (``$.prompt[0]``): nesting deeper
        than `max_depth`, a map key that is not a string, a string that is not
        valid UTF-8, a msgpack extension value, or a malformed packed array.
    """
    def visit(value, path, depth):
        """The value to store (a decoded array or the value); queues containers."""
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise BodyStructureError(f"{_where(path)}: nested deeper than {max_depth} levels", path)
            if isinstance(value, dict) and decode_arrays and ND_KEY in value:
                try:
                    return decode_array(value, path)
                except ValueError as e:
                    raise BodyStructureError(str(e), path) from None
            stack.append((value, path, depth))
        else:
            _check_leaf(value, path)
        return value

    stack = []
    root = visit(obj, (), 1)
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, str):
                    raise BodyStructureError(f"{_where(path)}: map key {_kind(key)} is not a string", path)
                _check_leaf(key, path)  # a bad key is reported at its map
            for key, value in node.items():
                if isinstance(value, (dict, list)):
                    node[key] = visit(value, path + (key,), depth + 1)
                else:
                    _check_leaf(value, path + (key,))
        else:
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    node[i] = visit(value, path + (i,), depth + 1)
                elif not (type(value) is int or type(value) is float):  # the bulk: token ids, log-probs
                    _check_leaf(value, path + (i,))
    return root


def from_plain(obj: Any) -> Any:
    """Decodes packed arrays (msgpack) in a body; raises BodyStructureError for malformed ones (see `check_tree`)."""
    return check_tree(obj, decode_arrays=True)


def dumps(obj: Any, *, msgpack: bool) -> bytes:
    """Serialises a response/request body (JSON is strict: no NaN/Infinity tokens)."""
    if msgpack:  # msgpack walks the tree in C and calls back only for numpy values (as `to_plain` packs them)
        return _msgpack.packb(obj, use_bin_type=True, default=_msgpack_default)
    return json.dumps(to_plain(obj, msgpack=False), allow_nan=False, separators=(",", ":")).encode()


def _msgpack_default(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: numpy arrays (packed) and numpy scalars (Python values)."""
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _refuse_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name} (JSON bodies are strict: no NaN/Infinity)")


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (`loads` with ``unique_keys``); the message names the key."""


def _unique_keys(pairs: list) -> dict:
    """``json``'s object_pairs_hook: the object as a dict; DuplicateKeyError if a key appears twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKeyError(f"malformed JSON body: an object names the key {_show(key, 100)} twice")
    return out


def loads(body: bytes, *, msgpack: bool, unique_keys: bool = False) -> Any:
    """Parses a body and checks its structure (`check_tree`: depth, key types, packed arrays).

    ``unique_keys`` (JSON): an object naming a key twice raises `DuplicateKeyError` instead of keeping its last
    value (Python's json, like most parsers, keeps the last one silently).

    Raises:
      ValueError: malformed JSON or msgpack, the message says which, why and
        where (e.g. ``"malformed msgpack body: $.prompt.shape: ..."``); a
        `BodyStructureError` (with ``.path`` / ``.field``) when the bytes parse
        but the structure is refused.
    """
    what = "msgpack" if msgpack else "JSON"
    try:
        if msgpack:
            obj = _msgpack.unpackb(body, raw=False, strict_map_key=True)
        else:
            obj = json.loads(body, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys if unique_keys
                             else None)
    except DuplicateKeyError:
        raise
    except (RecursionError, _msgpack.StackError):
        raise ValueError(f"malformed {what} body: nested deeper than {MAX_DEPTH} levels") from None
    except Exception as e:  # json/msgpack raise several types (ValueError, UnicodeDecodeError, TypeError...)
        raise ValueError(f"malformed {what} body: {type(e).__name__}: {e}") from e
    try:
        return check_tree(obj, decode_arrays=msgpack)
    except BodyStructureError as e:
        raise BodyStructureError(f"malformed {what} body: {e}", e.path) from e


def decode_body(body: bytes, content_type: Optional[str]) -> dict:
    """A request body (JSON or msgpack by `content_type`, JSON when absent) as a dict.

    Raises:
      BodyError: status 415 for a content type that is neither JSON nor msgpack,
        400 (kind "malformed_body") for unparsable bytes, a structure `loads`
        refuses (nesting, key types, packed arrays; ``field`` then names the
        top-level field it lies in), or a body that is not a map.
    """
    ctype = JSON if content_type is None else content_type
    if not (is_msgpack(ctype) or "json" in ctype.lower()):
        raise BodyError(415, f"unsupported Content-Type {_show(ctype)}; use {JSON} or {MSGPACK}", "invalid_request")
    try:
        obj = loads(body, msgpack=is_msgpack(ctype))
    except ValueError as e:
        raise BodyError(400, str(e), "malformed_body", getattr(e, "field", None)) from e
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
      return_routing: also return each choice's routed experts (MoE routing replay).
      first_prompt_index: the index of the request's first prompt in a larger batch (keys the
        samples' random draws; 0 = the request is the whole batch).
      response_format: ``"choices"`` (default) or ``"columns"`` (`GenerateResponse.to_wire`).

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
    return_routing: Any = False
    first_prompt_index: Any = 0
    response_format: Any = "choices"

    @classmethod
    def from_wire(cls, body: Mapping) -> "GenerateRequest":
        """Decodes a request body (a dict, numpy arrays allowed where msgpack packed them).

        Raises:
          RequestError: an unknown field (named), ``stream`` not false/null/absent,
            ``model`` not a string, no ``prompt``, a ``stop_token_ids`` that is
            not a list, or a ``response_format`` other than "choices" / "columns".
        """
        unknown = sorted(set(body) - GENERATE_FIELDS)
        if unknown:
            raise RequestError(unknown[0], f"unknown field(s) {_show(unknown)}")
        stream = body.get(STREAM)
        if stream is True:
            raise RequestError(STREAM, "streaming is not supported")
        if stream is not None and stream is not False:
            raise RequestError(STREAM, f"must be false or null, got {_kind(stream)}")
        if body.get(MODEL) is not None and not isinstance(body[MODEL], str):
            raise RequestError(MODEL, f"must be a string (it is ignored), got {_kind(body[MODEL])}")
        if PROMPT not in body:
            raise RequestError(PROMPT, f"missing required field {PROMPT!r}")
        stops = body.get(STOP_TOKEN_IDS)
        if isinstance(stops, np.ndarray) and stops.ndim == 1:
            stops = stops.tolist()
        if stops is None:
            stops = []
        if not isinstance(stops, list):
            raise RequestError(STOP_TOKEN_IDS, f"must be a list of token ids, got {_kind(stops)}")
        top_k, logprobs = body.get(TOP_K, 0), body.get(LOGPROBS)
        layout = body.get(RESPONSE_FORMAT, RESPONSE_FORMATS[0])
        if not isinstance(layout, str) or layout not in RESPONSE_FORMATS:
            raise RequestError(RESPONSE_FORMAT, f"must be one of {RESPONSE_FORMATS}, got {_kind(layout)}")
        return cls(prompts=_normalise_prompts(body[PROMPT]), n=body.get(N, 1),
                   temperature=body.get(TEMPERATURE, 1.0), max_new_tokens=body.get(MAX_TOKENS, DEFAULT_MAX_TOKENS),
                   top_k_logprobs=0 if logprobs is None else logprobs, stop_token_ids=stops, seed=body.get(SEED),
                   top_p=body.get(TOP_P, 1.0), top_k=0 if _is_int(top_k) and top_k == -1 else top_k, return_routing=body.get(RETURN_ROUTING, False),
                   first_prompt_index=body.get(FIRST_PROMPT_INDEX, 0), response_format=layout)

    def to_wire(self) -> dict:
        """The request body (a dict for `dumps`); prompts and stop ids as lists; ``first_prompt_index``
        only when it is not 0 (the body of a whole-batch request is unchanged)."""
        body = {PROMPT: [list(p) for p in self.prompts], N: self.n, TEMPERATURE: self.temperature,
                TOP_P: self.top_p, TOP_K: self.top_k, LOGPROBS: self.top_k_logprobs,
                STOP_TOKEN_IDS: list(self.stop_token_ids), SEED: self.seed, MAX_TOKENS: self.max_new_tokens}
        if self.return_routing is not False:  # only when asked: other requests' bodies are unchanged
            body[RETURN_ROUTING] = self.return_routing
        if self.first_prompt_index != 0:
            body[FIRST_PROMPT_INDEX] = self.first_prompt_index
        if self.response_format != RESPONSE_FORMATS[0]:
            body[RESPONSE_FORMAT] = self.response_format
        return body

    def engine_kwargs(self) -> dict:
        """The keyword arguments of `SamplingEngine.generate` / `.validate` (everything but the prompts;
        ``first_prompt_index`` only when it is not 0)."""
        offset = {} if self.first_prompt_index == 0 else dict(first_prompt_index=self.first_prompt_index)
        return dict(n=self.n, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                    top_k_logprobs=self.top_k_logprobs, stop_token_ids=self.stop_token_ids, seed=self.seed,
                    top_p=self.top_p, top_k=self.top_k, **offset,
                    **({} if self.return_routing is False else dict(return_routing=self.return_routing)))

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts, each prompt counted once (the response's ``usage.prompt_tokens``)."""
        return sum(len(p) for p in self.prompts)


def _normalise_prompts(prompts):
    """Packed arrays -> lists; a flat list of scalars -> one prompt (as vLLM accepts a single prompt).

    A list none of whose items is a list (or array) is one prompt, whatever the
    items are, so that a float or bool among the ids is reported as such by
    `validate_request` (not as "prompt[0] must be a list").
    """
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, list):
        prompts = [p.tolist() if isinstance(p, np.ndarray) else p for p in prompts]
        if prompts and not any(isinstance(p, (list, tuple)) for p in prompts):
            prompts = [prompts]
    return prompts


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _real(x) -> Optional[float]:
    """`x` as a float when it is a real number (int or float, not bool), else None (also for ints beyond float)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def _validate_prompts(prompts, *, vocab_size: int, max_prompt_length: int) -> list:
    """The prompts as a list of int lists; RequestError("prompt", ...) otherwise."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise RequestError(PROMPT, f"must be a list of token-id lists, got {_kind(prompts)}")
    if len(prompts) == 0:
        raise RequestError(PROMPT, "is empty; need at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise RequestError(PROMPT, f"prompt[{i}] must be a list of token ids, got {_kind(p)}")
        p = list(p)
        if len(p) == 0:
            raise RequestError(PROMPT, f"prompt[{i}] is empty")
        if len(p) > max_prompt_length:
            raise RequestError(PROMPT, f"prompt[{i}] has {len(p)} tokens, longer than the context limit "
                               f"max_prompt_length={max_prompt_length}")
        for j, t in enumerate(p):
            if not _is_int(t):
                raise RequestError(PROMPT, f"prompt[{i}][{j}] is {_kind(t)}; token ids must be integers")
            if not 0 <= int(t) < vocab_size:
                raise RequestError(PROMPT, f"prompt[{i}] holds token id {int(t)} outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def validate_request(prompts, *, n, temperature, max_new_tokens, top_k_logprobs, stop_token_ids, seed,
                     top_p, top_k, vocab_size: int, max_prompt_length: int, max_new_tokens_limit: int,
                     max_stop_tokens: int, max_sequences: int = 4096, first_prompt_index=0,
                     return_routing=False) -> list:
    """Checks a generation request (Python argument names); returns the prompts as a list of int lists.

    Raises:
      RequestError: naming the field by its wire name, for an empty prompt list or
        prompt, a prompt longer than `max_prompt_length`, a token id that is not
        an integer (a float or bool is named as such) or outside [0, vocab_size)
        (``prompt``), n <= 0, len(prompts) * n > max_sequences (``n``), temperature
        not a number (bools are not numbers here), < 0, non-finite or in
        (0, MIN_TEMPERATURE) (``temperature``), top_p not a number or outside
        (0, 1] (``top_p``), top_k outside [0, 2**31) (``top_k``),
        max_new_tokens outside [1, max_new_tokens_limit] (``max_tokens``),
        top_k_logprobs outside [0, vocab_size] (``logprobs``), more than
        `max_stop_tokens` stop ids or ids outside the vocabulary
        (``stop_token_ids``), a seed outside [0, 2**63) (``seed``), return_routing not a
        bool (``return_routing``), a first prompt index
        that is not an integer >= 0 or puts the last prompt's index at 2**32 or more
        (``first_prompt_index``: the engine keys draws by a uint32 prompt index).
    """
    out = _validate_prompts(prompts, vocab_size=vocab_size, max_prompt_length=max_prompt_length)
    if not isinstance(return_routing, (bool, np.bool_)):
        raise RequestError(RETURN_ROUTING, f"must be true or false, got {_kind(return_routing)}")
    if not _is_int(n) or n <= 0:
        raise RequestError(N, f"must be an integer >= 1, got {_kind(n)}")
    if len(out) * int(n) > max_sequences:
        raise RequestError(N, f"{len(out)} prompts x n={_show(n, 24)} sequences exceeds the limit "
                           f"of {max_sequences} per request")
    tau = _real(temperature)
    if tau is None or not math.isfinite(tau) or tau < 0:
        raise RequestError(TEMPERATURE, f"must be a finite number >= 0, got {_kind(temperature)}")
    if 0 < tau < MIN_TEMPERATURE:
        raise RequestError(TEMPERATURE, f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (logits / temperature "
                                        f"overflows float32 below that), got {temperature!r}")
    p = _real(top_p)
    if p is None:
        raise RequestError(TOP_P, f"must be a number in (0, 1], got {_kind(top_p)}")
    if not 0.0 < p <= 1.0:
        raise RequestError(TOP_P, f"must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or not 0 <= top_k <= MAX_INT32:
        raise RequestError(TOP_K, f"must be an integer in [0, 2**31) (0 = off), got {_kind(top_k)}")
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens <= max_new_tokens_limit:
        raise RequestError(MAX_TOKENS, f"must be an integer in [1, {max_new_tokens_limit}], got {_kind(max_new_tokens)}")
    if not _is_int(top_k_logprobs) or not 0 <= top_k_logprobs <= vocab_size:
        raise RequestError(LOGPROBS, f"K must be an integer in [0, vocab_size={vocab_size}], "
                                     f"got {_kind(top_k_logprobs)}")
    stops = list(stop_token_ids or ())
    if len(stops) > max_stop_tokens:
        raise RequestError(STOP_TOKEN_IDS, f"at most {max_stop_tokens} stop ids, got {len(stops)}")
    for s in stops:
        if not _is_int(s) or not 0 <= int(s) < vocab_size:
            raise RequestError(STOP_TOKEN_IDS, f"id {_kind(s)} is not a token id in [0, {vocab_size})")
    if seed is not None and (not _is_int(seed) or not 0 <= int(seed) <= MAX_SEED):
        raise RequestError(SEED, f"must be an integer in [0, 2**63), got {_kind(seed)}")
    if not _is_int(first_prompt_index) or not 0 <= first_prompt_index <= 2 ** 32 - len(out):
        raise RequestError(FIRST_PROMPT_INDEX, f"must be an integer in [0, 2**32 - {len(out)} prompts], "
                                               f"got {_kind(first_prompt_index)}")
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

    def to_wire(self, response_format: str = "choices") -> dict:
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
          RequestError: an unknown field, ``path`` not a non-empty string of at most
            `MAX_PATH_LENGTH` characters without NUL, or ``version`` not an integer
            in [0, 2**31).
        """
        unknown = sorted(set(body) - {PATH, VERSION})
        if unknown:
            raise RequestError(unknown[0], f"unknown field(s) {_show(unknown)}")
        path, version = body.get(PATH), body.get(VERSION)
        if not isinstance(path, str) or not path:
            raise RequestError(PATH, f"must be a non-empty string, got {_kind(path)}")
        if len(path) > MAX_PATH_LENGTH or "\x00" in path:
            raise RequestError(PATH, f"must be at most {MAX_PATH_LENGTH} characters without NUL bytes, "
                                     f"got {_show(path)}")
        if not _is_int(version) or not 0 <= version <= MAX_INT32:
            raise RequestError(VERSION, f"must be an integer in [0, 2**31), got {_kind(version)}")
        return cls(path=path, version=version)

    def to_wire(self) -> dict:
        """The request body."""
        return {PATH: self.path, VERSION: self.version}


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


def health_body(*, model: str, quantization: str, version: int, compute_dtype: str, vocab_size: int,
                max_prompt_length: int, max_new_tokens: int, weights_path: Optional[str],
                loading: Optional[Mapping] = None, weight_noise: float = 0.0, weight_noise_seed: int = 0) -> dict:
    """An engine's ``/health`` fields (`SamplingEngine.health`), status "ok".

    ``weight_noise`` / ``weight_noise_seed`` are the relative std and the seed of the copy's fixed perturbation
    (``--weight_noise``, 0 = none; ``--weight_noise_seed``).

    ``loading`` is null, or ``{"version", "seconds"}`` while a weights load reads its files (a load stuck on a
    slow mount shows here, while generation goes on with the current version).
    """
    busy = None if loading is None else {VERSION: int(loading["version"]),
                                          "seconds": round(time.monotonic() - float(loading["since"]), 3)}
    return {STATUS: OK, MODEL: model, "quantization": quantization, "weight_noise": weight_noise,
            "weight_noise_seed": weight_noise_seed, VERSION: version,
            "compute_dtype": compute_dtype, "vocab_size": vocab_size, "max_prompt_length": max_prompt_length,
            MAX_NEW_TOKENS: max_new_tokens, "weights_path": weights_path, "loading": busy}


def health_with_stats(health: Mapping, *, requests: int, generated_tokens: int, uptime_s: float) -> dict:
    """The server's ``/health`` body: the engine's fields plus its request counters and uptime."""
    return {**health, "requests": requests, "generated_tokens": generated_tokens, "uptime_s": uptime_s}
