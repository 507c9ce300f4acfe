"""Where a run's time goes: profiler traces (`StepProfiler`), phase timers (`PhaseTimer`), compile counts
(`CompileCounter`) and JAX's persistent compilation cache (`enable_compile_cache`).

``--config.profile.steps=a:b`` traces RL steps a..b (1-based, inclusive; the first step also compiles) into
``WORKDIR/profile`` for TensorBoard's profile plugin or ui.perfetto.dev."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Optional

import jax

log = logging.getLogger("pdm_jax.profiling")


def parse_steps(spec: str) -> Optional[tuple[int, int]]:
    """``"a:b"`` -> (a, b) with 1 <= a <= b; ``""`` -> None (no profiling).

    Raises:
      ValueError: naming ``profile.steps`` and the value, for anything else.
    """
    if not spec:
        return None
    parts = spec.split(":")
    try:
        first, last = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or not 1 <= first <= last:
        raise ValueError(f"profile.steps = {spec!r}: must be 'a:b' with 1 <= a <= b (RL steps, inclusive), "
                         "or '' for no profiling")
    return first, last


class StepProfiler:
    """A ``jax.profiler`` trace from before RL step ``a`` to after step ``b`` of ``spec`` (``profile.steps``, ``"a:b"``
    or ``""``), written to ``workdir/profile``."""

    def __init__(self, workdir: str, spec: str):
        self.range = parse_steps(spec)
        self.directory = os.path.join(workdir, "profile")
        self.active = False

    def before_step(self, rl_step: int) -> None:
        """Call before RL step ``rl_step`` (1-based) runs."""
        if self.range is not None and rl_step == self.range[0] and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True
            log.info("profiling RL steps %d..%d into %s", *self.range, self.directory)

    def after_step(self, rl_step: int) -> None:
        """Call after RL step ``rl_step`` finished (its device work included)."""
        if self.active and rl_step >= self.range[1]:
            self.stop()

    def stop(self) -> None:
        """Stops an active trace (also at the end of a run that ended inside the range)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info("profile written to %s", self.directory)


# ---------------------------------------------------------------- compilation cache and compile counts
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every XLA program built (compiled or cache-loaded)
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"


def default_compile_cache_dir() -> str:
    """``$XDG_CACHE_HOME/pdm_jax/jax_cache`` (``~/.cache/pdm_jax/jax_cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdm_jax", "jax_cache")


def resolve_compile_cache_dir(spec: str, workdir: Optional[str] = None) -> str:
    """The directory of ``compile_cache.dir``: ``"default"`` -> `default_compile_cache_dir`, ``"workdir"`` ->
    ``WORKDIR/jax_cache``, ``""`` -> ``""`` (no cache), anything else -> that path (absolute).

    Raises:
      ValueError: ``"workdir"`` without a workdir.
    """
    if spec == "default":
        return default_compile_cache_dir()
    if spec == "workdir":
        if not workdir:
            raise ValueError("compile_cache.dir = 'workdir' needs a run directory")
        return (workdir.rstrip("/") + "/jax_cache" if "://" in workdir  # a bucket (JAX writes it through etils)
                else os.path.join(os.path.abspath(workdir), "jax_cache"))
    return os.path.abspath(os.path.expanduser(spec)) if spec else ""


#: Size limit of a local persistent compilation cache (`enable_compile_cache`): 16 GiB.
COMPILE_CACHE_MAX_BYTES = 16 * 2 ** 30


def enable_compile_cache(directory: str, *, min_compile_time_s: float = 0.0,
                         max_size_bytes: int = COMPILE_CACHE_MAX_BYTES) -> bool:
    """Turns on JAX's persistent compilation cache in `directory` for this process (no-op for ``""``); returns whether a
    cache is on.

    Every program is written (no size floor; ``min_compile_time_s``, default 0 s), so a second run loads the tiny
    runs' programs instead of compiling them (``compile_cache_hits``). JAX decides at its first compile, so call this
    before anything compiles. A local directory is shared safely by several processes:
    ``jax_compilation_cache_max_size = max_size_bytes`` (default 16 GiB) makes JAX lock every read and write (without
    it a reader may see a half-written entry and crash XLA) and evict least-recently-used entries, at the price of a
    scan of every entry on each write (0.2 CPU-s a write at 2,400 entries); -1 (JAX's default: no bound, no lock) suits
    a directory only one process writes. Bucket paths keep JAX's defaults.

    Raises:
      OSError: the directory cannot be created."""
    if not directory:
        return False
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if "://" not in directory:
        jax.config.update("jax_compilation_cache_max_size", int(max_size_bytes))
    log.info("JAX compilation cache: %s", directory)
    return True


class CompileCounter:
    """Counts this process's XLA program builds through ``jax.monitoring`` listeners (installed once per process).

    `snapshot`: cumulative ``{"compiles", "compile_seconds", "compile_cache_hits", "compile_cache_misses"}`` since
    `start`; ``compiles`` includes persistent-cache hits (their load time in ``compile_seconds``). Thread-safe."""

    _installed = False
    _lock = threading.Lock()
    _totals = {"compiles": 0, "compile_seconds": 0.0, "compile_cache_hits": 0, "compile_cache_misses": 0}

    def __init__(self):
        self._install()
        self._base = self.totals()

    @classmethod
    def _install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            jax.monitoring.register_event_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_duration(cls, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            with cls._lock:
                cls._totals["compiles"] += 1
                cls._totals["compile_seconds"] += float(duration)

    @classmethod
    def _on_event(cls, event: str, **_) -> None:
        key = {CACHE_HIT_EVENT: "compile_cache_hits", CACHE_MISS_EVENT: "compile_cache_misses"}.get(event)
        if key is not None:
            with cls._lock:
                cls._totals[key] += 1

    @classmethod
    def totals(cls) -> dict:
        """The process-wide totals since the listeners were installed."""
        with cls._lock:
            return dict(cls._totals)

    def start(self) -> None:
        """Counts from now on."""
        self._base = self.totals()

    def snapshot(self) -> dict:
        """Counts since construction or the last `start` (see the class docstring for the fields)."""
        now = self.totals()
        return {k: now[k] - self._base[k] for k in now}


# ---------------------------------------------------------------- phase timing
class PhaseTimer:
    """Wall seconds per named phase of one RL step: ``with timer.phase("scoring"): ...``; `record` returns
    ``{"time_<phase>": s}`` for every name in `phases` (0.0 if it did not run; a repeated phase adds up) and
    ``time_other``, the step's time outside any phase."""

    def __init__(self, phases):
        self.phases = tuple(phases)
        self.reset()

    def reset(self) -> None:
        """Starts a new step."""
        self._t0 = time.perf_counter()
        self._seconds = {p: 0.0 for p in self.phases}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Times the block as phase `name` (one of `phases`)."""
        if name not in self._seconds:
            raise ValueError(f"PhaseTimer: unknown phase {name!r}; expected one of {self.phases}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Adds `seconds` measured elsewhere to phase `name`."""
        self._seconds[name] += float(seconds)

    def elapsed(self) -> float:
        """Seconds since `reset`."""
        return time.perf_counter() - self._t0

    def record(self) -> dict:
        """``{"time_<phase>": seconds}`` for every phase, plus ``time_other`` (>= 0) and ``time_step``."""
        total = self.elapsed()
        rec = {f"time_{p}": s for p, s in self._seconds.items()}
        rec["time_other"] = max(total - sum(self._seconds.values()), 0.0)
        rec["time_step"] = total
        return rec


#: The timed phases of an RL step, in order (each a ``time_<phase>`` metric).
STEP_PHASES = ("sampling", "scoring", "advantages", "optimizer", "weight_sync", "eval", "checkpoint")


def step_timing(phases: dict, sync_seconds: dict, generation_seconds: float) -> dict:
    """The timing fields of an ``rl`` record (docs/metrics.md).

    Args:
      phases: `PhaseTimer.record` of the step.
      sync_seconds: `SamplerSupervisor.last_sync_seconds` (``save``, ``load``).
      generation_seconds: the sampler's own seconds generating the step's rollouts.
    Returns:
      ``time_*`` of every phase, ``time_other``, ``time_weight_save``, ``time_weight_load``,
      ``time_sampler_generate``, and the older ``step_seconds``, ``generate_seconds`` (= time_sampling),
      ``train_seconds`` (= time_optimizer)."""
    rec = {k: float(v) for k, v in phases.items() if k != "time_step"}
    rec.update(time_weight_save=float(sync_seconds.get("save", 0.0)),
               time_weight_load=float(sync_seconds.get("load", 0.0)),
               time_sampler_generate=float(generation_seconds),
               step_seconds=float(phases["time_step"] - phases["time_eval"] - phases["time_checkpoint"]),
               generate_seconds=float(phases["time_sampling"]), train_seconds=float(phases["time_optimizer"]))
    return rec


def compile_record(trainer: dict, sampler: Optional[dict]) -> dict:
    """The compile fields of an ``rl`` record: this process's `CompileCounter` snapshot (``compiles``,
    ``compile_seconds``, ``compile_cache_hits``) and the sampler process's (``sampler_*``; 0 when the sampler runs in
    this process, or has not reported yet)."""
    sampler = sampler or {}
    return dict(compiles=float(trainer["compiles"]), compile_seconds=float(trainer["compile_seconds"]),
                compile_cache_hits=float(trainer["compile_cache_hits"]),
                sampler_compiles=float(sampler.get("compiles", 0)),
                sampler_compile_seconds=float(sampler.get("compile_seconds", 0.0)),
                sampler_compile_cache_hits=float(sampler.get("compile_cache_hits", 0)))
