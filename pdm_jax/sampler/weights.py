"""Weight-sync format between the trainer and the sampler.

A weights directory written by `save_weights` holds

* ``params/`` -- the model's ``nnx.Param`` state as a nested *pure dict* of
  arrays, written with orbax's ``StandardCheckpointer`` (we wait until the
  write has finished);
* ``weights_meta.json`` -- ``{"format": "pdm_jax.weights/1", "version": v,
  "num_params": ..., "dtype": ...}``, written last, so its presence marks a
  complete checkpoint.

The trainer calls ``save_weights(model, f"{root}/weights/{version}", version=version)``
and then the sampler client's ``load_weights(path, version)``; the sampler
refuses a directory whose recorded version differs from the requested one, so a
stale or half-written directory is an error, never a silent reuse.
"""

from __future__ import annotations

import json
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
FORMAT = "pdm_jax.weights/1"


class WeightsError(ValueError):
    """A weights directory is missing, incomplete, or does not match the request."""


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


def save_weights(model_or_state: Any, path: str, *, version: Optional[int] = None,
                 extra_meta: Optional[dict] = None) -> str:
    """Writes the model's parameters for the sampler (orbax + JSON meta); returns the abs path.

    Args:
      model_or_state: an ``nnx.Module`` (its ``nnx.Param`` state is saved), an
        ``nnx.State`` or a nested dict of arrays.
      path: target directory; must not exist yet (orbax refuses to overwrite).
      version: integer weights version >= 0, recorded in ``weights_meta.json``;
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
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"save_weights: version must be an integer >= 0, got {version!r}")
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
    tmp = os.path.join(path, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(path, META_FILE))
    return path


def read_meta(path: str) -> dict:
    """The ``weights_meta.json`` of a weights directory.

    Raises:
      WeightsError: the directory or its meta file is missing (incomplete write),
        or the format is unknown.
    """
    if not os.path.isdir(path):
        raise WeightsError(f"weights path {path!r} does not exist")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise WeightsError(f"weights path {path!r} has no {META_FILE} (incomplete or not written by save_weights)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise WeightsError(f"weights path {path!r}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def abstract_params(config, dtype=jnp.float32) -> dict:
    """Shapes/dtypes (jax.ShapeDtypeStruct) of the Qwen3 parameters for `config`, as a pure dict."""
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def load_weights(path: str, config=None, *, version: Optional[int] = None, abstract: Optional[Mapping] = None) -> dict:
    """Restores the parameters written by `save_weights` as a nested pure dict of arrays.

    Args:
      path: the weights directory.
      config: a ``Qwen3Config``; the restore target shapes are the model's
        (shape/dtype mismatches raise).  Either `config` or `abstract` is needed.
      version: if given, must equal the version recorded in the meta file.
      abstract: an explicit target tree of jax.ShapeDtypeStruct (overrides config).
    Returns:
      nested dict of jax arrays with the checkpoint's values.
    Raises:
      WeightsError: missing/incomplete directory, version mismatch, or a
        checkpoint whose tree/shapes do not match the model.
    """
    path = os.path.abspath(path)
    meta = read_meta(path)
    if version is not None and int(meta["version"]) != int(version):
        raise WeightsError(f"weights path {path!r} holds version {meta['version']}, not the requested version {version}")
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
    return restored
