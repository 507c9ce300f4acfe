"""Test setup: 8 fake CPU devices for sharding tests, f32 everywhere, CPU only, no state carried between tests.

Compiled programs are dropped after each test module (`jax.clear_caches`). XLA:CPU maps every executable's code
into its own memory mappings (~3 per program), and the whole suite compiles enough programs to reach the kernel's
``vm.max_map_count`` (65,530 by default): the CI runs that segfaulted inside XLA:CPU late in the session (while
compiling or loading a program, in test_rollouts_vllm_client's trainer runs or test_trust_region, never when those ran
alone) were out of mappings. A module ending with more than half the limit in use fails with the count instead.

The test run has a persistent compilation cache of its own (fresh directories, one per pytest-xdist worker, removed
at the end): a program an earlier module of the worker compiled is loaded from it instead of compiled again. Its key
is the program, the devices and the XLA flags, so a loaded program is the one this test would have compiled; no test
reads what another run or a user's run wrote. In-process trainers may point the cache
elsewhere for a test (`_compile_cache_stays_in_its_test` puts it back); subprocess runs keep their own caches.
Programs are built for compile speed, not run speed (`TEST_XLA_FLAGS`; ``XLA_FLAGS`` naming a flag overrides it).
"""
import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The user cache directory (compile_cache.dir = "default": $XDG_CACHE_HOME/pdm_jax/jax_cache) and the test run's
# own compilation cache are fresh per test run (one for all of pytest-xdist's workers, made by the controller
# before it starts them), removed at its end: tests never read programs another run (or a user's run) wrote.
if "PYTEST_XDIST_WORKER" not in os.environ or "PDM_JAX_TEST_RUN_DIR" not in os.environ:
    os.environ["PDM_JAX_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="pdm_jax_test_run_")
    atexit.register(shutil.rmtree, os.environ["PDM_JAX_TEST_RUN_DIR"], True)
os.environ["XDG_CACHE_HOME"] = os.path.join(os.environ["PDM_JAX_TEST_RUN_DIR"], "xdg_cache")
# Temporary files made without a named place (tempfile's default; subprocesses inherit TMPDIR) go to the test run's
# directory too, so they go with it: a sampler server a test makes crash keeps its log for a post-mortem, by design,
# and a SIGKILLed run leaves its sampler's port file; in the machine's /tmp both outlived the run.
os.environ["TMPDIR"] = os.path.join(os.environ["PDM_JAX_TEST_RUN_DIR"], "tmp")
os.makedirs(os.environ["TMPDIR"], exist_ok=True)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again
#: This process's persistent compilation cache: one directory per pytest-xdist worker, which only that worker writes,
#: so it needs none of JAX's LRU bookkeeping (`TEST_RUN_COMPILE_CACHE_MAX_BYTES`).
TEST_RUN_COMPILE_CACHE = os.path.join(os.environ["PDM_JAX_TEST_RUN_DIR"], "jax_cache",
                                      os.environ.get("PYTEST_XDIST_WORKER", "main"))
#: No size bound (JAX's default): with one (``jax_compilation_cache_max_size``) JAX locks the directory and scans every
#: entry on each write (0.2 CPU-s a write at 2,400 entries, measured here), which cost the fast tier a third of its CPU.
TEST_RUN_COMPILE_CACHE_MAX_BYTES = -1
#: XLA:CPU flags for the test run, each unless ``XLA_FLAGS`` names it already: 8 fake devices, and programs built for
#: compile speed (the tests' programs are tiny and run briefly; building them was two thirds of the suite's time).
#: Without the fusion emitters XLA:CPU emits its fusions with the older LLVM IR emitters, which LLVM at optimisation
#: level 0 turns into code about five times sooner (the tiny MoE's forward + backward: 0.5 s instead of 2.8 s).
TEST_XLA_FLAGS = {"xla_force_host_platform_device_count": "8", "xla_cpu_use_fusion_emitters": "false",
                  "xla_backend_optimization_level": "0"}
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in TEST_XLA_FLAGS.items():
    if _name not in _flags:
        _flags = (_flags + f" --{_name}={_value}").strip()
os.environ["XLA_FLAGS"] = _flags


def xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a test's subprocess run (a trainer, a worker): this test run's flags (`TEST_XLA_FLAGS`
    and whatever the caller's ``XLA_FLAGS`` overrode) with ``devices`` fake CPU devices, or XLA's one device where
    ``devices`` is None."""
    flags = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from pdm_jax.profiling import enable_compile_cache  # noqa: E402

enable_compile_cache(TEST_RUN_COMPILE_CACHE, max_size_bytes=TEST_RUN_COMPILE_CACHE_MAX_BYTES)

# Property tests draw the same examples on every run (a seed per test): a CI run cannot fail on an example no
# earlier run drew. A test's own @settings still override the other fields.
settings.register_profile("pdm_jax", derandomize=True, database=None)
settings.load_profile("pdm_jax")

# ---- shared test fixtures: the tiny models most modules build, a free loopback port ----------------------------

def _tiny_configs():
    from pdm_jax.models.qwen3 import Qwen3Config

    dense = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    moe = Qwen3Config(**{**dense.__dict__, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                         "norm_topk_prob": True})
    return dense, moe


#: The tiny dense Qwen3 of the sampler, weights and colocation tests (V 32, d 32, 2 layers, GQA 4/2, head 8).
#: Modules import it (``from conftest import TINY_DENSE``) so that equal shapes are written once.
#: TINY_MOE: the same with 4 experts, top-2, expert width 16, normalised top-k.
TINY_DENSE, TINY_MOE = _tiny_configs()


def data_spec(fields):
    """A `pdm_jax.data.DataSpec`: the base config's ``data`` section with ``fields`` (a mapping or ConfigDict) set.
    Math kinds (gsm8k, dapo_math) take ``prompt_format="question"`` unless ``fields`` says otherwise (their only
    format; a run config sets it, as configs/qwen3_dapo.py does)."""
    import dataclasses

    from pdm_jax.config import get_base_config
    from pdm_jax.data import DataSpec

    fields = dict(fields.to_dict() if hasattr(fields, "to_dict") else fields)
    if fields.get("kind") in ("gsm8k", "dapo_math"):
        fields.setdefault("prompt_format", "question")
    return dataclasses.replace(DataSpec.from_config(get_base_config().data), **fields)


def jit_method(model, method: str = "__call__", **static):
    """``model.<method>`` of an nnx module as one compiled program, its weights passed in: the call's arguments
    traced (keyword ones too), ``static`` keyword arguments fixed, the module's compute options (static attributes:
    attention, scan, MoE implementation) taken as they are now. Tests call references through it: run op by op, a
    model's forward builds a hundred small programs, one by one."""
    import functools

    from flax import nnx

    graphdef, state = nnx.split(model)

    def call(state, *args, **kwargs):
        return getattr(nnx.merge(graphdef, state), method)(*args, **kwargs, **static)

    return functools.partial(jax.jit(call), state)


def free_port() -> int:
    """A free TCP port on loopback (bound and released; the caller binds it next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The small data files the data-source and tokenizer tests read (tests/data/fixtures: GSM8K / DAPO-Math-17k rows).
FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"


def math_source_config(**fields):
    """A local math dataset's `DataSpec` for `pdm_jax.data.make_source` (2 held-out prompts, seed 0, `data_spec`)
    with ``fields`` (kind, path, ...)."""
    return data_spec({"num_eval": 2, "seed": 0, **fields})


def doc_section(page: str, heading: str) -> str:
    """The section of ``docs/<page>`` that starts at the ``## <heading>`` line, up to the next ``## `` heading."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / page).read_text()
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else len(text)]


def assert_same_step(metrics, params_after, want_metrics, want_params_after, params_before):
    """Two optimizer steps agree: every metric of ``want_metrics`` and every parameter to 1e-5, and the
    reference step moved some parameter by more than 1e-4 (it did something)."""
    import jax
    import numpy as np

    for k in want_metrics:
        np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    moved = 0.0
    for got, want, before in zip(jax.tree.leaves(params_after), jax.tree.leaves(want_params_after),
                                 jax.tree.leaves(jax.device_get(params_before))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        moved = max(moved, float(np.max(np.abs(want - before))))
    assert moved > 1e-4  # the step did something


class SmallDisk:
    """A tmpfs of its own (a real file system, so every writer meets the kernel's own ENOSPC when it is full)."""

    def __init__(self, root):
        self.root = root
        self.ballast = os.path.join(root, "ballast")

    def fill(self, leave: int = 0) -> None:
        """Writes a ballast file until the kernel answers ENOSPC: the disk is full (but for `leave` bytes)."""
        from fault_run import fill_disk

        fill_disk(self.ballast, leave)

    def free(self) -> None:
        os.unlink(self.ballast)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted under the test's directory (`SmallDisk`), unmounted after the test.

    Needs the right to mount (root, as on this project's CI machines); the test is skipped, saying so, where it has
    not.
    """
    import subprocess

    root = tmp_path / "small_disk"
    root.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full-disk test needs a tmpfs mount, which this user may not make: {r.stderr.strip()}")
    try:
        yield SmallDisk(str(root))
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture
def tiny_dense_config():
    """`TINY_DENSE` as a fixture."""
    return TINY_DENSE


@pytest.fixture
def tiny_moe_config():
    """`TINY_MOE` as a fixture."""
    return TINY_MOE


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture(autouse=True)
def _compile_cache_stays_in_its_test():
    """A test that sets JAX's persistent compilation cache options in this process (an in-process trainer or
    analysis run: `profiling.enable_compile_cache`) gets them reset afterwards to the test run's own cache, so
    that no later test reads or writes the cache that test chose."""
    before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    yield
    if any(getattr(jax.config, name) != value for name, value in before.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def _memory_mappings() -> int:
    """This process's memory mappings (lines of /proc/self/maps; 0 where there is no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_MAPPINGS = []  # (memory mappings after the module, module name)
_MODULE_COSTS = []  # (wall seconds, XLA compiles, compile seconds, module name, cache hits)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_stay_in_their_module(request):
    """Drops every compiled program after a test module, so that the session's memory mappings stay far below
    ``vm.max_map_count`` (module docstring); fails the module's last test, naming the count, if they do not.
    Records the module's wall time and XLA compiles for the summary."""
    import time

    from pdm_jax.profiling import CompileCounter

    counter, start = CompileCounter(), time.perf_counter()
    yield
    import gc

    done = counter.snapshot()
    _MODULE_COSTS.append((time.perf_counter() - start, done["compiles"], done["compile_seconds"],
                          request.module.__name__, done["compile_cache_hits"]))

    jax.clear_caches()
    gc.collect()
    used, limit = _memory_mappings(), _max_map_count()
    _MAPPINGS.append((used, request.module.__name__))
    assert used < limit // 2, (f"{used} memory mappings after this module, vm.max_map_count is {limit}: XLA:CPU "
                               f"segfaults when it runs out")


#: Test modules, costliest first (seconds of a full run here: the summary's "costliest" list). pytest-xdist hands
#: whole modules to its workers in collection order (``--dist loadfile --no-loadscope-reorder``), and this order
#: starts the long ones first, so the run ends on short modules instead of one worker finishing a long one alone.
#: Modules not named here follow in their collection order; a stale order costs balance, never a result.
#: `FAST_TIER_COSTLIEST_FIRST` is the same for ``-m "not slow"``, whose costs differ (no end-to-end runs).
COSTLIEST_FIRST = (
    "test_trainer", "test_aot", "test_bucket_workdir", "test_recipe", "test_docs_models", "test_per_host",
    "test_sampler_engine", "test_wandb_log", "test_analysis_callback", "test_param_jvp_mask", "test_colocated",
    "test_models_moe", "test_sampler_sharded", "test_dry_run", "test_rewards", "test_quickstart_notebook",
    "test_attention", "test_trust_region", "test_objectives", "test_routing_replay_engine", "test_chunked_loss",
    "test_rollouts_vllm_client", "test_host_memory", "test_packing", "test_moe_train_step", "test_sampler_quantize",
    "test_qwen3", "test_adversarial", "test_routing_replay", "test_distributed", "test_rollouts_supervisor",
    "test_docs_sampler", "test_hf_training", "test_rl_forward",
)


FAST_TIER_COSTLIEST_FIRST = (
    "test_launch", "test_train", "test_trust_region", "test_aot", "test_sampler_quantize", "test_sampler_sharded",
    "test_models_moe", "test_docs_commands", "test_analysis_report", "test_tokenizer", "test_qwen3", "test_adversarial",
    "test_sampler_engine", "test_dry_run", "test_attention", "test_objectives", "test_routing_replay", "test_hf_io",
    "test_packing",
)


def pytest_collection_modifyitems(config, items):
    """Orders the collected tests by module, `COSTLIEST_FIRST` first (`FAST_TIER_COSTLIEST_FIRST` under
    ``-m "not slow"``; a stable sort: each module's own order kept)."""
    fast_tier = (config.getoption("markexpr", "") or "").replace(" ", "") == "notslow"
    rank = {name: i for i, name in enumerate(FAST_TIER_COSTLIEST_FIRST if fast_tier else COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem, len(rank)))


def pytest_collection_finish(session):
    """Freezes what the imports and the collection made (`gc.freeze`): the cyclic GC's full collections (automatic,
    and each module's last) then walk only what the tests make, which is never frozen."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its module costs and mapping counts to the controller (`pytest_testnodedown`)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["pdm_jax_module_costs"] = list(_MODULE_COSTS)
        workeroutput["pdm_jax_mappings"] = list(_MAPPINGS)


class _GatherWorkerCosts:
    """The controller of a pytest-xdist run gathers each worker's module costs for the summary (a plugin, since
    ``pytest_testnodedown`` is xdist's hook: pytest refuses an unknown hook in a conftest)."""

    @staticmethod
    def pytest_testnodedown(node, error):
        out = getattr(node, "workeroutput", None) or {}
        _MODULE_COSTS.extend(tuple(c) for c in out.get("pdm_jax_module_costs", ()))
        _MAPPINGS.extend(tuple(m) for m in out.get("pdm_jax_mappings", ()))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_GatherWorkerCosts(), "pdm_jax_gather_worker_costs")


def pytest_terminal_summary(terminalreporter):
    if _MODULE_COSTS:
        wall = sum(c[0] for c in _MODULE_COSTS)
        compiles, seconds = sum(c[1] for c in _MODULE_COSTS), sum(c[2] for c in _MODULE_COSTS)
        hits = sum(c[4] for c in _MODULE_COSTS)
        terminalreporter.write_line(f"test modules: {wall:.0f} s in their tests, {compiles} XLA programs built in "
                                    f"{seconds:.0f} s ({hits} of them loaded from the test run's compilation "
                                    f"cache); the costliest (s, programs, their s):")
        for w, n, cs, module, _ in sorted(_MODULE_COSTS, reverse=True)[:15]:
            terminalreporter.write_line(f"  {w:7.1f} {n:5d} {cs:7.1f}  {module}")
    if _MAPPINGS:
        used, module = max(_MAPPINGS)
        terminalreporter.write_line(f"memory mappings after a test module, most: {used} ({module}); "
                                    f"vm.max_map_count {_max_map_count()}")

