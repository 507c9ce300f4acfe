"""Ahead-of-time compile targets: the devices of a TPU slice or a GPU pod, on a host that has neither.

The dry run (`pdm_jax.dry_run`) compiles the real jitted programs for the chips a config names from abstract inputs
and reads the compiler's memory plan and cost model; only the compiler is needed: ``tpu`` (XLA:TPU from libtpu, ``pip
install -e '.[tpu]'``; the slice's devices from ``jax.experimental.topologies.get_topology_desc``, as maxtext's
``train_compile.py``), ``gpu`` (XLA:GPU from the CUDA PJRT plugin, ``.[gpu-aot]``, deviceless from a
``GpuTargetConfigProto`` in ``pdm_jax/gpu_targets/``; Triton gemm autotuning off) or ``cpu`` (fake host devices). An
account of memory and FLOPs on that chip, never a measurement of its speed."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Optional

#: HBM per chip in GiB (vendor datasheets: TPU v4 32, v5e 16, v5p 95, v6e Trillium 32; H100 SXM 80; H200 141).
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "H100": 80, "H200": 141}
#: Peak dense bf16 FLOP/s per chip (vendor datasheets), for the roofline estimate only.
CHIP_PEAK_BF16_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12, "H100": 989e12,
                        "H200": 989e12}
#: Peak HBM bandwidth per chip in bytes/s (vendor datasheets), for the roofline estimate only.
CHIP_HBM_BYTES_PER_S = {"v4": 1.2e12, "v5e": 0.819e12, "v5p": 2.765e12, "v6e": 1.64e12, "H100": 3.35e12,
                        "H200": 4.8e12}
COMPILERS = ("auto", "none", "cpu", "tpu", "gpu")
#: Rentable slices by their cloud names -> (``dry_run.chip``, chips); a v5p-8 has 4 chips (Cloud TPU counts v4 / v5p
#: TensorCores). The recipes' ``slice=`` takes one of these.
SLICES = {"v5e-8": ("v5e", 8), "v6e-8": ("v6e", 8), "v5p-8": ("v5p", 4), "v5p-128": ("v5p", 64),
          "8xH100": ("H100", 8), "1xH100": ("H100", 1)}
#: Chips one host drives (one JAX process's local devices): a TPU VM host of v4 / v5p / v5e / v6e
#: slices of more than one host has 4 (libtpu's topologies say the same), an H100 / H200 host 8 GPUs.
CHIPS_PER_HOST = {"v4": 4, "v5e": 4, "v5p": 4, "v6e": 4, "H100": 8, "H200": 8}
#: TPU generations whose topology is a 3D torus (chips x y z); the others are 2D (x y).
_TPU_3D = ("v4", "v5p")
#: libtpu's device count per chip where it is not 1 (v4 without megacore: one device per TensorCore).
_TPU_DEVICES_PER_CHIP = {"v4": 2}
_GPU_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
#: chip -> the GpuTargetConfigProto text shipped with the project (XLA's published device specs).
GPU_TARGET_CONFIGS = {"H100": "h100_sxm.txtpb", "H200": "h200_sxm.txtpb"}
TPU_INSTALL_HINT = "install XLA:TPU with: pip install -e '.[tpu]'  (jax[tpu] at the project's jax pin)"
GPU_INSTALL_HINT = "install XLA:GPU with: pip install -e '.[gpu-aot]'  (the CUDA PJRT plugin at the jax pin)"


class CompilerUnavailable(RuntimeError):
    """The compiler a dry run asked for is not installed on this host (the message says how to install it)."""


def slice_target(name: str) -> tuple[str, int]:
    """``(dry_run.chip, dry_run.num_devices)`` of the slice ``name`` (`SLICES`).

    Raises:
      ValueError: ``name`` is not a key of `SLICES` (naming ``slice`` and the valid values).
    """
    if name not in SLICES:
        raise ValueError(f"slice = {name!r}: must be one of {list(SLICES)}")
    return SLICES[name]


def chip_platform(chip: str) -> str:
    """``"gpu"`` for the NVIDIA chips of `CHIP_HBM_GIB`, ``"tpu"`` for the others.

    Raises:
      ValueError: ``chip`` is not a key of `CHIP_HBM_GIB` (naming ``dry_run.chip``).
    """
    if chip not in CHIP_HBM_GIB:
        raise ValueError(f"dry_run.chip must be one of {sorted(CHIP_HBM_GIB)}, got {chip!r}")
    return "gpu" if chip.startswith("H") else "tpu"


def _balanced_factors(n: int, dims: int) -> list[int]:
    """``n`` (a power of two) as ``dims`` powers of two, as even as possible, ascending (64, 3 -> 4 4 4)."""
    exp = n.bit_length() - 1
    parts = [exp // dims + (1 if i < exp % dims else 0) for i in range(dims)]
    return sorted(1 << p for p in parts)


def default_topology(chip: str, num_devices: int) -> str:
    """The slice name of ``num_devices`` chips of ``chip``: ``v5p`` x 64 -> ``"v5p:4x4x4"``, ``v6e`` x 16 ->
    ``"v6e:4x4"``, ``H100`` x 64 -> ``"8x8"`` (near-cubic v4/v5p, near-square v5e/v6e; 4 v5p chips: ``2x2x1``).

    Raises:
      ValueError: ``num_devices`` is not a power of two >= 1 (naming ``dry_run.num_devices``)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1 \
            or num_devices & (num_devices - 1):
        raise ValueError(f"dry_run.num_devices must be a power of two >= 1 for a default dry_run.topology, "
                         f"got {num_devices!r} (or name dry_run.topology)")
    if chip_platform(chip) == "gpu":
        per_host = min(num_devices, 8)
        return f"{num_devices // per_host}x{per_host}"
    chips = num_devices // _TPU_DEVICES_PER_CHIP.get(chip, 1) or 1
    dims = 3 if chip in _TPU_3D else 2
    if dims == 3 and chips < 8:
        shape = {1: [1, 1, 1], 2: [1, 2, 1], 4: [2, 2, 1]}[chips]
    else:
        shape = _balanced_factors(chips, dims)
    return f"{chip}:" + "x".join(str(s) for s in shape)


def has_module(name: str) -> bool:
    """Whether the module ``name`` can be imported (False also when a parent package is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def compiler_available(compiler: str) -> bool:
    """Whether ``compiler`` ("cpu", "tpu", "gpu") can compile on this host (its plugin is installed)."""
    if compiler == "cpu":
        return True
    if compiler == "tpu":
        return has_module("libtpu")
    if compiler == "gpu":
        return has_module("jax_plugins.xla_cuda12") and has_module("jax_cuda12_plugin")
    raise ValueError(f"dry_run.compiler must be one of {COMPILERS}, got {compiler!r}")


def resolve_compiler(compiler: str, chip: str) -> str:
    """``dry_run.compiler`` with ``"auto"`` resolved: the chip's own compiler (``tpu`` / ``gpu``) when it is installed,
    else ``cpu``.

    Raises:
      ValueError: an unknown compiler name, or a TPU compiler asked for a GPU chip (and vice versa).
    """
    if compiler not in COMPILERS:
        raise ValueError(f"dry_run.compiler must be one of {COMPILERS}, got {compiler!r}")
    platform = chip_platform(chip)
    if compiler == "auto":
        return platform if compiler_available(platform) else "cpu"
    if compiler in ("tpu", "gpu") and compiler != platform:
        raise ValueError(f"dry_run.compiler = {compiler!r} cannot compile for dry_run.chip = {chip!r} "
                         f"(a {platform.upper()}); use dry_run.compiler = {platform!r}")
    return compiler


def _require(compiler: str) -> None:
    if not compiler_available(compiler):
        raise CompilerUnavailable(
            f"dry_run.compiler = {compiler!r}: XLA:{compiler.upper()} is not installed on this host; "
            + (TPU_INSTALL_HINT if compiler == "tpu" else GPU_INSTALL_HINT))


@functools.lru_cache(maxsize=8)
def _tpu_devices(topology: str) -> tuple:
    from jax.experimental import topologies

    # libtpu takes /tmp/libtpu_lockfile so that two processes never drive the same chips; a compile touches none, and
    # the dry runs of several processes (a test and its subprocess, two sweeps) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


@functools.lru_cache(maxsize=8)
def _gpu_devices(topology: str, chip: str) -> tuple:
    from jax.experimental import topologies

    with open(os.path.join(_GPU_TARGET_DIR, GPU_TARGET_CONFIGS[chip])) as f:
        target = f.read()
    hosts, per_host = (int(x) for x in topology.split("x"))
    name = f"1x{hosts}x{per_host}"  # slices x hosts per slice x GPUs per host
    return tuple(topologies.get_topology_desc(platform="cuda", topology_name=name, topology=name,
                                              target_config=target).devices)


def check_topology(topology: str, chip: str) -> None:
    """Refuses a ``dry_run.topology`` that cannot name a slice of ``chip``: a TPU slice is ``"<chip>:<x>x<y>[x<z>]"``
    (e.g. ``"v5p:4x4x4"``), a GPU pod ``"<hosts>x<GPUs per host>"`` with at most 8 GPUs per host (e.g. ``"8x8"``).

    Raises:
      ValueError: naming ``dry_run.topology``, the value and the expected form.
    """
    if chip_platform(chip) == "tpu":
        name, _, dims = topology.partition(":")
        if name != chip:
            raise ValueError(f"dry_run.topology = {topology!r} is not a slice of dry_run.chip = {chip!r} "
                             f"(e.g. {default_topology(chip, 64)!r})")
        parts = dims.split("x")
        if len(parts) != (3 if chip in _TPU_3D else 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"dry_run.topology = {topology!r}: a {chip} slice is "
                             f"{default_topology(chip, 64)!r}-shaped")
        return
    parts = topology.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) > 8:
        raise ValueError(f"dry_run.topology = {topology!r}: a GPU pod is '<hosts>x<GPUs per host>' with at most "
                         "8 GPUs per host, e.g. '8x8'")


def target_devices(compiler: str, chip: str, num_devices: int, topology: Optional[str] = None) -> list:
    """The ``num_devices`` devices a dry run compiles for: the first fake CPU devices (``cpu``), the devices of
    ``topology`` (``tpu``; default `default_topology`, the first of a one-host slice for fewer chips), or deviceless
    CUDA devices of ``chip`` (``gpu``, ``"<hosts>x<gpus per host>"``).

    Raises:
      CompilerUnavailable: the compiler's plugin is not installed (with the install command).
      ValueError: a topology that is not the chip's, that libtpu refuses, or of another device count, or too few CPU
        devices (naming the field and the value)."""
    import jax

    sub_slice = False
    if compiler in ("tpu", "gpu"):
        if topology:
            check_topology(topology, chip)
        elif compiler == "tpu" and num_devices < host_devices(chip):
            # libtpu builds no slice smaller than one host (v5p:1x1x1 is refused): compile on the first num_devices
            # chips of a one-host slice, as a job on part of a host would run.
            topology, sub_slice = default_topology(chip, host_devices(chip)), True
        else:
            topology = default_topology(chip, num_devices)
        if compiler == "gpu" and chip not in GPU_TARGET_CONFIGS:
            raise ValueError(f"dry_run.chip = {chip!r}: no GPU target config shipped "
                             f"(have {sorted(GPU_TARGET_CONFIGS)})")
    _require(compiler)
    if compiler == "cpu":
        devices = jax.devices()
        if len(devices) < num_devices:
            raise ValueError(f"dry_run.num_devices = {num_devices}: JAX has {len(devices)} CPU devices "
                             "(run the CLI with --dry_run, which sets up fake devices first)")
        return list(devices[:num_devices])
    if compiler == "tpu":
        try:
            devices = _tpu_devices(topology)
        except Exception as e:  # noqa: BLE001  (jax.errors.JaxRuntimeError: libtpu's refusal of the name)
            raise ValueError(f"dry_run.topology = {topology!r}: libtpu refuses it: {str(e).splitlines()[0]}") from None
    else:
        _gpu_flags()
        devices = _gpu_devices(topology, chip)
    if sub_slice:
        return list(devices[:num_devices])
    if len(devices) != num_devices:
        raise ValueError(f"dry_run.topology = {topology!r} has {len(devices)} devices but dry_run.num_devices = "
                         f"{num_devices}; make them agree")
    return list(devices)


def _gpu_flags() -> None:
    """Deviceless XLA:GPU cannot autotune Triton gemm tilings (it needs a device): use cuBLAS gemms."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_enable_triton_gemm" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_triton_gemm=false").strip()


def devices_per_process(devices) -> int:
    """Devices of the first process among ``devices`` (a TPU host's local chips, a GPU host's GPUs)."""
    first = devices[0].process_index
    return sum(1 for d in devices if d.process_index == first)


def host_devices(chip: str) -> int:
    """The devices of one host of ``chip`` (`CHIPS_PER_HOST` x devices per chip)."""
    return CHIPS_PER_HOST[chip] * _TPU_DEVICES_PER_CHIP.get(chip, 1)


def chips_per_host(chip: str, num_devices: int) -> int:
    """A host's local chips in a slice of ``num_devices`` ``chip`` chips (`host_devices`, at most the slice)."""
    return min(host_devices(chip), num_devices)


def label(compiler: str, chip: str, topology: Optional[str], num_devices: int) -> str:
    """How a report names a compile: ``"XLA:TPU v5p:4x4x4"``, ``"XLA:GPU 64 x H100"``, ``"XLA:CPU"``."""
    if compiler == "tpu":
        if not topology and num_devices < host_devices(chip):
            return f"XLA:TPU {default_topology(chip, host_devices(chip))} (its first {num_devices})"
        return f"XLA:TPU {topology or default_topology(chip, num_devices)}"
    if compiler == "gpu":
        return f"XLA:GPU {num_devices} x {chip}"
    return "XLA:CPU"


def cost_bytes_accessed(compiled) -> Optional[float]:
    """XLA's ``cost_analysis()["bytes accessed"]`` of a compiled program (per device), or None where it gives none. As
    `cost_flops`, a while loop's body counts once."""
    return _cost(compiled, "bytes accessed")


def cost_flops(compiled) -> Optional[float]:
    """XLA's ``cost_analysis()["flops"]`` of a compiled program (per device), or None where it gives none.

    XLA counts a while loop's body once, whatever its trip count (a ``lax.scan`` over 48 layers reports the FLOPs of
    one); `pdm_jax.dry_run.counted_flops` adds the iterations up.
    """
    return _cost(compiled, "flops")


def _cost(compiled, key: str) -> Optional[float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (some backends do not implement it)
        return None
    if isinstance(cost, (list, tuple)):
        cost = next((c for c in cost if isinstance(c, dict) and key in c), None)
    if not isinstance(cost, dict) or key not in cost:
        return None
    try:
        value = float(cost[key])
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value) and value >= 0 else None
