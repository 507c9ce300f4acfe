"""Test setup: 8 fake CPU devices for sharding tests, f32 everywhere, CPU only, no state carried between tests.

The pytest process never reads or writes JAX's persistent compilation cache (``jax_enable_compilation_cache``
is off here; in-process trainers still set its options, and subprocess runs, which the cache tests use, are
unaffected). Every segfault CI has seen came from XLA:CPU in this long-lived process while that cache was on:
deserializing a cached executable (a leaked cache, in test_trust_region) and twice in
test_vllm_backend's trainer run, whose fake server loads and compiles programs on its own thread while the
trainer's thread reads and writes the same cache.

Programs compile at XLA's default optimisation level. Level 0 (``--xla_backend_optimization_level=0``) compiled the
tiny programs faster (484 s vs 690 s for 8 compile-bound tests, side by side), but two of four CI runs
with it ended in a segfault inside XLA:CPU (once deserializing a cached executable, once compiling), late in the
session and not when the crashing tests ran alone; no run at the default level has crashed. ``XLA_FLAGS`` naming a
level still overrides it.
"""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The user cache directory (compile_cache.dir = "default": $XDG_CACHE_HOME/pdm_jax/jax_cache) is a fresh one per
# test session, removed at its end: tests never read programs another session (or a user's run) wrote.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pdm_jax_test_cache_")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)  # the cache's options may be set; it is never used

# Property tests draw the same examples on every run (a seed per test): a CI run cannot fail on an example no
# earlier run drew. A test's own @settings still override the other fields.
settings.register_profile("pdm_jax", derandomize=True, database=None)
settings.load_profile("pdm_jax")

_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture(autouse=True)
def _compile_cache_stays_in_its_test():
    """A test that sets JAX's persistent compilation cache options in this process (an in-process trainer or
    analysis run: `profiling.enable_compile_cache`) gets them reset afterwards, so that no later test runs
    with them (the cache stays unused here either way: ``jax_enable_compilation_cache`` is off)."""
    before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    yield
    if any(getattr(jax.config, name) != value for name, value in before.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
