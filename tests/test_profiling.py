"""profiling: phase timers, the compilation-cache directory choice and compile counting (the persistent
cache itself across processes is exercised by tests/test_trainer.py's end-to-end run)."""
import os
import time

import jax
import jax.numpy as jnp
import pytest

from pdm_jax import profiling


def test_phase_timer_adds_up_and_names_unknown_phases():
    timer = profiling.PhaseTimer(("a", "b"))
    with timer.phase("a"):
        time.sleep(0.02)
    with timer.phase("a"):  # entered twice: adds up
        time.sleep(0.01)
    timer.add("b", 0.5)
    time.sleep(0.01)
    rec = timer.record()
    assert set(rec) == {"time_a", "time_b", "time_other", "time_step"}
    assert 0.03 <= rec["time_a"] < 0.3 and rec["time_b"] == 0.5
    assert rec["time_other"] == 0.0  # b was measured elsewhere: longer than the step, clamped at 0
    with pytest.raises(ValueError, match="unknown phase 'c'"):
        with timer.phase("c"):
            pass


def test_step_timing_fields():
    phases = dict(time_sampling=1.0, time_scoring=0.1, time_advantages=0.2, time_optimizer=2.0,
                  time_weight_sync=0.05, time_eval=3.0, time_checkpoint=0.5, time_other=0.15, time_step=7.0)
    rec = profiling.step_timing(phases, {"save": 0.02, "load": 0.03}, 0.9)
    assert rec["step_seconds"] == pytest.approx(3.5) and rec["generate_seconds"] == 1.0
    assert rec["train_seconds"] == 2.0 and rec["time_weight_save"] == 0.02 and rec["time_sampler_generate"] == 0.9
    assert "time_step" not in rec
    comp = profiling.compile_record(dict(compiles=3, compile_seconds=1.5, compile_cache_hits=1,
                                         compile_cache_misses=2), None)
    assert comp == dict(compiles=3.0, compile_seconds=1.5, compile_cache_hits=1.0, sampler_compiles=0.0,
                        sampler_compile_seconds=0.0, sampler_compile_cache_hits=0.0)


def test_compile_cache_directory_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profiling.resolve_compile_cache_dir("default") == str(tmp_path / "xdg" / "pdm_jax" / "jax_cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert profiling.default_compile_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "pdm_jax",
                                                                 "jax_cache")
    assert profiling.resolve_compile_cache_dir("workdir", str(tmp_path)) == str(tmp_path / "jax_cache")
    assert profiling.resolve_compile_cache_dir("", str(tmp_path)) == ""
    assert profiling.resolve_compile_cache_dir("rel/dir") == os.path.abspath("rel/dir")
    with pytest.raises(ValueError, match="'workdir' needs a run directory"):
        profiling.resolve_compile_cache_dir("workdir")
    assert profiling.enable_compile_cache("") is False


def test_enable_compile_cache_sets_jax_options(tmp_path):
    import jax

    assert profiling.enable_compile_cache(str(tmp_path / "c")) is True
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_compilation_cache_max_size == profiling.COMPILE_CACHE_MAX_BYTES  # locked reads and writes


def test_the_test_run_shares_compiled_programs_across_modules_through_its_own_cache():
    """tests/conftest.py gives the test run (all pytest-xdist workers) one fresh persistent cache: a program
    compiled in one module is loaded, not compiled, after the module's end drops it (`jax.clear_caches`)."""
    import conftest

    assert jax.config.jax_compilation_cache_dir == conftest.TEST_RUN_COMPILE_CACHE
    assert conftest.TEST_RUN_COMPILE_CACHE.startswith(os.environ["PDM_JAX_TEST_RUN_DIR"])
    assert os.path.basename(os.environ["PDM_JAX_TEST_RUN_DIR"]).startswith("pdm_jax_test_run_")
    x = jax.device_put(jnp.ones(13))  # its programs built before counting
    f = jax.jit(lambda x: jnp.tanh(x) * 7.0 - 3.0)
    counter = profiling.CompileCounter()
    want = f(x)
    first = counter.snapshot()
    assert first["compiles"] == 1 and first["compile_cache_misses"] == 1 and first["compile_cache_hits"] == 0
    jax.clear_caches()  # what the end of a module does
    got = f(x)
    second = counter.snapshot()
    assert second["compiles"] == 2 and second["compile_cache_hits"] == 1 and second["compile_cache_misses"] == 1
    assert jnp.array_equal(got, want)


def test_the_compile_cache_of_the_previous_test_is_the_runs_again():
    """tests/conftest.py resets the cache options that a test set in this process
    (`test_enable_compile_cache_sets_jax_options`) to the test run's own cache."""
    import conftest

    assert jax.config.jax_compilation_cache_dir == conftest.TEST_RUN_COMPILE_CACHE
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert jax.config.jax_compilation_cache_max_size == conftest.TEST_RUN_COMPILE_CACHE_MAX_BYTES


def test_compile_counter_counts_new_programs_only():
    x7, x9 = jax.device_put(jnp.ones(7)), jax.device_put(jnp.ones(9))  # their programs built before counting
    counter = profiling.CompileCounter()
    f = jax.jit(lambda x: jnp.cos(x) * 3.0 + 1.0)
    f(x7).block_until_ready()
    first = counter.snapshot()
    assert first["compiles"] == 1 and first["compile_seconds"] > 0
    f(x7).block_until_ready()  # same shape: no new program
    assert counter.snapshot()["compiles"] == first["compiles"]
    f(x9).block_until_ready()  # new shape: one more
    assert counter.snapshot()["compiles"] == first["compiles"] + 1
    counter.start()
    assert counter.snapshot()["compiles"] == 0
