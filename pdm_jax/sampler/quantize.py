"""Sampler weight copies: f32, bf16, and fp8-e4m3 / int8 / int4 / int2 weight-only with per-output-channel scales.

The sampler generates from a *quantized copy* of the trainer's weights; the gap
between the sampler's distribution mu = softmax(z_q / tau) and the trainer's
pi = softmax(z / tau) is the off-policy gap the trust-region masks exist for
(DESIGN.md sections 1-2).

Representation (fp8).  Each matmul weight W is stored as
``qvalue = round_e4m3(W / scale)`` (``float8_e4m3fn``) with an f32 ``scale`` per
output channel, ``scale = max|W| / 448`` reduced over the contraction (input)
axes -- the usual symmetric absmax ("per-channel") weight-only fp8 scheme of
vLLM / TensorRT-LLM, computed with qwix's ``qwix.quantize`` (Google's JAX
quantization library).  The forward pass uses ``dequantize(W_q) = qvalue * scale``
cast once, at load, to the compute dtype (bf16 by default).  This is exactly what
a weight-only fp8 kernel computes (the fp8 values are upcast and rescaled before
the bf16/f32 MXU/FMA accumulation), up to the order of accumulation; we checked
that qwix's own model-level PTQ (``qwix.quantize_model`` with a weight-only
``float8_e4m3fn`` rule) gives the same outputs as dequantize-then-matmul to f32
rounding.  We do not use ``qwix.quantize_model`` itself: it rewrites the module
tree (params become ``{array: {qvalue, scale}}`` boxes found by intercepting
einsum/dot_general at trace time), which would have to be redone on every weight
sync and leaves lookups (embeddings) untouched, while CPU/XLA has no fp8 matmul
that would make keeping fp8 operands worthwhile.  Quantizing per tensor, with a
rule that names the output axes of each parameter of our own model, is explicit,
cheap to redo on every sync, and testable.

What is quantized (``fp8``, ``int8``, ``int4`` and ``int2`` alike): every >=2-D weight of the decoder layers (attention
q/k/v/o projections, MLP gate/up/down; for Qwen3-MoE the router and every expert's
gate/up/down, scales per (layer, expert, output channel)).  Embedding table, ``lm_head`` and the
RMSNorm scales stay in the compute dtype unless asked otherwise -- vLLM's fp8
default, because the output projection dominates the logit error per byte saved.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pdm_jax.sampler.defaults import MAX_WEIGHT_NOISE, QUANTIZATIONS  # defined JAX-free for the server's --help

#: The sampler's compute dtype choices (``sampler.compute_dtype``; resolved by ``engine.resolve_compute_dtype``).
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
#: Weight-only modes: the storage dtype of each quantized matmul weight.
WEIGHT_ONLY_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4, "int2": jnp.int2}
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0

# Path = tuple of str keys into the nested pure-dict parameter tree.
Path = Tuple[str, ...]


def default_compute_dtype(quantization: str):
    """The dtype the sampler computes in for a given quantization mode.

    ``none`` -> float32 (bit-compatible with the trainer), ``bf16`` -> bfloat16,
    ``fp8`` / ``int8`` / ``int4`` / ``int2`` -> bfloat16 (the weights are dequantized into bf16, as on TPU/GPU).
    Raises ValueError for an unknown mode.
    """
    check_quantization(quantization)
    return jnp.float32 if quantization == "none" else jnp.bfloat16


def check_quantization(quantization: str) -> str:
    """Returns `quantization` if it is one of QUANTIZATIONS, else raises ValueError."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; expected one of {QUANTIZATIONS}")
    return quantization


def check_weight_noise(weight_noise) -> float:
    """Returns `weight_noise` as a float if it is a finite number in [0, MAX_WEIGHT_NOISE], else raises ValueError
    naming ``weight_noise`` and the value."""
    if isinstance(weight_noise, bool) or not isinstance(weight_noise, (int, float, np.integer, np.floating)) \
            or not np.isfinite(weight_noise) or not 0.0 <= float(weight_noise) <= MAX_WEIGHT_NOISE:
        raise ValueError(f"weight_noise={weight_noise!r}; expected a finite relative std in [0, {MAX_WEIGHT_NOISE}]")
    return float(weight_noise)


def check_noise_seed(seed) -> int:
    """Returns `seed` as an int if it is an integer in [0, 2**32) (a weight-noise seed), else raises ValueError naming
    ``weight_noise_seed`` and the value."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"weight_noise_seed={seed!r}; expected an integer in [0, 2**32)")
    return int(seed)


def noise_output_axes(path: Path, shape: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The output axes of every matmul weight, the embedding table and ``lm_head`` included: the channels whose
    RMS scales the weight-noise lever (`prepare_sampler_params`' ``weight_noise``). None for RMSNorm scales."""
    return default_output_axes(path, shape, quantize_embedding=True, quantize_lm_head=True)


def _noised(w: jax.Array, axes: Tuple[int, ...], weight_noise: float, key) -> jax.Array:
    """``w + weight_noise * rms_c * N(0, 1)`` in f32, ``rms_c`` the RMS of ``w``'s output channel (its entries over
    every axis not in ``axes``): i.i.d. Gaussian noise of ``weight_noise`` times each channel's own size."""
    w = jnp.asarray(w, jnp.float32)
    reduce = tuple(i for i in range(w.ndim) if i not in axes)
    rms = jnp.sqrt(jnp.mean(jnp.square(w), axis=reduce, keepdims=True))
    # where w^2 overflows f32 (entries above ~1.8e19): the same RMS taken on the channel scaled by its max |w|
    top = jnp.max(jnp.abs(w), axis=reduce, keepdims=True)
    scaled = top * jnp.sqrt(jnp.mean(jnp.square(w / jnp.where(top > 0, top, 1.0)), axis=reduce, keepdims=True))
    rms = jnp.where(jnp.isfinite(rms), rms, scaled)
    return w + weight_noise * rms * jax.random.normal(key, w.shape, jnp.float32)


#: The noise's PRNG, named so that a process with another default (``JAX_DEFAULT_PRNG_IMPL``) draws the same copy.
NOISE_PRNG_IMPL = "threefry2x32"


def default_output_axes(path: Path, shape: Sequence[int], *, quantize_embedding: bool = False,
                        quantize_lm_head: bool = False) -> Optional[Tuple[int, ...]]:
    """Which axes of a Qwen3 parameter are *output channels* (each gets its own fp8 scale).

    Layouts are those of ``pdm_jax.models.qwen3`` (einsum kernels, input axes first):
    q/k/v_proj ``[D, N|K, H]`` -> output axes (1, 2) (one scale per head and head
    dim, reduced over D); o_proj ``[N, H, D]`` -> (2,) (reduced over N and H);
    gate/up ``[D, F]`` and down ``[F, D]`` -> (1,); MoE experts (``mlp.experts.*``) gate/up
    ``[E, D, I]`` and down ``[E, I, D]`` -> (0, 2) (per expert and output channel, reduced
    over the input axis); the MoE router ``mlp.gate`` ``[D, E]`` -> (1,); lm_head ``[D, V]`` -> (1,)
    (only with ``quantize_lm_head``); the embedding table ``[V, D]`` is a lookup,
    its channel is the row, (0,) (only with ``quantize_embedding``).

    Returns None for parameters that stay unquantized: 1-D RMSNorm scales and, by
    default, the embedding table and lm_head.

    Args:
      path: key path of the parameter in the nested pure dict, e.g.
        ``("layers", "self_attn", "q_proj", "kernel")`` for the scanned layout, whose
        layer parameters carry a leading layer axis [L, ...] (axis 0 is then an output
        axis too: every layer keeps its own scales), or the per-layer
        ``("layers", "0", "self_attn", "q_proj", "kernel")``; a mixed MoE model's
        ``("dense_layers", ...)`` stack is scanned-layout too.
      shape: the parameter's shape.
    """
    names = [str(p) for p in path]
    if len(names) > 1 and names[0] in ("layers", "dense_layers") and not names[1].isdigit():
        # Scanned layout: a leading layer axis [L, ...]; each layer keeps its own scales.
        inner = default_output_axes(("layers", "0") + tuple(names[1:]), tuple(shape)[1:],
                                    quantize_embedding=quantize_embedding,
                                    quantize_lm_head=quantize_lm_head)
        return None if inner is None else (0,) + tuple(a + 1 for a in inner)
    ndim = len(shape)
    if ndim < 2:
        return None
    if "embed_tokens" in names or names[-1] == "embedding":
        return (0,) if quantize_embedding else None
    if "lm_head" in names:
        return (ndim - 1,) if quantize_lm_head else None
    if "o_proj" in names:
        return (ndim - 1,)
    if "experts" in names:
        # Stacked MoE expert kernels gate/up [E, D, I], down [E, I, D]: every expert keeps
        # its own scales, one per output channel (reduced over the input axis only).
        return (0, ndim - 1)
    return tuple(range(1, ndim))


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A weight-only fp8 tensor: ``W ~= qvalue.astype(f32) * scale``.

    Attributes:
      qvalue: ``float8_e4m3fn`` array, same shape as the original weight.
      scale: float32 array, the weight's shape with every contraction (input)
        axis reduced to size 1 (broadcastable against ``qvalue``).
    """

    qvalue: jax.Array
    scale: jax.Array

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``qvalue * scale`` in f32, then cast to `dtype`."""
        return (self.qvalue.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_fp8(w: jax.Array, output_axes: Sequence[int]) -> Fp8Tensor:
    """fp8-e4m3 (``float8_e4m3fn``) symmetric absmax quantization, per output channel.

    scale[c] = max_{contraction axes} |W[..c..]| / 448 (an all-zero channel gets
    scale 0 and is stored as exact zeros); qvalue = round-to-nearest-even of
    W / scale in e4m3 (via ``qwix.quantize``, channelwise_axes = output_axes).

    Args:
      w: the weight, any float dtype, shape [...].
      output_axes: axes that get their own scale (see `default_output_axes`).
    Returns:
      Fp8Tensor with qvalue [...] float8_e4m3fn and scale f32 (reduced axes kept as 1).
    Raises:
      ValueError: if an axis is out of range or the weight is not finite.
    """
    import qwix  # local import: qwix pulls in flax.linen; only needed for fp8

    w = jnp.asarray(w, jnp.float32)
    axes = tuple(int(a) % w.ndim for a in output_axes)
    if any(a >= w.ndim or a < 0 for a in axes):
        raise ValueError(f"output_axes={tuple(output_axes)} out of range for shape {w.shape}")
    if not bool(jnp.all(jnp.isfinite(w))):
        raise ValueError(f"cannot quantize a weight with non-finite values (shape {w.shape})")
    qa = qwix.quantize(w, FP8_DTYPE, channelwise_axes=axes, calibration_method="absmax",
                       scale_dtype=jnp.float32)
    qvalue, scale = qa.qvalue, qa.scale.astype(jnp.float32)
    if qvalue.dtype != FP8_DTYPE:  # qwix keeps the logical qtype as storage for fp8
        qvalue = qvalue.astype(FP8_DTYPE)
    return Fp8Tensor(qvalue=qvalue, scale=scale)


def _map_with_path(fn: Callable[[Path, Any], Any], tree: Mapping, prefix: Path = ()) -> dict:
    out = {}
    for k, v in tree.items():
        p = prefix + (str(k),)
        if isinstance(v, Mapping):
            out[k] = _map_with_path(fn, v, p)
        else:
            out[k] = fn(p, v)
    return out


def quantize_params_fp8(params: Mapping, *, output_axes_fn: Callable = default_output_axes) -> dict:
    """Quantizes a nested pure-dict parameter tree; leaves become Fp8Tensor or stay arrays.

    Args:
      params: nested dict of arrays (``nnx.State.to_pure_dict()`` of the model).
      output_axes_fn: ``(path, shape) -> axes or None`` (None = keep as is).
    Returns:
      the same tree with the selected leaves replaced by Fp8Tensor.
    """
    def q(path, x):
        axes = output_axes_fn(path, tuple(np.shape(x)))
        return x if axes is None else quantize_fp8(x, axes)
    return _map_with_path(q, params)


def dequantize_params(params: Mapping, dtype) -> dict:
    """Fp8Tensor leaves -> dequantized arrays in `dtype`; other leaves cast to `dtype`."""
    def dq(path, x):
        if isinstance(x, Fp8Tensor):
            return x.dequantize(dtype)
        return jnp.asarray(x).astype(dtype)
    return _map_with_path(dq, params)


def _named_leaves(tree: Mapping, prefix: Path = ()) -> list:
    """``[(path of str keys, leaf)]`` of a nested dict, in `_map_with_path` order."""
    out = []
    for k, v in tree.items():
        p = prefix + (str(k),)
        out.extend(_named_leaves(v, p) if isinstance(v, Mapping) else [(p, v)])
    return out


def _rebuild(tree: Mapping, leaves) -> dict:
    """`tree`'s nested-dict structure (original keys) holding `leaves` in `_named_leaves` order."""
    it = iter(leaves)
    return _map_with_path(lambda _p, _x: next(it), tree)


def _prepare_fn(leaves: list, noise_seed=None, *, quantization: str, dtype, axes: tuple, checked: tuple,
                weight_noise: float = 0.0, noise_axes: tuple = ()) -> tuple:
    """All leaves of a tree in one program: (prepared leaves, a "holds NaN/inf" flag per ``checked`` leaf).

    With ``weight_noise`` > 0, leaf i with ``noise_axes[i]`` not None first gets `_noised` with the key
    ``fold_in(key(noise_seed), i)`` (a uint32 seed, traced: one program for every seed), then the quantization.

    The flag is an OR-reduction of ``~isfinite(x)`` (exact across shards; ``max|x|`` is not:
    an all-reduce max can drop a NaN), cheaper than counting the non-finite values, which is
    done only when a flag is set, for the error message.

    Per leaf, exactly the operations of the eager path (`quantize_fp8` +
    `Fp8Tensor.dequantize`, or the casts of `dequantize_params`).
    """
    out, bad = [], []
    for i, (x, ax, check) in enumerate(zip(leaves, axes, checked)):
        if weight_noise and noise_axes[i] is not None:
            key = jax.random.fold_in(jax.random.key(noise_seed, impl=NOISE_PRNG_IMPL), i)
            x = _noised(x, noise_axes[i], weight_noise, key)
        if check:  # after the noise: a finite weight whose noised copy overflows is refused too
            bad.append(jnp.any(~jnp.isfinite(jnp.asarray(x))))
        if quantization in WEIGHT_ONLY_DTYPES and ax is not None:
            w = jnp.asarray(x, jnp.float32)
            out.append(_weight_only_dequantized(w, ax, dtype, WEIGHT_ONLY_DTYPES[quantization]))
        elif quantization == "bf16":
            out.append(jnp.asarray(x).astype(jnp.bfloat16).astype(dtype))
        else:
            out.append(jnp.asarray(x).astype(dtype))
    return out, bad


_STATIC = ("quantization", "dtype", "axes", "checked", "weight_noise", "noise_axes")
_prepare_program = jax.jit(_prepare_fn, static_argnames=_STATIC)


@functools.lru_cache(maxsize=None)
def _prepare_program_to(out_sharding) -> Callable:
    """`_prepare_fn` jitted with every output placed by ``out_sharding`` (one program per sharding)."""
    return jax.jit(_prepare_fn, static_argnames=_STATIC, out_shardings=out_sharding)


@functools.lru_cache(maxsize=None)
def _prepare_program_sharded(target: tuple) -> Callable:
    """`_prepare_fn` jitted with output leaf i placed by ``target[i]`` (a sharded engine's layout) and the
    finiteness flags replicated on the same mesh."""
    flags = jax.sharding.NamedSharding(target[0].mesh, jax.sharding.PartitionSpec())
    return jax.jit(_prepare_fn, static_argnames=_STATIC, out_shardings=(list(target), flags))


def _on_device(x, device):
    """The copy of a fully replicated (or single-device) ``x`` that lives on ``device``, no transfer; else None."""
    if not isinstance(x, jax.Array) or device not in x.sharding.device_set or not x.sharding.is_fully_replicated:
        return None
    return next((s.data for s in x.addressable_shards if s.device == device), None)


def _placement(leaves: list, device) -> tuple:
    """``(program inputs, out_sharding, mesh or None)``: where the preparation runs to land on ``device``.

    * every array leaf already on ``device`` or replicated over devices that include it
      (data-parallel training): its replica there (no copy), and the program runs on
      ``device`` alone;
    * leaves sharded over one mesh (FSDP / tensor parallel): the program runs on that
      mesh with replicated outputs (the gather is part of it); the caller then takes
      the replica on ``device`` (`_take`);
    * anything else (several meshes, other shardings): transferred to ``device`` first.
    Host (numpy) leaves go wherever the program runs.
    """
    target = jax.sharding.SingleDeviceSharding(device)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    local = [_on_device(x, device) for x in leaves]
    if all(r is not None or not isinstance(x, jax.Array) for x, r in zip(leaves, local)):
        return [x if r is None else r for x, r in zip(leaves, local)], target, None
    meshes = {x.sharding.mesh for x in arrays if isinstance(x.sharding, jax.sharding.NamedSharding)}
    if len(meshes) == 1 and all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in arrays):
        mesh = meshes.pop()
        return leaves, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), mesh
    return [jax.device_put(x, target) if isinstance(x, jax.Array) else x for x in leaves], target, None


def _take(x: jax.Array, device) -> jax.Array:
    """The replica of a replicated ``x`` on ``device`` (no copy), or a transfer when ``device`` holds none."""
    local = _on_device(x, device)
    return local if local is not None else jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


def _weight_only_dequantized(w: jax.Array, axes: Tuple[int, ...], dtype, qtype) -> jax.Array:
    """``qvalue * scale`` of qwix's per-channel absmax quantization of ``w`` to ``qtype``, cast to ``dtype``.

    fp8 (``float8_e4m3fn``): exactly ``quantize_fp8(w, axes).dequantize(dtype)`` without the host-side
    finiteness check (traceable). int8: qwix's convention, ``scale = max|W| / 127.5`` per output
    channel, ``qvalue = clip(round_half_even(W * (1 / scale)), -128, 127)``; int4 the same with
    ``max|W| / 7.5`` and ``[-8, 7]``. A channel's largest |W| lands on +-127.5 (+-7.5): the positive
    one is clipped to 127 (7), the negative one becomes -128 or -127 (-8 or -7) by the f32 rounding of
    ``W * (1 / scale)``, so the extreme weight loses up to 1/255 (int4: 1/15) of its size.
    """
    import qwix  # local import: qwix pulls in flax.linen; only needed for fp8 / int8 / int4 / int2

    qa = qwix.quantize(w, qtype, channelwise_axes=axes, calibration_method="absmax", scale_dtype=jnp.float32)
    qvalue = qa.qvalue if qa.qvalue.dtype == qtype else qa.qvalue.astype(qtype)
    return (qvalue.astype(jnp.float32) * qa.scale.astype(jnp.float32)).astype(dtype)


def prepare_sampler_params(params: Mapping, quantization: str, *, compute_dtype=None,
                           output_axes_fn: Callable = default_output_axes, check_finite: bool = True,
                           device=None, check_all_finite: bool = False, shardings: Optional[Mapping] = None,
                           weight_noise: float = 0.0, noise_seed: int = 0) -> dict:
    """The parameter tree the sampler computes with, for a quantization mode, built once per weights version.

    ``none``: the f32 weights unchanged (cast to `compute_dtype`, default f32).
    ``bf16``: every leaf rounded to bfloat16 (then cast to `compute_dtype`).
    ``fp8``: matmul weights quantized to fp8-e4m3 per output channel and
    dequantized (``qvalue * scale`` in f32) into `compute_dtype`; other leaves cast to it.
    ``int8``: the same with int8 per output channel (qwix's absmax scheme, scale
    ``max|W| / 127.5``): the weight-only int8 that TPU v5e/v5p/v6e run natively.
    ``int4``: the same with int4 (scale ``max|W| / 7.5``, values in [-8, 7]), one scale per whole
    output channel (no groups): about 11% relative error per weight on a Gaussian matrix against
    int8's 0.65% and fp8's 2.6% -- a coarse copy whose persistent offset from the trainer's weights is
    the behaviour/trainer mismatch lever (the analogue of the paper's FP8 stress; docs/sampler.md).
    ``int2``: the same with int2 (scale ``max|W| / 1.5``, values in [-2, 1]: four levels per output channel),
    about 59% relative error per weight on a Gaussian matrix: no model serves from it, it is a stress lever
    coarser than int4 whose copy, unlike `weight_noise`'s, has fixed points (weights already on the grid).
    With ``compute_dtype`` float32 the bf16 / fp8 weights keep their rounded /
    dequantized values exactly; with bfloat16 the fp8 dequantized values are
    rounded once more, to bf16.  The whole tree is one jitted program (compiled
    once per tree structure and dtype; ~1 ms on the tiny model against ~20 ms
    leaf by leaf), bit-identical to the eager `quantize_params_fp8` /
    `dequantize_params` path (tests/test_sampler_quantize.py).

    ``weight_noise`` > 0 (``sampler.weight_noise``, the dialable persistent-mismatch lever, docs/sampler.md) first
    adds i.i.d. Gaussian noise to every matmul weight, the embedding table and ``lm_head``: each entry gets
    ``weight_noise`` times the RMS of its output channel (`noise_output_axes`; the scanned layers' leading axis
    counts as one, so each layer keeps its own) times a standard normal draw, then the quantization applies to
    the noised weight. The standard normal draws depend on ``noise_seed`` and the leaf's position in the tree
    only, not on the weights version, the device, the sharding or the process's default PRNG (threefry, named:
    `NOISE_PRNG_IMPL`; partitionable); each version scales them by its own channel RMS. The copy thus carries a
    persistent offset that no weight update closes, like a quantization error, but of a chosen size (0.1: about
    int4's per-weight error, 9-11% on random matrices). Sharded, the channel RMS is reduced in another order: the
    values match the single-device copy to float32 rounding before the quantization, so an int8 / int4 entry at a
    rounding boundary (about 1 in 10^4) can land one level away. RMSNorm scales are not noised. 0 (the default):
    exactly the program without noise.

    Args:
      params: nested pure dict of float arrays (trainer weights, any float dtype).
      quantization: one of QUANTIZATIONS.
      compute_dtype: dtype of the returned leaves (default: `default_compute_dtype`).
      output_axes_fn: ``(path, shape) -> output axes or None`` (fp8; see `default_output_axes`).
      check_finite: refuse non-finite fp8 weights (waits for the program); False for weights
        already checked (`weights.load_weights` refuses NaN/inf): the program then runs
        asynchronously, overlapping whatever the caller does next.
      device: a ``jax.Device``: the returned leaves live on it alone (the sampling layout of
        a colocated engine), whatever the inputs' sharding: replicated inputs contribute
        their replica on `device`; inputs sharded over a mesh (FSDP / tensor parallel) are
        gathered inside the same program (replicated output on that mesh, whose replica
        on `device` is kept).  The outputs never share a buffer with the inputs (a
        trainer may donate its parameters to the next optimizer step).  None: where the
        inputs are (host inputs: the default device), as before.
      check_all_finite: with `check_finite`, count NaN/inf in every float leaf, not only the
        quantized ones (in-memory weights that no file load has checked).
      shardings: a nested dict like `params` holding a ``NamedSharding`` per leaf (a sharded
        engine's layout, `pdm_jax.sharding.param_shardings` on its mesh): every input is moved to
        its leaf's sharding (from the host, one device or another mesh) and the program's outputs
        land there, so the quantized copy is sharded exactly like the f32 weights (per-channel
        scales reduce across shards inside the program; the values equal the unsharded ones).
        Excludes `device`.
      weight_noise: relative std of the noise (dimensionless, in [0, MAX_WEIGHT_NOISE]); 0 = none.
      noise_seed: the noise's seed, an integer in [0, 2**32).
    Returns:
      nested dict of arrays in `compute_dtype`, same structure as `params`.
    Raises:
      ValueError: unknown quantization, `weight_noise` or `noise_seed` out of range, or a non-finite weight
        (fp8; every leaf with `check_all_finite`), naming the parameter and the count.
    """
    check_quantization(quantization)
    weight_noise = check_weight_noise(weight_noise)
    noise_seed = check_noise_seed(noise_seed)
    dtype = jnp.dtype(compute_dtype or default_compute_dtype(quantization))
    named = _named_leaves(params)
    axes = tuple(output_axes_fn(p, tuple(np.shape(x))) if quantization in WEIGHT_ONLY_DTYPES else None
                 for p, x in named)
    axes = tuple(None if a is None else tuple(int(i) % len(np.shape(x)) for i in a) for a, (_, x) in zip(axes, named))
    checked = tuple(a is not None or (check_finite and check_all_finite and jnp.issubdtype(x.dtype, jnp.floating))
                    for a, (_, x) in zip(axes, named))
    leaves = [x for _, x in named]
    noise = dict(weight_noise=weight_noise,
                 noise_axes=tuple(noise_output_axes(p, tuple(np.shape(x))) for p, x in named) if weight_noise else ())
    seed = np.uint32(noise_seed) if weight_noise else None
    if shardings is not None:
        if device is not None:
            raise ValueError("prepare_sampler_params: give either device or shardings, not both")
        where = dict(_named_leaves(shardings))
        missing = [p for p, _ in named if p not in where]
        if missing:
            raise ValueError(f"prepare_sampler_params: shardings lack parameter {'/'.join(missing[0])}")
        target = tuple(where[p] for p, _ in named)
        leaves = [x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s)
                  for x, s in zip(leaves, target)]
        out, bad = _prepare_program_sharded(target)(leaves, seed, quantization=quantization, dtype=dtype, axes=axes,
                                                    checked=checked, **noise)
    elif device is None:
        out, bad = _prepare_program(leaves, seed, quantization=quantization, dtype=dtype, axes=axes, checked=checked,
                                    **noise)
    else:
        leaves, out_sharding, mesh = _placement(leaves, device)
        out, bad = _prepare_program_to(out_sharding)(leaves, seed, quantization=quantization, dtype=dtype, axes=axes,
                                                      checked=checked, **noise)
        if mesh is not None:
            out = [_take(x, device) for x in out]
    if bad and check_finite:
        flags = jax.device_get(bad)
        checked_leaves = [(p, x) for (p, x), c in zip(named, checked) if c]
        for (path, x), flag in zip(checked_leaves, flags):
            if flag:
                count = int(jnp.sum(~jnp.isfinite(jnp.asarray(x))))
                raise ValueError(f"cannot quantize a weight with non-finite values: {'/'.join(path)} holds "
                                 f"{count} NaN/inf value(s)")
    return _rebuild(params, out)


def relative_errors(reference: Mapping, approx: Mapping) -> dict:
    """Relative Frobenius error ||W - W_q||_F / ||W||_F per leaf, as {"a/b/c": float}.

    Both trees must have the same structure; leaves are compared in f32.
    A zero reference tensor reports 0 if the approximation is zero too, else inf.
    """
    out = {}

    def rec(a, b, prefix):
        for k, v in a.items():
            p = prefix + (str(k),)
            if isinstance(v, Mapping):
                rec(v, b[k], p)
            else:
                w = np.asarray(jnp.asarray(v, jnp.float32), np.float64)
                wq = b[k].dequantize(jnp.float32) if isinstance(b[k], Fp8Tensor) else b[k]
                wq = np.asarray(jnp.asarray(wq, jnp.float32), np.float64)
                num, den = np.linalg.norm(w - wq), np.linalg.norm(w)
                out["/".join(p)] = float(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))
    rec(reference, approx, ())
    return out
