"""The sampler's body codecs: JSON and msgpack bodies, numeric arrays as packed little-endian maps, and the
untrusting decoder (`loads`, `check_tree`) that refuses deep nesting, non-string keys, extension types,
non-finite JSON constants and malformed arrays, naming the location (``$.prompt.shape``)."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional

import msgpack as _msgpack  # aliased: `dumps`/`loads`/`to_plain` take a keyword named msgpack
import numpy as np


# ----------------------------------------------------------------------------- content types
JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
ND_KEY = "__nd__"
_DTYPES = {"float32": "<f4", "int32": "<i4", "int8": "|i1", "int16": "<i2", "bool": "|b1", "float64": "<f8",
           "int64": "<i8"}
ND_FIELDS = frozenset({ND_KEY, "dtype", "shape", "data"})
_DTYPE_NAMES = {np.dtype(name): name for name in _DTYPES}  # numpy dtype -> wire name (str(dtype) is slow)
_WIRE_DTYPES = {name: np.dtype(code) for name, code in _DTYPES.items()}
MAX_DEPTH = 32  # most nesting levels of lists/maps in a body (requests need 3, responses 6)
MAX_NDIM = 32  # most dimensions of a packed array
MAX_EMPTY_ARRAY_ITEMS = 1 << 16  # an empty packed array's non-zero dimensions may multiply to at most this


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
    return {ND_KEY: 1, "dtype": name, "shape": list(a.shape), "data": a.astype(_WIRE_DTYPES[name],
                                                                               copy=False).tobytes()}


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
            if obj.ndim == 1:
                return [_finite_or_none(x) for x in obj.tolist()]
            return [to_plain(r, msgpack=False) for r in obj]
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
    return np.array([[(-np.inf if v is None else v) for v in r] if isinstance(r,
                                                                              list) else (-np.inf if r is None else r)
                     for r in x], dtype=np.float32)
