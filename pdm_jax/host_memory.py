"""Host-memory allocator setting for XLA:CPU programs: freed buffers are reused, not unmapped.

XLA:CPU allocates every execution's temporary buffer with ``posix_memalign`` and frees it when the execution ends
(``Compiled.memory_analysis().temp_size_in_bytes``: 117 MB for the tiny config's RL train step). glibc serves a block
above its mmap threshold (32 MiB at most) with a fresh ``mmap`` and returns it with ``munmap``, so each execution
page-faults its whole temporary buffer in again, zero-filled by the kernel: 28.6k minor page faults and ~80 ms of kernel
time per tiny train step (``resource.getrusage``, measured on the 2-core CPU of docs/benchmarks.md), about 30% of the
step's CPU time.

:func:`reuse_freed_host_memory` sets glibc's ``mallopt`` so that large blocks come from the heap and stay mapped after
``free``: one arena (``M_ARENA_MAX = 1``: a block larger than a thread arena's 64 MiB heap would otherwise still be
mmapped), no mmapped blocks (``M_MMAP_MAX = 0``) and no trimming of the heap's top (``M_TRIM_THRESHOLD`` at its
maximum). The process then keeps its peak heap mapped; no value changes (the allocator places buffers, it computes
nothing). Called by ``pdm_jax.train``, `pdm_jax.trainer.Trainer` (first thing; so also for ``pdm_jax.analysis``) and the
sampler subprocess when ``host_memory.reuse_freed`` is true (the default). It is process-wide (later calls are no-ops)
and must run **before JAX starts its backend**: glibc gives each thread its malloc arena at the thread's first
allocation and ``M_ARENA_MAX`` does not move a thread that already has one, and a thread arena cannot hold a block above
its 64 MiB heap, so it still maps and unmaps such a block at every execution. Applied after ``jax.devices()`` (XLA's
thread pools exist then), the tiny RL step kept faulting its 89 MB temporary buffer in, ~40k minor faults per RL step,
and took 269 instead of 188 ms (docs/benchmarks.md, bench/bench_train_step.py); a late call is therefore logged as a
warning (`applied_late`).

Source: glibc ``malloc/malloc.c`` (``mallopt``, ``sysmalloc``) and ``mallopt(3)``.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger("pdm_jax.host_memory")

# mallopt(3) parameter numbers (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_TRIM_MAX = 2**31 - 1  # mallopt takes an int

_state = {"applied": None, "late": False}


def _jax_backend_started() -> bool:
    """Whether JAX has created its backends (and with them XLA's thread pools); False when JAX is not imported."""
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(xla_bridge, "backends_are_initialized", None)  # private API: absent -> assume not started
    return bool(started()) if started is not None else False


def reuse_freed_from_config(config) -> bool:
    """`reuse_freed_host_memory` when the config's ``host_memory.reuse_freed`` is true (absent: false); returns whether
    the setting is in effect. The one call of the trainer and of ``pdm_jax.train`` (before distributed initialisation,
    which starts JAX)."""
    return bool(config.get("host_memory", {}).get("reuse_freed")) and reuse_freed_host_memory()


def applied_late() -> bool:
    """True when `reuse_freed_host_memory` took effect after JAX had started its backend (see the module docstring)."""
    return bool(_state["late"])


def reuse_freed_host_memory() -> bool:
    """Makes glibc keep freed large blocks for reuse (see the module docstring); returns whether it did.

    Returns False, logging why, when the C library is not glibc (macOS, musl) or a ``mallopt`` call is refused; the run
    then continues with the default allocator (slower on CPU, same numbers). Idempotent: the first call's result is
    returned again.
    """
    if _state["applied"] is not None:
        return _state["applied"]
    ok = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.info("host_memory.reuse_freed: not glibc (%s %s); the default allocator is kept",
                 platform.system(), platform.libc_ver()[0] or "unknown libc")
    else:
        libc = ctypes.CDLL(None)
        results = [libc.mallopt(p, v) for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _TRIM_MAX))]
        ok = all(r == 1 for r in results)
        if not ok:
            log.warning("host_memory.reuse_freed: glibc refused mallopt (%s); the default allocator is kept", results)
    if ok and _jax_backend_started():
        _state["late"] = True
        log.warning("host_memory.reuse_freed: applied after JAX started its backend; threads that already "
                    "allocated keep their own malloc arenas, which still map and unmap blocks above 64 MiB at every "
                    "XLA execution (page faults). Call pdm_jax.host_memory.reuse_freed_host_memory() before the "
                    "first JAX operation, as pdm_jax.train does.")
    _state["applied"] = ok
    return ok
