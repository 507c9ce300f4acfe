"""Weight-sync format between the trainer and the sampler.

A weights directory written by `save_weights` holds

* ``params/`` -- the model's ``nnx.Param`` state as a nested *pure dict* of
  arrays, written with orbax's ``StandardCheckpointer`` (we wait until the
  write has finished);
* ``weights_meta.json`` -- ``{"format": "pdm_jax.weights/2", "version": v,
  "num_params": ..., "dtypes": ..., "files": {relative path: {"sha256", "bytes"}},
  "meta_sha256": ...}``, written last (atomically), so its presence marks a
  complete checkpoint.  ``files`` is the integrity manifest: the sha256
  (``hashlib``) and size of every other file of the directory, hashed after
  orbax finished; ``meta_sha256`` is the sha256 of the meta's own other fields
  (canonical JSON), so a changed byte in the meta file is caught as well.

`load_weights` verifies all of it before orbax reads a byte, and refuses
parameters holding NaN or inf: a truncated, extended or bit-flipped file, a
missing file, a damaged meta file or non-finite values each raise a
`WeightsError` naming the version directory and the file (or parameter) --
never a silent load.  Cost: one extra read of the weights at save and at load
(sha256 runs at about 0.5-2 GB/s per core; files are hashed on several threads).

Directories written before the manifest existed (format ``pdm_jax.weights/1``,
no ``files``/``meta_sha256``) are still loaded, *unverified*, with a logged
warning (the non-finite check still applies); re-save them with `save_weights`
to add the manifest.  A ``/2`` meta without the manifest, or a ``/1`` meta with
one, is refused as damaged.

The trainer calls ``save_weights(model, f"{root}/weights/{version}", version=version)``
and then the sampler client's ``load_weights(path, version)``; the sampler
refuses a directory whose recorded version differs from the requested one, so a
stale or half-written directory is an error, never a silent reuse.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3ForCausalLM

META_FILE = "weights_meta.json"
PARAMS_DIR = "params"
FORMAT = "pdm_jax.weights/2"
LEGACY_FORMAT = "pdm_jax.weights/1"  # no integrity manifest: loaded unverified, with a warning
FILES_KEY = "files"
META_HASH_KEY = "meta_sha256"
MAX_VERSION = 2**31 - 1  # versions travel as int32 (RolloutBatch.weights_version)
_HASH_CHUNK = 8 << 20  # bytes read per hashlib update (hashlib releases the GIL on large updates)
log = logging.getLogger("pdm_jax.sampler.weights")


class WeightsError(ValueError):
    """A weights directory is missing, incomplete, damaged, or does not match the request."""


class VersionMismatchError(WeightsError):
    """The directory records another weights version than the one requested."""


class CorruptWeightsError(WeightsError):
    """A file of a weights directory fails its integrity check (or the meta file cannot be read).

    Attributes:
      path: the version directory; file: the offending file, relative to it.
    """

    def __init__(self, path: str, file: str, problem: str):
        super().__init__(f"weights version directory {path!r}: file {file!r} {problem}; the directory is "
                         f"damaged -- re-save it with save_weights (the trainer re-pushes a missing version)")
        self.path, self.file = path, file


def to_pure_dict(model_or_state: Any) -> dict:
    """The ``nnx.Param`` state of a model (or an nnx.State / nested dict) as a nested pure dict."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.to_pure_dict(nnx.state(model_or_state, nnx.Param))
    if isinstance(model_or_state, nnx.State):
        return nnx.to_pure_dict(model_or_state)
    if isinstance(model_or_state, Mapping):
        return jax.tree.map(lambda x: x, dict(model_or_state))
    raise TypeError(f"save_weights: expected an nnx.Module, nnx.State or dict, got {type(model_or_state).__name__}")


def _checkpointer():
    return ocp.StandardCheckpointer()


def _sha256_file(path: str) -> tuple:
    """(hex sha256, size in bytes) of a file, read in `_HASH_CHUNK` pieces."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _data_files(path: str) -> list:
    """Every file under `path` but the meta file (and its temporary), relative, sorted."""
    out = []
    for dirpath, _, files in os.walk(path):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), path)
            if rel not in (META_FILE, META_FILE + ".tmp"):
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _hash_files(path: str, rels: list) -> dict:
    """``{rel: (sha256, bytes) or the OSError}`` for files under `path`, hashed on a few threads."""
    def one(rel):
        try:
            return _sha256_file(os.path.join(path, *rel.split("/")))
        except OSError as e:
            return e
    workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(rels, pool.map(one, rels)))


def _meta_digest(meta: Mapping) -> str:
    """sha256 of the meta's fields other than ``meta_sha256``, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != META_HASH_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_weights(model_or_state: Any, path: str, *, version: Optional[int] = None,
                 extra_meta: Optional[dict] = None) -> str:
    """Writes the model's parameters for the sampler (orbax + JSON meta with a sha256 manifest); returns the abs path.

    Args:
      model_or_state: an ``nnx.Module`` (its ``nnx.Param`` state is saved), an
        ``nnx.State`` or a nested dict of arrays.
      path: target directory; must not exist yet (orbax refuses to overwrite).
      version: integer weights version in [0, 2**31), recorded in ``weights_meta.json``;
        default: the last path component when it is an integer (``.../weights/7`` -> 7).
      extra_meta: optional JSON-serialisable dict merged into the meta file.
    Raises:
      ValueError: negative/non-integer version, or no version given and the
        directory name is not an integer; orbax errors if `path` exists.
    """
    if version is None:
        name = os.path.basename(os.path.normpath(path))
        if not name.isdigit():
            raise ValueError(f"save_weights: no version given and the directory name {name!r} is not an integer")
        version = int(name)
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"save_weights: version must be an integer in [0, 2**31), got {version!r}")
    pure = to_pure_dict(model_or_state)
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    ckpt = _checkpointer()
    ckpt.save(os.path.join(path, PARAMS_DIR), pure)
    ckpt.wait_until_finished()
    leaves = jax.tree.leaves(pure)
    meta = {
        "format": FORMAT,
        "version": int(version),
        "num_params": int(sum(int(np.prod(np.shape(x))) for x in leaves)),
        "dtypes": sorted({str(jnp.asarray(x).dtype) for x in leaves}),
    }
    meta.update(extra_meta or {})
    hashes = _hash_files(path, _data_files(path))
    for got in hashes.values():
        if isinstance(got, OSError):
            raise got
    meta[FILES_KEY] = {rel: {"sha256": h, "bytes": n} for rel, (h, n) in hashes.items()}
    meta[META_HASH_KEY] = _meta_digest(meta)
    tmp = os.path.join(path, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, META_FILE))
    return path


def read_meta(path: str) -> dict:
    """The ``weights_meta.json`` of a weights directory, its own checksum verified.

    Returns:
      the meta dict; ``meta["files"]`` is absent only for a legacy
      (``pdm_jax.weights/1``) directory.
    Raises:
      WeightsError: the directory or its meta file is missing (incomplete write),
        or the format is unknown.
      CorruptWeightsError: the meta file cannot be read or parsed, fails its
        ``meta_sha256``, lacks the manifest its format requires, or records no
        valid version.
    """
    if not os.path.isdir(path):
        raise WeightsError(f"weights path {path!r} does not exist")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise WeightsError(f"weights path {path!r} has no {META_FILE} (incomplete or not written by save_weights)")
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CorruptWeightsError(path, META_FILE, f"cannot be read as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise CorruptWeightsError(path, META_FILE, f"holds a {type(meta).__name__}, not a JSON object")
    has_manifest = FILES_KEY in meta or META_HASH_KEY in meta
    if meta.get("format") == LEGACY_FORMAT and has_manifest:
        raise CorruptWeightsError(path, META_FILE, f"says format {LEGACY_FORMAT!r} but carries a manifest")
    if meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        if has_manifest and meta.get(META_HASH_KEY) != _meta_digest(meta):
            raise CorruptWeightsError(path, META_FILE, "fails its meta_sha256 checksum")
        raise WeightsError(f"weights path {path!r}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["format"] == FORMAT:
        if not isinstance(meta.get(FILES_KEY), dict) or not isinstance(meta.get(META_HASH_KEY), str):
            raise CorruptWeightsError(path, META_FILE, f"lacks its {FILES_KEY!r}/{META_HASH_KEY!r} manifest")
        if meta[META_HASH_KEY] != _meta_digest(meta):
            raise CorruptWeightsError(path, META_FILE, "fails its meta_sha256 checksum")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise CorruptWeightsError(path, META_FILE, f"records no valid version (got {version!r})")
    return meta


def verify_files(path: str, meta: Mapping) -> None:
    """Checks every file of the manifest ``meta["files"]`` (size and sha256) under the directory `path`.

    Raises:
      CorruptWeightsError: naming the first bad file (sorted) and how many are bad:
        a manifest entry that is not a plain relative path, a missing file, a
        size that differs (truncated / extended) or a sha256 that differs
        (changed bytes).
    """
    entries = meta[FILES_KEY]
    bad = []
    for rel, info in entries.items():
        parts = rel.split("/")
        if not rel or rel.startswith("/") or ".." in parts or not isinstance(info, dict):
            raise CorruptWeightsError(path, rel, "is not a valid manifest entry")
    hashes = _hash_files(path, sorted(entries))
    for rel in sorted(entries):
        got, want = hashes[rel], entries[rel]
        if isinstance(got, FileNotFoundError):
            bad.append((rel, "is missing"))
        elif isinstance(got, OSError):
            bad.append((rel, f"cannot be read ({got})"))
        elif got[1] != want.get("bytes"):
            bad.append((rel, f"has {got[1]} bytes, the manifest records {want.get('bytes')} (truncated or extended)"))
        elif got[0] != want.get("sha256"):
            bad.append((rel, "fails its sha256 checksum (its bytes changed)"))
    if bad:
        rel, problem = bad[0]
        more = f" ({len(bad) - 1} more damaged file(s))" if len(bad) > 1 else ""
        raise CorruptWeightsError(path, rel, problem + more)


def abstract_params(config, dtype=jnp.float32) -> dict:
    """Shapes/dtypes (jax.ShapeDtypeStruct) of the Qwen3 parameters for `config`, as a pure dict."""
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


@jax.jit
def _count_nonfinite(arrays: list) -> list:
    """Per array, how many of its values are NaN or inf (int32 scalars)."""
    return [jnp.sum(~jnp.isfinite(x)) for x in arrays]


def _check_finite(path: str, tree: Mapping) -> None:
    """WeightsError naming the first parameter (and the count) holding NaN or inf values."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    floats = [(k, x) for k, x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    on_host = [isinstance(x, np.ndarray) or all(d.platform == "cpu" for d in x.devices()) for _, x in floats]
    # host arrays: numpy (no copy, no compile); accelerator arrays: one jitted reduction (no transfer)
    on_device = [x for (_, x), host in zip(floats, on_host) if not host]
    device_counts = iter(jax.device_get(_count_nonfinite(on_device)) if on_device else [])
    counts = [int(np.count_nonzero(~np.isfinite(np.asarray(x)))) if host else int(next(device_counts))
              for (_, x), host in zip(floats, on_host)]
    bad = [(jax.tree_util.keystr(k), int(c), int(np.prod(x.shape))) for (k, x), c in zip(floats, counts) if c]
    if bad:
        name, n, size = bad[0]
        more = f"; {len(bad) - 1} more parameter(s) too" if len(bad) > 1 else ""
        raise WeightsError(f"weights version directory {path!r}: parameter {name} holds {n} non-finite "
                           f"value(s) (NaN/inf) of {size}{more}; refused")


def load_weights(path: str, config=None, *, version: Optional[int] = None, abstract: Optional[Mapping] = None) -> dict:
    """Restores the parameters written by `save_weights` as a nested pure dict of arrays, verified.

    Order: the meta file (and its own checksum), the version, every file's size
    and sha256 against the manifest, then orbax's restore, the shapes and
    finiteness.  A legacy directory (no manifest, see the module docstring) is
    loaded unverified with a logged warning.

    Args:
      path: the weights directory.
      config: a ``Qwen3Config``; the restore target shapes are the model's
        (shape/dtype mismatches raise).  Either `config` or `abstract` is needed.
      version: if given, must equal the version recorded in the meta file.
      abstract: an explicit target tree of jax.ShapeDtypeStruct (overrides config).
    Returns:
      nested dict of jax arrays with the checkpoint's values.
    Raises:
      WeightsError: missing/incomplete directory, a checkpoint whose tree/shapes
        do not match the model, or parameters holding NaN/inf (naming the parameter).
      VersionMismatchError: the recorded version is not `version`.
      CorruptWeightsError: a damaged file (naming the directory and the file).
    """
    path = os.path.abspath(path)
    meta = read_meta(path)
    if version is not None and int(meta["version"]) != int(version):
        raise VersionMismatchError(f"weights path {path!r} holds version {meta['version']}, "
                                   f"not the requested version {version}")
    if FILES_KEY in meta:
        verify_files(path, meta)
    else:
        log.warning("weights path %r has no integrity manifest (format %s): loading it unverified; re-save it with "
                    "save_weights to add one", path, LEGACY_FORMAT)
    if abstract is None:
        if config is None:
            raise ValueError("load_weights needs a config or an abstract target tree")
        abstract = abstract_params(config)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dict(abstract))
    try:
        restored = _checkpointer().restore(os.path.join(path, PARAMS_DIR), target)
    except Exception as e:  # orbax raises assorted types for tree/shape mismatches
        raise WeightsError(f"weights path {path!r} does not match the model: {type(e).__name__}: {e}") from e
    got = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), restored)
    want = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), target)
    if got != want:
        raise WeightsError(f"weights path {path!r}: restored shapes differ from the model's")
    _check_finite(path, restored)
    return restored
