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


def test_the_test_process_never_writes_the_persistent_cache(tmp_path):
    """tests/conftest.py keeps JAX's persistent cache unused in the pytest process (no test runs a program
    another test wrote): a new program compiled after `enable_compile_cache` writes no entry."""
    import jax

    assert profiling.enable_compile_cache(str(tmp_path / "c")) is True
    x = jax.device_put(jnp.ones(11))  # its programs built before counting
    counter = profiling.CompileCounter()
    jax.jit(lambda x: jnp.sin(x) * 5.0 - 2.0)(x).block_until_ready()
    snap = counter.snapshot()
    assert snap["compiles"] == 1 and snap["compile_cache_misses"] == 0 and snap["compile_cache_hits"] == 0
    assert os.listdir(tmp_path / "c") == []


def test_the_compile_cache_of_the_previous_test_is_off():
    """tests/conftest.py resets the cache options that a test set in this process (the two tests above)."""
    import jax

    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    assert jax.config.jax_compilation_cache_max_size == -1


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
