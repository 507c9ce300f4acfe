"""Weight-sync format between the trainer and the sampler (raw tensors, verified).

A weights directory written by `save_weights` holds

* ``params.safetensors`` -- the model's ``nnx.Param`` state as raw tensors in the
  safetensors format (``safetensors.numpy``), one tensor per leaf of the nested
  pure dict, named by its flattened key path (``jax.tree_util.keystr(path,
  simple=True, separator="/")``, e.g. ``layers/0/mlp/up_proj/kernel`` or, for a
  stacked layout, ``layers/mlp/up_proj/kernel``).  Nothing depends on the
  model's own layout: the reader matches names against the target tree.  Dtypes
  numpy's safetensors table lacks (bfloat16, float8_*) are stored as unsigned
  integers of their width, their dtype recorded in the file's metadata;
* ``weights_meta.json`` -- ``{"format": "pdm_jax.weights/4", "version": v,
  "num_params": ..., "dtypes": ..., "files": {relative path: {"crc32c", "bytes"}},
  "meta_sha256": ...}``, written last (atomically), so its presence marks a
  complete directory.  ``files`` is the integrity manifest: the CRC-32C
  (Castagnoli, ``google-crc32c``'s hardware-accelerated C routine, 8 hex digits) and
  size of the tensor file; ``meta_sha256`` is the sha256 of the meta's own other
  fields (canonical JSON), so a changed byte in the meta file is caught as well.
  CRC-32C is the check object stores keep per object (GCS), and it detects what
  this manifest is for -- truncation, extension (the size), torn writes and flipped
  bits (every burst of <= 32 bits, else all but 2**-32 of random damage) -- but,
  like the unsigned sha256 manifest before it, not deliberate tampering by someone
  who can rewrite the meta file.  Format ``/3`` (a sha256 manifest) is still read.

Cost (measured on the 2-core CPU at load average 6-9, 2.4 MB of tiny-model
weights, medians): serialising 0.8 ms, writing 0.9 ms, CRC-32C 0.12 ms (sha256,
format /3: 1.6 ms); reading 0.3 ms.  The writer checksums the bytes it has in
memory (no second read of the file) and the reader checksums the bytes it read
once, before safetensors parses them from the same buffer: one pass each.  orbax is not involved: it stays
for the resumable training checkpoints (`pdm_jax.checkpointing`), whose save and load cost ~10x more.

`load_weights` verifies all of it before a tensor is parsed, and refuses
parameters holding NaN or inf: a truncated, extended or bit-flipped file, a
missing file, a damaged meta file or non-finite values each raise a
`WeightsError` naming the version directory and the file (or parameter) --
never a silent load.

Older directories are still read: ``pdm_jax.weights/2`` (orbax ``params/`` with
the same manifest: every file verified, then orbax restores) and
``pdm_jax.weights/1`` (orbax, no manifest: loaded *unverified*, with a logged
warning; the non-finite check still applies).  A ``/2`` or ``/3`` meta without
the manifest, or a ``/1`` meta with one, is refused as damaged.

The trainer calls ``save_weights(params, f"{root}/weights/v{version:06d}", version=version)``
(through `SamplerSupervisor.push_weights`) and then the sampler's
``load_weights(path, version)``; the sampler refuses a directory whose recorded
version differs from the requested one, so a stale or half-written directory is
an error, never a silent reuse.

A version directory may be a URL (``gs://bucket/run/weights/v000000``,
`pdm_jax.workdir.is_remote`): each file is then one single-object upload (no
temporary name: object stores have no rename; GCS shows an object complete or
not at all) and is read back whole; the meta file still goes last. The older
orbax formats are read from local directories only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import logging
import os
import stat
import tempfile
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import google_crc32c
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy as st_numpy
from flax import nnx
from jax.experimental import multihost_utils

from pdm_jax import workdir as wd
from pdm_jax.models.qwen3 import Qwen3ForCausalLM

META_FILE = "weights_meta.json"
TENSORS_FILE = "params.safetensors"
PARAMS_DIR = "params"  # the orbax directory of the older formats (read only)
MAX_TREE_DEPTH = 32  # directories below a version directory that a confined copy walks (orbax nests 2-3)
FORMAT = "pdm_jax.weights/4"  # safetensors + CRC-32C manifest
SHA256_FORMAT = "pdm_jax.weights/3"  # safetensors + sha256 manifest: still read, verified
RAW_FORMATS = (FORMAT, SHA256_FORMAT)  # the single-tensor-file formats
ORBAX_FORMAT = "pdm_jax.weights/2"  # orbax params/ + manifest: still read, verified
LEGACY_FORMAT = "pdm_jax.weights/1"  # orbax, no integrity manifest: loaded unverified, with a warning
FILES_KEY = "files"
META_HASH_KEY = "meta_sha256"
MAX_VERSION = 2**31 - 1  # versions travel as int32 (RolloutBatch.weights_version)
#: The largest ``weights_meta.json`` read (bytes): a meta lists a handful of files; a bigger one is refused unread.
MAX_META_BYTES = 4 << 20
_HASH_CHUNK = 8 << 20  # bytes read per hashlib update (hashlib releases the GIL on large updates)
_DTYPES_METADATA = "pdm_jax.dtypes"  # safetensors metadata key: {name: dtype} of tensors stored as uint views
_NATIVE = {np.dtype(t) for t in (np.float64, np.float32, np.float16, np.int64, np.uint64, np.int32, np.uint32,
                                 np.int16, np.uint16, np.int8, np.uint8, np.bool_)}
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


def leaf_name(key_path) -> str:
    """The tensor name of a leaf: its key path joined with ``/`` (``layers/0/mlp/up_proj/kernel``)."""
    return jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")


def _sha256_file(path: str) -> tuple:
    """(hex sha256, size in bytes) of a file, read in `_HASH_CHUNK` pieces."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def crc32c_hex(data) -> str:
    """CRC-32C (Castagnoli) of a bytes-like object as 8 lowercase hex digits (``google_crc32c``)."""
    return f"{google_crc32c.value(data):08x}"


def _checksum(data, fmt: str) -> tuple:
    """``(manifest key, hex digest)`` of `data` for a directory of format `fmt` (/4: crc32c; /3: sha256)."""
    if fmt == FORMAT:
        return "crc32c", crc32c_hex(data)
    return "sha256", hashlib.sha256(data).hexdigest()


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


def _host_leaves(pure: Mapping) -> list:
    """``[(name, numpy array)]`` of a pure dict's leaves, fetched from the devices in one transfer.

    Arrays spread over several processes (multi-host) are gathered first, so every
    process holds (and writes) the same full tensors.
    """
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    arrays = [multihost_utils.process_allgather(x, tiled=True)
              if isinstance(x, jax.Array) and not x.is_fully_addressable else x for _, x in flat]
    host = jax.device_get(arrays)
    out, seen = [], set()
    for (path, _), x in zip(flat, host):
        name = leaf_name(path)
        if name in seen:
            raise ValueError(f"save_weights: two parameters flatten to the same name {name!r}")
        seen.add(name)
        out.append((name, np.ascontiguousarray(x)))
    return out


def serialize(leaves: list) -> bytes:
    """The safetensors bytes of ``[(name, numpy array)]`` (non-numpy dtypes as uint views, see module doc)."""
    tensors, foreign = {}, {}
    for name, x in leaves:
        if x.dtype not in _NATIVE:
            foreign[name] = x.dtype.name
            x = x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))
        tensors[name] = x
    return st_numpy.save(tensors, metadata={_DTYPES_METADATA: json.dumps(foreign, sort_keys=True)})


def deserialize(data: bytes) -> dict:
    """``{name: numpy array}`` of bytes written by `serialize` (dtypes restored).

    Raises:
      ValueError: the bytes are not a safetensors file (safetensors' own error, re-raised).
    """
    try:
        tensors = st_numpy.load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        foreign = json.loads(meta.get(_DTYPES_METADATA, "{}"))
    except Exception as e:  # safetensors raises SafetensorError (not a ValueError); json a ValueError
        raise ValueError(f"{type(e).__name__}: {e}") from None
    for name, dtype in foreign.items():
        tensors[name] = tensors[name].view(np.dtype(dtype))
    return tensors


def _write_atomic(path: str, data: bytes) -> None:
    """`pdm_jax.workdir.write_bytes`: a temporary file (one per process: several hosts may write the same,
    identical directory) renamed over `path`, atomic for readers; no fsync: a version torn by a power loss fails
    its checksum at load, and the trainer re-pushes a missing one. A URL: one single-object upload. Raises
    `pdm_jax.workdir.RunWriteError` naming `path` (ENOSPC...), no temporary left behind."""
    wd.write_bytes(path, data)


def save_weights(model_or_state: Any, path: str, *, version: Optional[int] = None,
                 extra_meta: Optional[dict] = None) -> str:
    """Writes the model's parameters for the sampler (safetensors + JSON meta with a CRC-32C manifest).

    The CRC-32C is computed from the bytes in memory, before they are written (one pass).

    Args:
      model_or_state: an ``nnx.Module`` (its ``nnx.Param`` state is saved), an
        ``nnx.State`` or a nested dict of arrays (jax or numpy, any dtype).
      path: target directory (created; a previous tensor file there is replaced).
      version: integer weights version in [0, 2**31), recorded in ``weights_meta.json``;
        default: the last path component when it is an integer (``.../weights/7`` -> 7).
      extra_meta: optional JSON-serialisable dict merged into the meta file.
    Returns:
      the absolute path of the directory.
    Raises:
      ValueError: negative/non-integer version, or no version given and the
        directory name is not an integer; two leaves with the same flattened name.
      pdm_jax.workdir.RunWriteError: a file cannot be written (ENOSPC...), naming it.
    """
    if version is None:
        name = os.path.basename(os.path.normpath(path))
        if not name.isdigit():
            raise ValueError(f"save_weights: no version given and the directory name {name!r} is not an integer")
        version = int(name)
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"save_weights: version must be an integer in [0, 2**31), got {version!r}")
    leaves = _host_leaves(to_pure_dict(model_or_state))
    data = serialize(leaves)
    path = wd.run_path(path)
    if wd.is_remote(path) and jax.process_count() > 1:  # one copy in the bucket: process 0 writes, all wait
        if jax.process_index() == 0:
            _write_version(path, leaves, data, version, extra_meta)
        multihost_utils.sync_global_devices(f"pdm_jax_save_weights_{path}")
        return path
    return _write_version(path, leaves, data, version, extra_meta)


def _write_version(path: str, leaves: list, data: bytes, version: int, extra_meta: Optional[dict]) -> str:
    """Writes the tensor file, then the meta file (with its manifest) of a version directory; returns `path`."""
    wd.makedirs(path)  # RunWriteError naming it (a read-only or full weights/, a file in its place)
    meta_path = wd.join(path, META_FILE)
    if wd.is_remote(meta_path):
        wd.rmtree(meta_path)  # the directory is incomplete until the new meta is in place
    elif os.path.exists(meta_path):
        with wd.naming_write_errors(meta_path):
            os.remove(meta_path)  # the directory is incomplete until the new meta is in place
    _write_atomic(wd.join(path, TENSORS_FILE), data)
    meta = {
        "format": FORMAT,
        "version": int(version),
        "num_params": int(sum(x.size for _, x in leaves)),
        "dtypes": sorted({x.dtype.name for _, x in leaves}),
    }
    meta.update(extra_meta or {})
    meta[FILES_KEY] = {TENSORS_FILE: {"crc32c": crc32c_hex(data), "bytes": len(data)}}
    meta[META_HASH_KEY] = _meta_digest(meta)
    _write_atomic(meta_path, json.dumps(meta).encode())
    return path


class ConfinedDir:
    """A weights directory opened under a root with no symbolic link followed, for a reader that must not leave it
    (the sampler server's ``--checkpoint_root``).

    The directory is reached from the root one component at a time (``O_NOFOLLOW | O_DIRECTORY`` relative to the
    previous directory's descriptor) and its files are opened relative to the directory's descriptor with
    ``O_NOFOLLOW | O_NONBLOCK``, then checked with ``fstat`` (a regular file, of the size expected) before a byte is
    read: a link anywhere under the root, a directory swapped for a link while a load runs, a FIFO (which would block
    the reader) or a sparse file grown far past its manifest size are refused, never read. Use as a context manager.

    Raises:
      WeightsError: a component of the path under the root is a link or not a directory (naming it), or the path
        is not under the root.
    """

    def __init__(self, root: str, path: str):
        root_real = os.path.realpath(root)
        rel = os.path.relpath(os.path.abspath(path), root_real)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            raise WeightsError(f"weights path {path!r} is outside the checkpoint root; refused")
        self.path = path
        fd = os.open(root_real, os.O_RDONLY | os.O_DIRECTORY)
        for part in [] if rel == os.curdir else rel.split(os.sep):
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                raise WeightsError(f"weights path {path!r} does not exist") from None
            except OSError as e:  # ELOOP / ENOTDIR: a link (perhaps swapped in since the path was checked)
                os.close(fd)
                raise WeightsError(f"weights path {path!r}: {part!r} is a symbolic link or not a directory "
                                   f"({os.strerror(e.errno)}); refused: nothing under the checkpoint root is "
                                   f"read through a link") from None
            os.close(fd)
            fd = nxt
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def read(self, name: str, *, max_bytes: Optional[int] = None, expect_bytes: Optional[int] = None) -> bytes:
        """The bytes of the file `name` of the directory (no link followed, a regular file, size checked first).

        Raises:
          FileNotFoundError: no such file.
          WeightsError: `name` is a link or not a regular file (a FIFO, a device, a directory).
          CorruptWeightsError: its size exceeds `max_bytes` or differs from `expect_bytes` (checked before reading).
        """
        return self._read_at(self.fd, name, max_bytes=max_bytes, expect_bytes=expect_bytes)

    def _read_at(self, dir_fd: int, name: str, *, max_bytes: Optional[int] = None,
                 expect_bytes: Optional[int] = None) -> bytes:
        """`read` of the file `name` (a path relative to this directory, for messages) in the directory `dir_fd`."""
        try:
            fd = os.open(os.path.basename(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise WeightsError(f"weights path {self.path!r}: {name!r} is a symbolic link or cannot be opened "
                               f"({os.strerror(e.errno)}); refused") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WeightsError(f"weights path {self.path!r}: {name!r} is not a regular file; refused")
            if max_bytes is not None and st.st_size > max_bytes:
                raise CorruptWeightsError(self.path, name, f"has {st.st_size} bytes, more than the {max_bytes} "
                                                           "a reader accepts; not read")
            if expect_bytes is not None and st.st_size != expect_bytes:
                raise CorruptWeightsError(self.path, name, f"has {st.st_size} bytes, the manifest records "
                                                           f"{expect_bytes} (truncated or extended); not read")
            chunks, left = [], st.st_size
            while left > 0:
                chunk = os.read(fd, min(left, _HASH_CHUNK))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def copy_tree(self, dest: str, *, sizes: Optional[Mapping[str, int]] = None, max_bytes: int = 0) -> None:
        """Copies every file below the directory into the new directory `dest`, each read as `read` reads it.

        For the orbax formats, which orbax opens by path: orbax then reads the private copy, which nothing under
        the root can swap, so a link swapped in during the load is never followed. Every directory is opened
        relative to its parent's descriptor with ``O_NOFOLLOW``, at most `MAX_TREE_DEPTH` deep. `sizes` (a
        manifest's ``{relative path: bytes}``): every file must be listed and of its size, checked before it is
        read; else each file is refused past `max_bytes` (0: no bound) unread.

        Raises:
          WeightsError: naming the first link, non-regular file, too deep a directory, file missing from the
            manifest or vanished while copying, or a copy that cannot be written (where `tempfile` puts it).
          CorruptWeightsError: a file of another size than `sizes` records, or larger than `max_bytes`.
        """
        stack = [(self.fd, "", dest, None)]  # (directory fd, relative prefix, copy, fd to close when done)
        try:
            while stack:
                fd, prefix, out, own = stack.pop()
                try:
                    self._copy_dir(fd, prefix, out, stack, sizes, max_bytes)
                finally:
                    if own is not None:
                        os.close(own)
        finally:
            for _, _, _, own in stack:
                if own is not None:
                    os.close(own)

    def _copy_dir(self, fd, prefix, out, stack, sizes, max_bytes) -> None:
        """One directory of `copy_tree`: its files copied, its subdirectories pushed on `stack`."""
        if prefix.count("/") >= MAX_TREE_DEPTH:
            raise WeightsError(f"weights path {self.path!r}: {prefix.rstrip('/')!r} is more than {MAX_TREE_DEPTH} "
                               "directories deep; refused")
        try:
            os.mkdir(out, 0o700)
        except OSError as e:
            raise WeightsError(f"weights path {self.path!r}: its private copy cannot be written under "
                               f"{tempfile.gettempdir()!r} ({os.strerror(e.errno)}; TMPDIR picks the place)") from None
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            rel = prefix + e.name
            if rel == META_FILE:
                continue  # read and checked already (`read_meta`); orbax does not read it
            if e.is_symlink():
                raise WeightsError(f"weights path {self.path!r}: {rel!r} is a symbolic link; refused")
            if e.is_dir(follow_symlinks=False):
                try:
                    sub_fd = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as err:
                    raise WeightsError(f"weights path {self.path!r}: {rel!r} is a symbolic link, not a directory "
                                       f"or gone ({os.strerror(err.errno)}); refused") from None
                stack.append((sub_fd, rel + "/", os.path.join(out, e.name), sub_fd))
            elif e.is_file(follow_symlinks=False):
                if sizes is not None and rel not in sizes:
                    raise WeightsError(f"weights path {self.path!r}: {rel!r} is not in its manifest; refused")
                try:
                    data = self._read_at(fd, rel, expect_bytes=None if sizes is None else sizes[rel],
                                         max_bytes=None if sizes is not None or not max_bytes else max_bytes)
                except FileNotFoundError:
                    raise WeightsError(f"weights path {self.path!r}: {rel!r} vanished while it was read (the "
                                       "version is being deleted?)") from None
                try:
                    with open(os.path.join(out, e.name), "xb") as f:
                        f.write(data)
                except OSError as err:
                    raise WeightsError(f"weights path {self.path!r}: its private copy cannot be written under "
                                       f"{tempfile.gettempdir()!r} ({os.strerror(err.errno)}; TMPDIR picks the "
                                       "place)") from None
            else:
                raise WeightsError(f"weights path {self.path!r}: {rel!r} is not a regular file; refused")


def _parse_meta_json(path: str, data: bytes):
    if len(data) > MAX_META_BYTES:
        raise CorruptWeightsError(path, META_FILE, f"has {len(data)} bytes, more than the {MAX_META_BYTES} a reader "
                                                   "accepts")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CorruptWeightsError(path, META_FILE, f"cannot be read as JSON ({type(e).__name__}: "
                                                   f"{str(e)[:200]})") from None


def read_meta(path: str, *, confined: Optional[ConfinedDir] = None) -> dict:
    """The ``weights_meta.json`` of a weights directory, its own checksum verified.

    Args:
      path: the weights directory.
      confined: the directory opened under a root (`ConfinedDir`): the meta file is read through it.
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
    missing = WeightsError(f"weights path {path!r} has no {META_FILE} (incomplete or not written by save_weights)")
    if confined is not None:
        try:
            meta = _parse_meta_json(path, confined.read(META_FILE, max_bytes=MAX_META_BYTES))
        except FileNotFoundError:
            raise missing from None
    else:
        if not wd.isdir(path):
            raise WeightsError(f"weights path {path!r} does not exist")
        meta_path = wd.join(path, META_FILE)
        if not (wd.exists(meta_path) if wd.is_remote(meta_path) else os.path.isfile(meta_path)):
            raise missing
        if not wd.is_remote(meta_path) and os.path.getsize(meta_path) > MAX_META_BYTES:
            raise CorruptWeightsError(path, META_FILE, f"has {os.path.getsize(meta_path)} bytes, more than the "
                                                       f"{MAX_META_BYTES} a reader accepts; not read")
        try:
            data = wd.read_bytes(meta_path)
        except OSError as e:
            raise CorruptWeightsError(path, META_FILE, f"cannot be read ({type(e).__name__}: {e})") from e
        meta = _parse_meta_json(path, data)
    if not isinstance(meta, dict):
        raise CorruptWeightsError(path, META_FILE, f"holds a {type(meta).__name__}, not a JSON object")
    has_manifest = FILES_KEY in meta or META_HASH_KEY in meta
    if meta.get("format") == LEGACY_FORMAT and has_manifest:
        raise CorruptWeightsError(path, META_FILE, f"says format {LEGACY_FORMAT!r} but carries a manifest")
    if meta.get("format") not in (*RAW_FORMATS, ORBAX_FORMAT, LEGACY_FORMAT):
        if has_manifest and meta.get(META_HASH_KEY) != _meta_digest(meta):
            raise CorruptWeightsError(path, META_FILE, "fails its meta_sha256 checksum")
        raise WeightsError(f"weights path {path!r}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["format"] != LEGACY_FORMAT:
        if not isinstance(meta.get(FILES_KEY), dict) or not isinstance(meta.get(META_HASH_KEY), str):
            raise CorruptWeightsError(path, META_FILE, f"lacks its {FILES_KEY!r}/{META_HASH_KEY!r} manifest")
        if meta[META_HASH_KEY] != _meta_digest(meta):
            raise CorruptWeightsError(path, META_FILE, "fails its meta_sha256 checksum")
    if meta["format"] in RAW_FORMATS and set(meta[FILES_KEY]) != {TENSORS_FILE}:
        raise CorruptWeightsError(path, META_FILE, f"lists {sorted(meta[FILES_KEY])}, expected [{TENSORS_FILE!r}]")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise CorruptWeightsError(path, META_FILE, f"records no valid version (got {version!r})")
    return meta


def _check_entries(path: str, entries: Mapping) -> None:
    for rel, info in entries.items():
        parts = rel.split("/")
        if not rel or rel.startswith("/") or ".." in parts or "\0" in rel or not isinstance(info, dict):
            raise CorruptWeightsError(path, rel.replace("\0", "\\0"), "is not a valid manifest entry")


def _mismatch(rel: str, got: tuple, want: Mapping, algorithm: str = "sha256") -> Optional[str]:
    """What is wrong with a file of (digest, size) `got` against its manifest entry (`algorithm` key), or None."""
    if got[1] != want.get("bytes"):
        return f"has {got[1]} bytes, the manifest records {want.get('bytes')} (truncated or extended)"
    if got[0] != want.get(algorithm):
        return f"fails its {algorithm} checksum (its bytes changed)"
    return None


def verify_files(path: str, meta: Mapping, *, shown: Optional[str] = None) -> None:
    """Checks every file of the manifest ``meta["files"]`` (size and sha256) under the directory `path`
    (named `shown` in errors, when `path` is a private copy of it).

    Raises:
      CorruptWeightsError: naming the first bad file (sorted) and how many are bad:
        a manifest entry that is not a plain relative path, a missing file, a
        size that differs (truncated / extended) or a sha256 that differs
        (changed bytes).
    """
    entries = meta[FILES_KEY]
    _check_entries(shown or path, entries)
    hashes = _hash_files(path, sorted(entries))
    bad = []
    for rel in sorted(entries):
        got = hashes[rel]
        if isinstance(got, FileNotFoundError):
            bad.append((rel, "is missing"))
        elif isinstance(got, OSError):
            bad.append((rel, f"cannot be read ({str(got).replace(path, shown) if shown else got})"))
        elif (problem := _mismatch(rel, got, entries[rel])) is not None:
            bad.append((rel, problem))
    if bad:
        rel, problem = bad[0]
        more = f" ({len(bad) - 1} more damaged file(s))" if len(bad) > 1 else ""
        raise CorruptWeightsError(shown or path, rel, problem + more)


def read_tensors(path: str, meta: Mapping, *, confined: Optional[ConfinedDir] = None) -> dict:
    """``{name: numpy array}`` of a ``/4`` (or ``/3``) directory's tensor file, its size and checksum checked first.

    The file is read once; the hash and the parse run over the same buffer.

    Raises:
      CorruptWeightsError: the file is missing, unreadable, of another size or
        hash than the manifest records, or (hash intact) not parseable.
    """
    entries = meta[FILES_KEY]
    _check_entries(path, entries)
    want = entries[TENSORS_FILE].get("bytes")
    want = want if isinstance(want, int) and not isinstance(want, bool) else None
    file = wd.join(path, TENSORS_FILE)
    try:
        if confined is not None:
            data = confined.read(TENSORS_FILE, expect_bytes=want)
        else:
            if want is not None and not wd.is_remote(file) and os.path.isfile(file) and os.path.getsize(file) != want:
                raise CorruptWeightsError(path, TENSORS_FILE, f"has {os.path.getsize(file)} bytes, the manifest "
                                                              f"records {want} (truncated or extended); not read")
            data = wd.read_bytes(file)
    except FileNotFoundError:
        raise CorruptWeightsError(path, TENSORS_FILE, "is missing") from None
    except OSError as e:
        raise CorruptWeightsError(path, TENSORS_FILE, f"cannot be read ({e})") from e
    algorithm, digest = _checksum(data, meta["format"])
    problem = _mismatch(TENSORS_FILE, (digest, len(data)), entries[TENSORS_FILE], algorithm)
    if problem is not None:
        raise CorruptWeightsError(path, TENSORS_FILE, problem)
    try:
        return deserialize(data)
    except ValueError as e:
        raise CorruptWeightsError(path, TENSORS_FILE, f"is not a readable safetensors file ({e})") from e


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


def _match_target(path: str, tensors: Mapping, target: Mapping) -> dict:
    """The tensors arranged as the target tree (matched by flattened name), cast to its float dtypes.

    Raises:
      WeightsError: a name missing from the file or not in the model, or a shape
        (or a non-float dtype) that differs from the target's.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    names = [leaf_name(k) for k, _ in flat]
    missing = [n for n in names if n not in tensors]
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise WeightsError(f"weights path {path!r} does not match the model: "
                           f"missing {missing[:3]}{'...' if len(missing) > 3 else ''} "
                           f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    out = []
    for name, (_, want) in zip(names, flat):
        x = tensors[name]
        same_kind = x.dtype == want.dtype or (jnp.issubdtype(x.dtype, jnp.floating)
                                              and jnp.issubdtype(want.dtype, jnp.floating))
        if tuple(x.shape) != tuple(want.shape) or not same_kind:
            raise WeightsError(f"weights path {path!r} does not match the model: {name} is "
                               f"{x.dtype.name}{list(x.shape)}, the model expects {np.dtype(want.dtype).name}"
                               f"{list(want.shape)}")
        out.append(x if x.dtype == want.dtype else x.astype(want.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _restore_orbax(path: str, target: Mapping, *, source: Optional[str] = None) -> dict:
    """orbax restore of an older (``/1``, ``/2``) directory's ``params/`` into `target`'s shapes (read from
    `source`, a private copy of `path`, when given)."""
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(source or path, PARAMS_DIR), target)
    except Exception as e:  # orbax raises assorted types for tree/shape mismatches
        why = str(e).replace(source, path) if source else str(e)  # the private copy is named as what it copies
        raise WeightsError(f"weights path {path!r} does not match the model: {type(e).__name__}: {why}") from None
    got = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), restored)
    want = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), target)
    if got != want:
        raise WeightsError(f"weights path {path!r}: restored shapes differ from the model's")
    return restored


def load_weights(path: str, config=None, *, version: Optional[int] = None, abstract: Optional[Mapping] = None,
                 root: Optional[str] = None) -> dict:
    """Restores the parameters written by `save_weights` as a nested pure dict of host arrays, verified.

    Order: the meta file (and its own checksum), the version, the tensor file's
    size and checksum (CRC-32C; sha256 for ``/3``) against the manifest, the names and shapes against the
    target tree, then finiteness.  An older directory is read through orbax
    (``/2``: every file verified first; ``/1``: unverified, with a logged warning).

    Args:
      path: the weights directory.
      config: a ``Qwen3Config``; the target shapes are the model's.  Either
        `config` or `abstract` is needed.
      version: if given, must equal the version recorded in the meta file.
      abstract: an explicit target tree of jax.ShapeDtypeStruct (overrides config);
        float tensors are cast to its dtypes.
      root: a local directory `path` must lie under: every file is then read through `ConfinedDir` (no link
        followed, no FIFO, sizes checked before reading; the orbax formats copied that way into a private
        directory that orbax then reads).
    Returns:
      nested dict (the target's structure) of numpy arrays (jax arrays for an orbax directory read without
      `root`).
    Raises:
      WeightsError: missing/incomplete directory, tensors whose names/shapes do
        not match the model, or parameters holding NaN/inf (naming the parameter).
      VersionMismatchError: the recorded version is not `version`.
      CorruptWeightsError: a damaged file (naming the directory and the file).
    """
    path = wd.run_path(path)
    if abstract is None:
        if config is None:
            raise ValueError("load_weights needs a config or an abstract target tree")
        abstract = abstract_params(config)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dict(abstract))
    confined = None if root is None or wd.is_remote(path) else ConfinedDir(root, path)
    with contextlib.ExitStack() as cleanup:
        try:
            meta = read_meta(path, confined=confined)
            if version is not None and int(meta["version"]) != int(version):
                raise VersionMismatchError(f"weights path {path!r} holds version {meta['version']}, "
                                           f"not the requested version {version}")
            tensors, orbax_dir = None, path
            if meta["format"] in RAW_FORMATS:
                tensors = read_tensors(path, meta, confined=confined)
            elif confined is not None:  # orbax reads by path: a private copy read through descriptors
                orbax_dir = os.path.join(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdm_weights_")),
                                         "copy")
                if FILES_KEY in meta:  # every file listed, of its size: checked before it is read
                    _check_entries(path, meta[FILES_KEY])
                    sizes = {rel: info.get("bytes") for rel, info in meta[FILES_KEY].items()}
                    confined.copy_tree(orbax_dir, sizes=sizes)
                else:  # /1, no manifest: no file larger than the whole model (and its metadata) is read
                    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(target))
                    confined.copy_tree(orbax_dir, max_bytes=2 * total + (16 << 20))
        finally:
            if confined is not None:
                confined.close()
        if tensors is None and FILES_KEY in meta:
            verify_files(orbax_dir, meta, shown=path)
        elif tensors is None:
            log.warning("weights path %r has no integrity manifest (format %s): loading it unverified; re-save it "
                        "with save_weights to add one", path, LEGACY_FORMAT)
        if tensors is not None:
            restored = _match_target(path, tensors, target)
        else:
            restored = jax.tree.map(np.asarray, _restore_orbax(path, target,
                                                               source=orbax_dir))  # read before the copy goes
        _check_finite(path, restored)
        return restored
