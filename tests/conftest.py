"""Test setup: 8 fake CPU devices for sharding tests, f32 everywhere, CPU only, fast compiles.

The tests' tiny programs spend most of their time in XLA's compiler, so they are compiled with LLVM's
optimisation level 0 (``--xla_backend_optimization_level=0``; run with ``XLA_FLAGS`` naming another level to
override it). Side by side on this project's 2-core CPU (tests/test_param_jvp_mask.py's explicit-gradient test and
tests/test_chunked_loss.py, 8 tests, both runs at once): 484 s at level 0 against 690 s at the default. Float
semantics do not depend on the level (no fast-math either way), but the rounding of two *different* programs can
differ by an ulp where it happened to agree at the default level, so tests comparing two programs use a
tolerance. Subprocesses that inherit this environment (sampler servers) compile at the same level; the CLI and
multi-process tests set their own ``XLA_FLAGS`` and run at the default, like a user's run.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags
