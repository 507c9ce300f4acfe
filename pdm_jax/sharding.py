"""Device mesh, logical-axis rules and partition specs for params and activations.

Mesh axes ``("data", "fsdp", "tensor")``: data parallelism, data parallelism with parameters sharded on ``embed``
(ZeRO-3 style) and Megatron-style tensor parallelism over heads / MLP / vocab. Parameters carry *logical* axis names
in their NNX ``out_sharding`` metadata; a *rules* table of ``(logical_name, mesh_axis | tuple | None)`` pairs (flax's
convention, first match wins) maps them to mesh axes. ``logical_to_spec`` uses a mesh axis at most once per array and
drops one that does not divide the dimension (8 kv heads on a 16-way ``tensor`` axis are replicated). ``constrain(x,
logical_axes)`` at the model's block boundaries is a no-op unless a mesh is active while tracing (``jax.set_mesh`` or
``activation_sharding``). Meshes from ``make_mesh`` have ``AxisType.Auto`` axes::

    mesh = make_mesh(data=1, fsdp=-1, tensor=4)
    model = shard_model(model, mesh)                # or from_pretrained(path, mesh=mesh)
    graphdef, state = nnx.split(model)
    with activation_sharding(mesh):
        logits = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, ids)"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, MeshAxes], ...]

# Logical axis -> mesh axes. Parameters: embed over fsdp; heads/kv_heads/mlp/vocab over tensor; norms and head_dim
# replicated. Activations: batch over (data, fsdp).
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    # Qwen3-MoE expert kernels [E, ...]: expert parallelism over fsdp (each fsdp shard holds E/fsdp whole experts; their
    # embed axis then stays unsharded, as fsdp is taken).
    ("expert", "fsdp"),
)



@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over ``("data", "fsdp", "tensor")``; one entry may be -1 (= the rest). ValueError (naming the field)
    for sizes 0 or < -1, more than one -1, or a product other than the device count."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if not isinstance(size, int) or size == 0 or size < -1:
                raise ValueError(f"MeshConfig.{name} must be a positive int or -1, got {size!r}")
        free = [n for n, s in sizes.items() if s == -1]
        if len(free) > 1:
            raise ValueError(f"MeshConfig: only one axis may be -1, got {free}")
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if free:
            if num_devices % fixed:
                raise ValueError(
                    f"MeshConfig: {num_devices} devices not divisible by the fixed axes "
                    f"{ {n: s for n, s in sizes.items() if s != -1} } (product {fixed})")
            sizes[free[0]] = num_devices // fixed
        if math.prod(sizes.values()) != num_devices:
            raise ValueError(
                f"MeshConfig: data*fsdp*tensor = {math.prod(sizes.values())} != "
                f"{num_devices} devices ({sizes})")
        return sizes["data"], sizes["fsdp"], sizes["tensor"]

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        return make_mesh(data=self.data, fsdp=self.fsdp, tensor=self.tensor, devices=devices)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` with ``AxisType.Auto`` axes ``("data", "fsdp", "tensor")`` of sizes ``data, fsdp, tensor`` (one may be
    -1) over ``devices`` (default ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = MeshConfig(data=data, fsdp=fsdp, tensor=tensor).axis_sizes(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * 3
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


# ---- Logical -> physical ---------------------------------------------------------------------------------


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _lookup(rules: Rules, name: str | None) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            return _as_tuple(mesh_axes)
    raise ValueError(f"logical axis {name!r} has no rule; rules cover {[r[0] for r in rules]}")


def _mesh_shape(mesh: Mesh | jax.sharding.AbstractMesh | None) -> Mapping[str, int] | None:
    return None if mesh is None else dict(mesh.shape)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims have the given logical names (None = replicated) under ``rules``; with
    ``mesh`` and ``shape``, mesh axes missing or not dividing the dimension are dropped.

    Raises:
      ValueError: a logical name without a rule, or ``shape`` rank != len(logical_axes)."""
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} has rank {len(shape)} but logical axes "
                         f"{tuple(logical_axes)} have {len(logical_axes)}")
    sizes = _mesh_shape(mesh)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        kept = []
        remaining = None if shape is None else shape[dim]
        for axis in _lookup(rules, name):
            if axis in used:
                continue
            if sizes is not None:
                if axis not in sizes:
                    continue
                if remaining is not None:
                    if remaining % sizes[axis]:
                        continue
                    remaining //= sizes[axis]
            kept.append(axis)
            used.add(axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def _param_state(model_or_state) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def param_logical_axes(model_or_state) -> nnx.State:
    """State tree (like ``nnx.state(model, nnx.Param)``) of each param's logical-axis tuple.

    Raises ValueError naming the parameter path if one lacks ``out_sharding`` metadata.
    """
    state = _param_state(model_or_state)

    def get(path, var):
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter {'/'.join(map(str, path))} has no logical axes "
                             "(out_sharding metadata)")
        return tuple(axes)

    return nnx.map_state(get, state)


def param_partition_specs(model_or_state, rules: Rules = DEFAULT_RULES,
                          mesh: Mesh | None = None) -> nnx.State:
    """A ``PartitionSpec`` for every parameter of ``model_or_state`` (an NNX module, abstract or concrete, or its
    ``nnx.Param`` state), as a State of the same structure; with ``mesh``, non-dividing axes are dropped."""
    state = _param_state(model_or_state)

    def spec(path, var):
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter {'/'.join(map(str, path))} has no logical axes "
                             "(out_sharding metadata)")
        return logical_to_spec(axes, rules, mesh, var.get_value().shape)

    return nnx.map_state(spec, state)


def param_shardings(model_or_state, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``NamedSharding`` for every parameter (``param_partition_specs`` on ``mesh``)."""
    specs = param_partition_specs(model_or_state, rules, mesh)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Moves every parameter of ``model`` onto its ``NamedSharding`` (in place); returns it."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


KV_CACHE_K_AXES = ("batch", "kv_heads", "head_dim", "length")
KV_CACHE_V_AXES = ("batch", "kv_heads", "length", "head_dim")


def kv_cache_specs(cache, rules: Rules = DEFAULT_RULES, mesh: Mesh | None = None):
    """PartitionSpecs of a ``pdm_jax.models.qwen3.KVCache`` (keys [B, K, H, S] by ``KV_CACHE_K_AXES``, values [B, K, S,
    H] by ``KV_CACHE_V_AXES``), non-dividing axes replicated with ``mesh``."""
    return type(cache)(
        k=tuple(logical_to_spec(KV_CACHE_K_AXES, rules, mesh, k.shape) for k in cache.k),
        v=tuple(logical_to_spec(KV_CACHE_V_AXES, rules, mesh, v.shape) for v in cache.v))


# ---- Activation constraints ------------------------------------------------------------------------------

_ACTIVE_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar(
    "pdm_jax_sharding_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[Rules]:
    """Sets the rules ``constrain`` uses (default ``DEFAULT_RULES``) within the block."""
    token = _ACTIVE_RULES.set(tuple(rules))
    try:
        yield rules
    finally:
        _ACTIVE_RULES.reset(token)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[Mesh]:
    """``jax.set_mesh(mesh)`` + ``use_rules(rules)``: activates ``constrain`` (trace inside)."""
    with jax.set_mesh(mesh), use_rules(rules):
        yield mesh


def target_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of the mesh set by ``jax.set_mesh`` while tracing, else
    ``jax.default_backend()``, so an ahead-of-time compile for a TPU slice on a CPU host picks TPU kernels."""
    from jax._src import mesh as mesh_lib  # the concrete mesh of jax.set_mesh (public get_mesh refuses under jit)

    mesh = mesh_lib.get_concrete_mesh()
    if mesh is not None and not mesh.empty:
        platform = mesh.devices.flat[0].platform
    else:
        platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def active_rules() -> Rules:
    """The logical-axis rules in force (set by `use_rules` / `activation_sharding`)."""
    return _ACTIVE_RULES.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` of ``x`` by logical axes (``active_rules()``, non-dividing axes dropped) when a mesh
    is set, else ``x``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(logical_axes, active_rules(), mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, spec)
