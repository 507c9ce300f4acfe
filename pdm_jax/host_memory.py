"""Host-memory allocator setting for XLA:CPU programs: freed buffers are reused, not unmapped.

XLA:CPU allocates each execution's temporary buffer with ``posix_memalign`` (117 MB for the tiny RL step) and glibc
maps a block that large with a fresh ``mmap`` and unmaps it on ``free``, so every execution page-faults it in again,
zero-filled (docs/benchmarks.md). :func:`reuse_freed_host_memory` sets glibc's ``mallopt``: one arena (``M_ARENA_MAX
= 1``), no mmapped blocks (``M_MMAP_MAX = 0``), no trimming (``M_TRIM_THRESHOLD`` at its maximum); the process keeps
its peak heap mapped and no value changes. It is process-wide and must run **before JAX starts its backend** (a
thread keeps the arena it has; a late call is logged, `applied_late`). Source: glibc ``malloc/malloc.c``
(``mallopt``, ``sysmalloc``) and ``mallopt(3)``."""

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


def applied_late() -> bool:
    """True when `reuse_freed_host_memory` took effect after JAX had started its backend (see the module docstring)."""
    return bool(_state["late"])


def reuse_freed_host_memory() -> bool:
    """Makes glibc keep freed large blocks for reuse; returns whether it did (False, logged, on a C library other than
    glibc or a refused ``mallopt``: the default allocator, same numbers). Idempotent."""
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
