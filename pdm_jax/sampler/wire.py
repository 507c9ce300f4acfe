"""Wire format shared by the sampler server and client: JSON or msgpack, never pickle.

Request (``POST /v1/generate``, shaped after vLLM's completions API with token ids)::

    {"prompt": [[int, ...], ...] | [int, ...], "n": 1, "temperature": 1.0, "top_p": 1.0,
     "top_k": 0 (-1 also means off), "max_tokens": 16, "stop_token_ids": [int, ...],
     "logprobs": K, "seed": int | null}

Response::

    {"object": "text_completion", "model": str, "weights_version": int,
     "choices": [{"index": r, "prompt_index": i, "token_ids": [T_r ints],
                  "logprobs": [T_r floats]                      (log mu of the sampled ids),
                  "top_logprobs": {"ids": [T_r x K ints], "logprobs": [T_r x K floats]},
                  "finish_reason": "stop" | "length", "weights_version": int}, ...],
     "usage": {"prompt_tokens": int, "completion_tokens": int}}
    (prompt_tokens counts each prompt once, as vLLM does, whatever n is)

In msgpack bodies every numeric array is an ``{"__nd__": 1, "dtype", "shape",
"data": bytes}`` map (little-endian), so top-K tables travel as raw f32/int32.
In JSON bodies arrays are nested lists, and non-finite log-probabilities
(-inf: ids removed by top-k/top-p filtering) are written as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
ND_KEY = "__nd__"
_DTYPES = {"float32": "<f4", "int32": "<i4", "bool": "|b1", "float64": "<f8", "int64": "<i8"}


def is_msgpack(content_type: str | None) -> bool:
    """True if a Content-Type / Accept header value names msgpack."""
    if not content_type:
        return False
    return any(t in content_type.lower() for t in MSGPACK_TYPES)


def encode_array(a: np.ndarray) -> dict:
    """A numeric numpy array as a msgpack-friendly map (raw little-endian bytes)."""
    a = np.asarray(a)
    name = str(a.dtype)
    if name not in _DTYPES:
        raise ValueError(f"cannot encode array dtype {name}")
    return {ND_KEY: 1, "dtype": name, "shape": list(a.shape), "data": np.ascontiguousarray(a.astype(_DTYPES[name])).tobytes()}


def decode_array(d: dict) -> np.ndarray:
    """Inverse of `encode_array`; validates dtype and size."""
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
        import msgpack as mp

        return mp.packb(plain, use_bin_type=True)
    return json.dumps(plain, allow_nan=False, separators=(",", ":")).encode()


def loads(body: bytes, *, msgpack: bool) -> Any:
    """Parses a body; raises ValueError with a reason on malformed input."""
    if msgpack:
        import msgpack as mp

        try:
            obj = mp.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several exception types
            raise ValueError(f"malformed msgpack body: {type(e).__name__}: {e}") from e
        return from_plain(obj)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed JSON body: {e}") from e


def float_list(x) -> np.ndarray:
    """A JSON list of floats/None (None = -inf) or a decoded array -> float32 array."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    return np.array([[(-np.inf if v is None else v) for v in r] if isinstance(r, list) else (-np.inf if r is None else r)
                     for r in x], dtype=np.float32)
