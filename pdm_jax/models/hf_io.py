"""Hugging Face checkpoint I/O for the NNX Qwen3: local ``config.json`` + safetensors.

The layout ``transformers`` ``save_pretrained`` uses: ``config.json`` and ``model.safetensors`` or shards plus
``model.safetensors.index.json``. ``KEY_MAP`` maps tensor names to NNX paths; HF ``[out, in]`` Linear weights become
our ``[in..., out...]`` kernels with heads split out (q_proj ``[N*H, D]`` <-> ``[D, N, H]``). Row ``i`` of a stacked
``layers.*`` parameter is HF's ``model.layers.{i}`` (a mixed MoE model: row j of ``layers`` / ``dense_layers`` is
layer ``config.stack_layer_ids(0 / 1)[j]``). Qwen3-MoE: the router ``gate.kernel`` [D, E] is ``mlp.gate.weight`` [E,
D]; a stacked expert kernel [L, E, D, I] holds the hub's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(written here), and transformers 5's fused ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I] are read too.
Loading never materialises the model on the host: the structure comes from ``nnx.eval_shape`` and each device reads
only its block of each parameter from the memory-mapped file (``jax.make_array_from_callback``)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from pdm_jax import sharding as shd
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """One row of the key map: ``hf`` a regex over HF tensor names; ``nnx`` the NNX path template (``{0}`` the first
    group, a layer index; ``{1}`` the expert); ``num_in_axes`` how many leading kernel axes are HF's ``in`` axis
    (``kernel.reshape(prod(in), prod(out)).T`` is the HF weight), None = same layout."""

    hf: str
    nnx: str
    num_in_axes: int | None


_L = r"model\.layers\.(\d+)\."
KEY_MAP: tuple[KeyRule, ...] = (
    KeyRule(r"model\.embed_tokens\.weight", "embed_tokens.embedding", None),
    KeyRule(r"model\.norm\.weight", "norm.scale", None),
    KeyRule(r"lm_head\.weight", "lm_head.kernel", 1),
    KeyRule(_L + r"input_layernorm\.weight", "layers.{0}.input_layernorm.scale", None),
    KeyRule(_L + r"post_attention_layernorm\.weight",
            "layers.{0}.post_attention_layernorm.scale", None),
    KeyRule(_L + r"self_attn\.q_proj\.weight", "layers.{0}.self_attn.q_proj.kernel", 1),
    KeyRule(_L + r"self_attn\.k_proj\.weight", "layers.{0}.self_attn.k_proj.kernel", 1),
    KeyRule(_L + r"self_attn\.v_proj\.weight", "layers.{0}.self_attn.v_proj.kernel", 1),
    KeyRule(_L + r"self_attn\.o_proj\.weight", "layers.{0}.self_attn.o_proj.kernel", 2),
    KeyRule(_L + r"self_attn\.q_norm\.weight", "layers.{0}.self_attn.q_norm.scale", None),
    KeyRule(_L + r"self_attn\.k_norm\.weight", "layers.{0}.self_attn.k_norm.scale", None),
    KeyRule(_L + r"mlp\.gate_proj\.weight", "layers.{0}.mlp.gate_proj.kernel", 1),
    KeyRule(_L + r"mlp\.up_proj\.weight", "layers.{0}.mlp.up_proj.kernel", 1),
    KeyRule(_L + r"mlp\.down_proj\.weight", "layers.{0}.mlp.down_proj.kernel", 1),
    # Qwen3-MoE: the router, and expert e's kernels (rows of the stacked [L, E, ...] kernels).
    KeyRule(_L + r"mlp\.gate\.weight", "layers.{0}.mlp.gate.kernel", 1),
    KeyRule(_L + r"mlp\.experts\.(\d+)\.gate_proj\.weight",
            "layers.{0}.mlp.experts.{1}.gate_proj.kernel", 1),
    KeyRule(_L + r"mlp\.experts\.(\d+)\.up_proj\.weight",
            "layers.{0}.mlp.experts.{1}.up_proj.kernel", 1),
    KeyRule(_L + r"mlp\.experts\.(\d+)\.down_proj\.weight",
            "layers.{0}.mlp.experts.{1}.down_proj.kernel", 1),
)
_EXPERTS = "mlp.experts."  # stacked parameters under this prefix have an expert axis (axis 1)


def _nnx_path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def hf_to_nnx(name: str) -> tuple[str, int | None] | None:
    """(NNX dotted path, num_in_axes) for an HF tensor name, or None if no rule matches."""
    for rule in KEY_MAP:
        m = re.fullmatch(rule.hf, name)
        if m:
            return rule.nnx.format(*m.groups()), rule.num_in_axes
    return None


def nnx_to_hf(path: str) -> tuple[str, int | None]:
    """(HF tensor name, num_in_axes) for an NNX dotted path.

    Raises ValueError naming the path when no rule covers it.
    """
    for rule in KEY_MAP:
        pattern = (re.escape(rule.nnx).replace(re.escape("{0}"), r"(\d+)")
                   .replace(re.escape("{1}"), r"(\d+)"))
        m = re.fullmatch(pattern, path)
        if m:
            hf = rule.hf.replace(r"(\d+)", "{}").replace("\\.", ".").format(*m.groups())
            return hf, rule.num_in_axes
    raise ValueError(f"no HF key rule for parameter {path!r}")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One HF tensor held by a parameter of ours: ``name``; ``layer`` its row of a stacked parameter (None if
    unstacked); ``num_in_axes`` as ``KeyRule``; ``shape`` of that row in our layout; ``expert`` its index on a
    stacked expert kernel."""

    name: str
    layer: int | None
    num_in_axes: int | None
    shape: tuple[int, ...]
    expert: int | None = None


_STACKS = ("layers", "dense_layers")  # the model's layer stacks (``Qwen3Config.layer_plan``)


def is_stacked(path: str) -> bool:
    """Whether a dotted NNX path is a stacked decoder-layer parameter (``layers.<name>…`` or a mixed MoE model's
    ``dense_layers.<name>…``)."""
    parts = path.split(".")
    return len(parts) > 1 and parts[0] in _STACKS and not parts[1].isdigit()


def tensor_entries(path: str, shape: tuple[int, ...],
                   config: Qwen3Config | None = None) -> list[TensorEntry]:
    """The HF tensors a parameter (dotted NNX ``path``, our ``shape``) holds, in layer order (row j of a stack is HF
    layer ``config.stack_layer_ids(stack)[j]``; without ``config``, layer j). ValueError naming the path when no rule
    covers it, or for a ``dense_layers`` path without ``config``."""
    shape = tuple(shape)
    if not is_stacked(path):
        name, num_in = nnx_to_hf(path)
        return [TensorEntry(name, None, num_in, shape)]
    stack, rest = path.split(".", 1)
    if config is not None:
        layer_ids = config.stack_layer_ids(_STACKS.index(stack))
    elif stack == "layers":
        layer_ids = range(shape[0])
    else:
        raise ValueError(f"tensor_entries: {path!r} needs the model config (its layer ids)")
    out = []
    for i, layer in zip(range(shape[0]), layer_ids, strict=True):
        if rest.startswith(_EXPERTS):  # [L, E, ...]: layer-major, then expert
            for e in range(shape[1]):
                name, num_in = nnx_to_hf(f"layers.{layer}.{_EXPERTS}{e}.{rest[len(_EXPERTS):]}")
                out.append(TensorEntry(name, i, num_in, shape[2:], e))
            continue
        name, num_in = nnx_to_hf(f"layers.{layer}.{rest}")
        out.append(TensorEntry(name, i, num_in, shape[1:]))
    return out


def hf_shape(kernel_shape: tuple[int, ...], num_in_axes: int | None) -> tuple[int, ...]:
    """The HF tensor shape of a parameter with our ``kernel_shape``."""
    if num_in_axes is None:
        return tuple(kernel_shape)
    return (math.prod(kernel_shape[num_in_axes:]), math.prod(kernel_shape[:num_in_axes]))


def to_hf_layout(value: np.ndarray, num_in_axes: int | None) -> np.ndarray:
    """Our layout -> HF layout (a contiguous copy for Linear kernels)."""
    if num_in_axes is None:
        return np.ascontiguousarray(value)
    shape = value.shape
    return np.ascontiguousarray(
        value.reshape(math.prod(shape[:num_in_axes]), math.prod(shape[num_in_axes:])).T)


# ---- Reading ---------------------------------------------------------------------------------------------


def _safe_open(path: str):
    """safetensors' safe_open, with a corrupt or truncated file reported as a ValueError naming it."""
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError (not a ValueError)
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


class _Checkpoint:
    """Name -> file index over a local HF directory; opens safetensors files lazily."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_FILE)
        single_path = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                index = json.load(f)
            if "weight_map" not in index:
                raise ValueError(f"{index_path} has no 'weight_map'")
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            for name, fname in self.weight_map.items():
                if not os.path.exists(os.path.join(path, fname)):
                    raise ValueError(f"tensor {name!r}: shard file {fname!r} listed in "
                                     f"{INDEX_FILE} does not exist in {path}")
        elif os.path.exists(single_path):
            with _safe_open(single_path) as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
        self._handles: dict[str, Any] = {}
        # transformers 5's fused expert tensors, listed as the per-expert tensors they hold.
        self._views: dict[str, tuple[str, int, int, int]] = {}
        for name in [n for n in self.weight_map if _FUSED.fullmatch(n)]:
            fname = self.weight_map.pop(name)
            for view, spec in _fused_views(name, self._raw_slice(name, fname).get_shape()).items():
                self.weight_map[view] = fname
                self._views[view] = spec

    def _raw_slice(self, name: str, fname: str):
        handle = self._open(fname)
        if name not in handle.keys():
            raise ValueError(f"tensor {name!r} is listed in {INDEX_FILE} under "
                             f"{fname!r} but that file lacks it")
        return handle.get_slice(name)

    def _open(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = _safe_open(os.path.join(self.path, fname))
        return self._handles[fname]

    def slice(self, name: str):
        """A lazy safetensors slice (``.get_shape()``, ``[...]`` reads only that part)."""
        if name in self._views:
            fused, e, start, rows = self._views[name]
            return _ExpertView(self._raw_slice(fused, self.weight_map[name]), e, start, rows)
        return self._raw_slice(name, self.weight_map[name])

    def close(self):
        self._handles.clear()


# transformers 5 fused expert tensors (``save_pretrained(save_original_format=False)``).
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")


def _fused_views(name: str, shape) -> dict[str, tuple[str, int, int, int]]:
    """The per-expert HF tensors a fused tensor holds: {name: (fused name, expert, first row, rows)}. ``gate_up_proj``
    [E, 2I, D]: gate_proj = rows [0, I), up_proj = rows [I, 2I) (``chunk(2)`` in ``Qwen3MoeExperts``); ``down_proj`` [E,
    D, I] is expert e's down_proj."""
    prefix, kind = _FUSED.fullmatch(name).groups()
    shape = tuple(shape)
    if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
        raise ValueError(f"fused expert tensor {name!r} has shape {shape}; expected "
                         + ("[E, 2I, D]" if kind == "gate_up_proj" else "[E, D, I]"))
    views = {}
    for e in range(shape[0]):
        if kind == "gate_up_proj":
            half = shape[1] // 2
            views[f"{prefix}{e}.gate_proj.weight"] = (name, e, 0, half)
            views[f"{prefix}{e}.up_proj.weight"] = (name, e, half, half)
        else:
            views[f"{prefix}{e}.down_proj.weight"] = (name, e, 0, shape[1])
    return views


class _ExpertView:
    """Expert ``e``'s rows [start, start+rows) of a fused [E, R, C] lazy slice, as a 2-D lazy slice (``get_shape``,
    ``[rows, cols]`` reads only that block)."""

    def __init__(self, fused, e: int, start: int, rows: int):
        self.fused, self.e, self.start, self.rows = fused, e, start, rows

    def get_shape(self):
        return [self.rows, self.fused.get_shape()[2]]

    def __getitem__(self, index):
        r, c = index if isinstance(index, tuple) else (index, slice(None))
        r = slice(*r.indices(self.rows))
        return np.asarray(self.fused[self.e:self.e + 1, self.start + r.start:self.start + r.stop,
                                     c])[0]


def _unfuse(tensors: dict[str, Any]) -> dict[str, Any]:
    """An HF-named dict with any fused expert tensors replaced by the per-expert ones."""
    out = {}
    for name, value in tensors.items():
        if not _FUSED.fullmatch(name):
            out[name] = value
            continue
        value = np.asarray(value)
        for view, (_, e, start, rows) in _fused_views(name, value.shape).items():
            out[view] = value[e, start:start + rows]
    return out


def _read_block(hf_slice, kernel_shape: tuple[int, ...], num_in_axes: int | None,
                index: tuple[slice, ...]) -> np.ndarray:
    """Reads the block ``kernel[index]`` of our layout from an HF-layout lazy slice.

    For each HF axis (a group of our axes flattened), the contiguous row range covering the group's *first* axis slice
    is read, then the remaining axes are sliced in memory.
    """
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, kernel_shape))
    if num_in_axes is None:
        return np.asarray(hf_slice[index])
    in_axes = list(range(num_in_axes))
    out_axes = list(range(num_in_axes, len(kernel_shape)))

    def flat_range(axes):
        inner = math.prod(kernel_shape[a] for a in axes[1:])
        first = index[axes[0]]
        return slice(first.start * inner, first.stop * inner)

    # HF weight is [out, in]
    block = np.asarray(hf_slice[flat_range(out_axes), flat_range(in_axes)])
    n_out = index[out_axes[0]].stop - index[out_axes[0]].start
    n_in = index[in_axes[0]].stop - index[in_axes[0]].start
    block = block.T.reshape((n_in, *[kernel_shape[a] for a in in_axes[1:]],
                             n_out, *[kernel_shape[a] for a in out_axes[1:]]))
    inner_index = tuple(slice(None) if a in (in_axes[0], out_axes[0]) else index[a]
                        for a in range(len(kernel_shape)))
    return np.ascontiguousarray(block[inner_index])


def _read_param(source, entries: list[TensorEntry], shape: tuple[int, ...], target,
                index: tuple[slice, ...]) -> np.ndarray:
    """The block ``param[index]`` (our layout, dtype ``target``) of one parameter.

    ``source`` is a ``_Checkpoint`` (lazy slices) or a dict of HF-named arrays. A stacked parameter reads the layer rows
    ``index[0]`` covers, each from its own HF tensor.
    """
    def hf(name):
        return source.slice(name) if isinstance(source, _Checkpoint) else source[name]

    if entries[0].layer is None:
        e = entries[0]
        return _read_block(hf(e.name), e.shape, e.num_in_axes, index).astype(target)
    rows = range(*slice(*index[0].indices(shape[0])).indices(shape[0]))
    if entries[0].expert is not None:  # [L, E, ...]: entry i*E + e
        E = shape[1]
        experts = range(*slice(*index[1].indices(E)).indices(E))
        return np.stack([np.stack([
            _read_block(hf(entries[i * E + e].name), entries[i * E + e].shape,
                        entries[i * E + e].num_in_axes, index[2:]).astype(target)
            for e in experts]) for i in rows])
    return np.stack([_read_block(hf(entries[i].name), entries[i].shape, entries[i].num_in_axes,
                                 index[1:]).astype(target) for i in rows])


def load_config(path: str) -> Qwen3Config:
    """``Qwen3Config.from_hf_dict`` of ``path/config.json`` (FileNotFoundError if absent)."""
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
    with open(cfg_path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object, got {type(d).__name__}")
    return Qwen3Config.from_hf_dict(d)


def from_pretrained(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: shd.Rules | None = None, param_dtype=None) -> Qwen3ForCausalLM:
    """Loads a local HF Qwen3 or Qwen3-MoE directory into a ``Qwen3ForCausalLM`` (per-expert or fused MoE tensors).

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards + index).
      dtype: computation dtype, and parameter dtype unless ``param_dtype`` is given (tensors cast from their stored
        one).
      mesh: if given, each parameter is created with its ``NamedSharding`` and each device reads only its block.
      rules: logical-axis rules (default ``pdm_jax.sharding.DEFAULT_RULES``).
      param_dtype: storage dtype of the parameters (default: ``dtype``).
    Returns:
      The model (only ``nnx.Param`` state).
    Raises:
      FileNotFoundError: missing config or weights.
      ValueError: unsupported config (naming the field); missing, unexpected or mis-shaped tensors (naming each with
        expected and found HF shapes, 12 of each kind, then "and N more"; and which ``model.layers.{i}`` the file
        holds when they are not 0 .. L-1). With ``tie_word_embeddings`` an ``lm_head.weight`` in the file is ignored."""
    config = load_config(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    rules = shd.DEFAULT_RULES if rules is None else rules
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(
        config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    graphdef, abs_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abs_state)
    shardings = None
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(shd.param_shardings(abs_state, mesh, rules)))

    ckpt = _Checkpoint(path)
    try:
        entries = {p: tensor_entries(_nnx_path_str(p), var.get_value().shape, config)
                   for p, var in flat}
        expected = {e.name: e for es in entries.values() for e in es}
        present = set(ckpt.weight_map)
        missing = sorted(set(expected) - present, key=_hf_sort_key)
        extra = sorted(present - set(expected), key=_hf_sort_key)
        if config.tie_word_embeddings and "lm_head.weight" in extra:
            extra.remove("lm_head.weight")
        problems = []
        layer_problem = _layer_count_problem(config.num_hidden_layers, present, "config.json")
        if layer_problem:
            problems.append(layer_problem)
        if missing:
            problems.append(f"missing tensors: {_name_list(missing)}")
        if extra:
            problems.append(f"unexpected tensors: {_name_list(extra)}")
        wrong = []
        for name in sorted(set(expected) & present, key=_hf_sort_key):
            want = hf_shape(expected[name].shape, expected[name].num_in_axes)
            got = tuple(ckpt.slice(name).get_shape())
            if got != want:
                wrong.append(f"tensor {name!r} has shape {got}, expected {want}")
        problems += wrong[:_LISTED]
        if len(wrong) > _LISTED:
            problems.append(f"and {len(wrong) - _LISTED} more tensors with a wrong shape")
        if problems:
            raise ValueError(f"checkpoint {path} does not match {config}: " + "; ".join(problems))

        new_values = []
        for p, var in flat:
            shape, target = tuple(var.get_value().shape), var.get_value().dtype
            read = functools.partial(_read_param, ckpt, entries[p], shape, target)
            if shardings is None:
                array = jnp.asarray(read(tuple(slice(None) for _ in shape)))
            else:
                cache: dict[tuple, np.ndarray] = {}

                def callback(index, read=read, shape=shape, cache=cache):
                    key = tuple((s.start, s.stop) for s in
                                (slice(*i.indices(n)) for i, n in zip(index, shape)))
                    if key not in cache:
                        cache[key] = read(index)
                    return cache[key]

                array = jax.make_array_from_callback(shape, shardings[p], callback)
            new_values.append((p, array))
    finally:
        ckpt.close()
    state = nnx.from_flat_state([(p, var.replace(value)) for (p, var), (_, value)
                                 in zip(flat, new_values)])
    return nnx.merge(graphdef, state)


# ---- Writing ---------------------------------------------------------------------------------------------

_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "B": 1}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MiB" (transformers convention)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", size.upper())
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    raise ValueError(f"max_shard_size must be a positive int or a string like '5GB', got {size!r}")


def _host_value(value: jax.Array) -> np.ndarray:
    """Full host copy of one (possibly sharded) parameter."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils  # only for multi-host saves
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


def save_pretrained(model: Qwen3ForCausalLM, path: str, *,
                    max_shard_size: int | str = "5GB") -> list[str]:
    """Writes ``config.json`` and safetensors in the HF layout, stored dtypes kept (round trip bit-exact): one
    ``model.safetensors`` within ``max_shard_size`` bytes, else shards plus the index, one shard on the host at a
    time; multi-host, only process 0 writes. Returns the weight files written (relative to ``path``); ValueError for
    a bad ``max_shard_size``."""
    limit = parse_size(max_shard_size)
    config: Qwen3Config = model.config
    entries = [(e.name, value, e, math.prod(e.shape) * np.dtype(value.dtype).itemsize)
               for value, e in _param_entries(model)]  # (hf_name, value, entry, nbytes)
    entries.sort(key=lambda e: _hf_sort_key(e[0]))
    groups: list[list] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e[3] > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e[3]
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        for stale in (SINGLE_FILE, INDEX_FILE):
            if os.path.exists(os.path.join(path, stale)):
                os.remove(os.path.join(path, stale))
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config.to_hf_dict(), f, indent=2)
    n = len(groups)
    fnames = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                            for i in range(n)]
    weight_map = {}
    for fname, group in zip(fnames, groups):
        tensors = {name: _hf_tensor(v, e) for name, v, e, _ in group}
        if writer:
            save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        del tensors
    if writer and n > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": sum(e[3] for e in entries)},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return fnames


_LISTED = 12  # tensor names an error message lists before "and N more"
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def _name_list(names: list[str]) -> str:
    """``names`` as a list literal, cut after ``_LISTED`` with "and N more"."""
    head = repr(names[:_LISTED])
    return head if len(names) <= _LISTED else f"{head} and {len(names) - _LISTED} more"


def _layer_count_problem(num_layers: int, names, where: str) -> str | None:
    """Says how the layer indices of HF tensor ``names`` differ from ``range(num_layers)``.

    ``where`` names the config's source in the message. None when the tensors hold exactly layers 0 .. num_layers-1
    (each tensor of them is checked separately).
    """
    found = sorted({int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))})
    if found == list(range(num_layers)):
        return None
    spans, start = [], None
    for i, k in enumerate(found):
        start = k if start is None else start
        if i + 1 == len(found) or found[i + 1] != k + 1:
            spans.append(str(k) if start == k else f"{start}-{k}")
            start = None
    held = (f"layers {', '.join(spans)} ({len(found)} layer{'' if len(found) == 1 else 's'})"
            if found else "no layer")
    return (f"num_hidden_layers = {num_layers} in {where}, but the tensors hold {held} "
            "(model.layers.{i}.*): a missing or extra layer, or a wrong num_hidden_layers")


def _hf_sort_key(name: str):
    """Embedding first, then layers in numeric order, then final norm and head."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        e = re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.", name)
        return (1, int(m.group(1)), (1, int(e.group(1))) if e else (0, 0), name)
    return (0 if "embed_tokens" in name else 2, 0, (0, 0), name)


def _param_entries(model: Qwen3ForCausalLM) -> list:
    """(parameter value, TensorEntry) for every HF tensor of ``model``'s parameters."""
    return [(var.get_value(), e) for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
            for e in tensor_entries(_nnx_path_str(p), var.get_value().shape, model.config)]


def _hf_tensor(value: jax.Array, entry: TensorEntry) -> np.ndarray:
    """The host HF-layout tensor ``entry`` of a parameter value (one layer row if stacked)."""
    row = value if entry.layer is None else value[entry.layer]
    if entry.expert is not None:
        row = row[entry.expert]
    return to_hf_layout(_host_value(row), entry.num_in_axes)


def hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, np.ndarray]:
    """All parameters as an HF-named dict of host numpy arrays (small models / tests)."""
    return {e.name: _hf_tensor(value, e) for value, e in _param_entries(model)}


def load_hf_state_dict(model: Qwen3ForCausalLM, tensors: dict[str, Any]) -> Qwen3ForCausalLM:
    """Sets ``model``'s params in place from an HF-named dict of arrays (small models / tests).

    Raises ValueError naming missing/unexpected tensors or wrong shapes (and the layers the tensors hold when they are
    not the model's 0 .. L-1); the model is then left unchanged.
    """
    tensors = _unfuse(tensors)
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    layer_problem = _layer_count_problem(model.config.num_hidden_layers, tensors, "the model's config")
    seen = set()
    new_values = []  # every check passes before the first parameter is written
    for p, var in flat:
        shape = tuple(var.get_value().shape)
        entries = tensor_entries(_nnx_path_str(p), shape, model.config)
        arrays = {}
        for e in entries:
            if e.name not in tensors:
                raise ValueError(f"missing tensor {e.name!r}" + (f" ({layer_problem})" if layer_problem else ""))
            arrays[e.name] = np.asarray(tensors[e.name])
            want = hf_shape(e.shape, e.num_in_axes)
            if arrays[e.name].shape != want:
                raise ValueError(f"tensor {e.name!r} has shape {arrays[e.name].shape}, expected {want}")
            seen.add(e.name)
        new_values.append(_read_param(arrays, entries, shape, var.get_value().dtype,
                                      tuple(slice(None) for _ in shape)))
    extra = sorted(set(tensors) - seen - ({"lm_head.weight"} if model.config.tie_word_embeddings
                                          else set()), key=_hf_sort_key)
    if extra:
        raise ValueError(f"unexpected tensors: {_name_list(extra)}"
                         + (f" ({layer_problem})" if layer_problem else ""))
    for (_, var), full in zip(flat, new_values):
        var.set_value(jnp.asarray(full, var.get_value().dtype))
    nnx.update(model, state)
    return model
