"""`SamplerSupervisor`: the trainer's one handle on the rollout sampler.

It owns everything about the sampler that is not sampling: the weights versions (``WORKDIR/weights/vNNNNNN``) and
pushing them, starting it in the configured mode (``subprocess``: a ``pdm_jax.sampler.server`` child on loopback;
``remote``: a server at ``sampler.address``; ``in_process``: an engine here fed through the weights files;
``colocated``: an engine on the trainer's first local device fed in memory by `SamplingEngine.set_params`, fresh
buffers the next donated optimizer step cannot touch; ``auto``: `config.resolve_sampler_mode`), health, restarts and
stopping it. The trainer and the rollout producer only call :meth:`generate` and :meth:`sync`.

Failures: a *refused* request (HTTP 4xx, the engine's ``ValueError``) raises `SamplerRejected`, never retried or
restarted; a *gone or failing* sampler (connection errors, timeouts, 5xx after the client's retries, a replacement
dying at start-up) is restarted within ``sampler.max_restarts``, then `SamplerFailure`; a *stalled* one (alive, no
progress, e.g. SIGSTOP) misses ``stall_probe_misses`` consecutive ``/health`` probes during a call and is killed and
restarted like a dead one (about 60 s with the defaults instead of 4 x 300 s of request timeouts)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Optional

import jax

from pdm_jax import workdir as wd
from pdm_jax.config import SAMPLER_FILE_MODES, resolve_sampler_mode
from pdm_jax.rollout import GenerateParams, RolloutBatch, check_answers
from pdm_jax.rollouts.base import Sampler
from pdm_jax.rollouts.client import SamplerClient, SamplerRequestError, SamplerResponseError
from pdm_jax.rollouts.in_process import InProcessSampler
from pdm_jax.sampler.engine import SamplingEngine, make_sampler_mesh
from pdm_jax.rollouts.launcher import SamplerStartupError, start_sampler_server
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.rollouts.vllm_client import VLLMSampler
from pdm_jax.sampler.weights import META_FILE, load_weights, save_weights
from pdm_jax.sampler.wire import COMPILE_STATS, RequestError

log = logging.getLogger("pdm_jax.sampler")


class SamplerFailure(RuntimeError):
    """The sampler could not serve a request after the configured restarts/retries."""


class SamplerStalled(RuntimeError):
    """The sampler missed ``stall_probe_misses`` consecutive ``/health`` probes while a call was in flight."""


class SamplerRejected(ValueError):
    """The sampler refused a request; restarting would not help, so it is neither retried nor restarted. ``str(e)``:
    ``"sampler refused <call> (HTTP <status>, field <field>): <server message>"``.

    Attributes:
      call: the supervisor call (``"generate"``, ``"load_weights"``, ...).
      status: the HTTP status (4xx), or None for an in-process engine.
      field: the offending wire field named by the server, or None.
      message: the server's (or engine's) message."""

    def __init__(self, call: str, message: str, *, status: Optional[int] = None, field: Optional[str] = None):
        where = ", ".join(x for x in (f"HTTP {status}" if status else "", f"field {field!r}" if field else "") if x)
        super().__init__(f"sampler refused {call}{f' ({where})' if where else ''}: {message}")
        self.call, self.status, self.field, self.message = call, status, field, message

    @classmethod
    def from_error(cls, call: str, error: Exception) -> "SamplerRejected":
        """The rejection a client's `SamplerRequestError` or an engine's ValueError/TypeError stands for."""
        if isinstance(error, SamplerRejected):
            return error
        if isinstance(error, SamplerRequestError):
            return cls(call, error.message, status=error.status, field=error.field)
        field = error.field if isinstance(error, RequestError) else None
        return cls(call, f"{type(error).__name__}: {error}", field=field)


def _check_served_noise(health, sc: SamplerSpec) -> None:
    """Raises ValueError unless a native server's ``/health`` reports the run's ``sampler.weight_noise`` and
    ``sampler.weight_noise_seed`` (a server from before the fields existed reports neither: no noise, seed 0)."""
    health = health if isinstance(health, dict) else {}
    for field, flag, wanted, default in (("weight_noise", "--weight_noise", sc.weight_noise, 0.0),
                                         ("weight_noise_seed", "--weight_noise_seed", sc.weight_noise_seed, 0)):
        served = health.get(field, default)
        ok = isinstance(served, (int, float)) and not isinstance(served, bool) and served == wanted
        if not ok:
            raise ValueError(f"sampler.{field} = {wanted} but the server at {sc.address} reports {flag}={served!r} "
                             f"in /health: start it with the run's value")


class SamplerSupervisor:
    """Starts, calls, restarts, feeds weights to and stops the rollout sampler.

    Args:
      spec: the run's `SamplerSpec` (mode, address, token, quantization, timeouts and stall probes in seconds,
        retries, max_restarts, prompt and batch limits, batching, mesh).
      workdir: the run directory (``weights/`` versions; the model's ``model/config.json``).
      model_config: the ``Qwen3Config`` (in-process engines).
      max_new_tokens: the longest completion the engine must serve (tokens).
      compile_cache_dir: the JAX compilation cache of a subprocess sampler ("" = none);
        compile_cache_min_compile_time_s: its minimum compile time (s).
      reuse_freed_host_memory: a subprocess sampler keeps freed blocks mapped (``host_memory.reuse_freed``).

    Attributes:
      spec: the `SamplerSpec`; mode: the resolved ``sampler.mode`` (never "auto"); compute_dtype: "auto" | "float32"
        | "bfloat16".
      last_sync_seconds: ``{"save": s, "load": s}`` of the last `sync` (colocated: save 0).
      sampler_compile_stats: a subprocess/remote sampler's last `CompileCounter` snapshot (None before a `sync`).

    Raises:
      TypeError: ``spec`` is not a `SamplerSpec`.
      ValueError: a file sampler mode with a bucket workdir.

    :meth:`call` may run on the rollout producer's thread while the trainer pushes weights; a restart happens once
    per failure."""

    def __init__(self, spec: SamplerSpec, *, workdir: str, model_config, max_new_tokens: int,
                 compile_cache_dir: str = "", compile_cache_min_compile_time_s: float = 0.0,
                 reuse_freed_host_memory: bool = False):
        if not isinstance(spec, SamplerSpec):
            raise TypeError(f"SamplerSupervisor takes a SamplerSpec (SamplerSpec.from_config(config.sampler)), "
                            f"not {type(spec).__name__}")
        self.spec = spec
        self.mode = resolve_sampler_mode(spec.mode)
        self.compute_dtype = spec.compute_dtype
        self.compile_cache = dict(compile_cache_dir=compile_cache_dir,
                                  compile_cache_min_compile_time_s=float(compile_cache_min_compile_time_s),
                                  reuse_freed_host_memory=bool(reuse_freed_host_memory))
        self.last_sync_seconds = {"save": 0.0, "load": 0.0}
        self.sampler_compile_stats: Optional[dict] = None
        self.workdir = workdir
        if wd.is_remote(workdir) and self.mode in SAMPLER_FILE_MODES:
            raise ValueError(f"sampler.mode = {spec.mode!r} (resolved: {self.mode!r}) reads weights "
                             f"versions from local files, but the workdir {workdir} is a bucket: use "
                             "sampler.mode = 'colocated' with a bucket workdir")
        self.model_config = model_config
        # The engine's settings, built once (sampler.weight_noise: the rollout engine's fixed perturbation in every
        # mode but remote, whose server has its own --weight_noise flag, and vllm, refused by the config)
        self.engine_spec = spec.engine_spec(max_new_tokens=max_new_tokens)
        self.mesh_shape = (spec.mesh_data, spec.mesh_tensor)  # sampler.mesh: the sharded engine's data x tensor
        self.stall_probe_interval_s = spec.stall_probe_interval_s
        self.stall_probe_timeout_s = spec.stall_probe_timeout_s
        self.stall_probe_misses = spec.stall_probe_misses
        self._sampler: Optional[Sampler] = None
        self._proc = None
        self._restartable = False
        self._lock = threading.RLock()
        self._generation = 0
        self.restarts_total = 0
        self.stalls_total = 0
        self.version: Optional[int] = None

    # ---------------------------------------------------------------- weights versions
    def weights_path(self, version: int) -> str:
        """The directory of weights version ``version`` (``WORKDIR/weights/vNNNNNN``)."""
        return wd.join(self.workdir, "weights", f"v{version:06d}")

    def push_weights(self, params, version: int) -> str:
        """Saves ``params`` as weights version ``version`` and keeps only it, version - 1 and version 0 on disk.

        Bucket workdir: process 0 alone deletes and writes (`save_weights` writes one copy there)."""
        path = self.weights_path(version)
        if wd.is_remote(path):
            if jax.process_index() == 0:
                wd.rmtree(path)
            save_weights(params, path, version=version)
            if jax.process_index() == 0:
                root = wd.join(self.workdir, "weights")
                keep = {f"v{v:06d}" for v in (version, version - 1, 0)}
                for name in wd.listdir(root):
                    if name.startswith("v") and name not in keep:
                        wd.rmtree(wd.join(root, name))
            return path
        if os.path.exists(path):
            with wd.naming_write_errors(path):  # an unwritable weights/: RunWriteError naming it, as every write
                shutil.rmtree(path)
        save_weights(params, path, version=version)
        root = os.path.dirname(path)
        keep = {os.path.basename(self.weights_path(v)) for v in (version, version - 1, 0)}
        for name in os.listdir(root):
            if name.startswith("v") and name not in keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        return path

    @property
    def writes_files(self) -> bool:
        """Whether the sampler reads its weights versions from files (every mode but ``colocated``)."""
        return self.mode in SAMPLER_FILE_MODES

    @property
    def started(self) -> bool:
        """Whether `start` has run and `stop` has not (a restart in progress counts as started)."""
        return self.version is not None and (self._sampler is not None or self._restartable)

    def local_engine(self, version: int, quantization: str, compute_dtype: str = "auto") -> InProcessSampler:
        """An in-process engine on weights version ``version`` with ``quantization`` (one of
        `pdm_jax.sampler.defaults.QUANTIZATIONS`) computing in ``compute_dtype`` ("auto" | "float32" | "bfloat16",
        `engine.resolve_compute_dtype`)."""
        path = self.weights_path(version)
        engine = SamplingEngine(self.model_config, load_weights(path, self.model_config), self.engine_spec,
                                version=version, weights_path=path, mesh=make_sampler_mesh(*self.mesh_shape),
                                quantization=quantization, compute_dtype=compute_dtype)
        return InProcessSampler(engine, checkpoint_root=self.workdir)

    def memory_engine(self, params, version: int, quantization: str, compute_dtype: str = "auto", *,
                      noised: bool = True) -> InProcessSampler:
        """An in-process engine built in memory from ``params`` (weights ``version``) on this process's first local
        device, or sharded over ``sampler.mesh`` (`make_sampler_mesh`): the colocated sampler and the trainer's f32
        evaluation engine. ``noised``: apply the spec's ``weight_noise`` (False for evaluation)."""
        mesh = make_sampler_mesh(*self.mesh_shape, devices=jax.local_devices())
        place = dict(device=jax.local_devices()[0]) if mesh is None else dict(mesh=mesh)
        spec = dataclasses.replace(self.engine_spec, quantization=quantization, compute_dtype=compute_dtype,
                                   **({} if noised else dict(weight_noise=0.0, weight_noise_seed=0)))
        engine = SamplingEngine(self.model_config, params, spec, version=version, **place)
        return InProcessSampler(engine)

    # ---------------------------------------------------------------- lifecycle
    def start(self, version: int, params=None) -> None:
        """Starts (or connects to) the sampler serving weights version ``version``: file modes push it from ``params``
        first when its directory is not complete; colocated builds the engine from ``params`` (required).

        Raises:
          ValueError: colocated without ``params``; a remote native server whose ``/health`` lacks
            ``sampler.weight_noise`` and ``sampler.weight_noise_seed``.
          SamplerFailure: a remote sampler that does not answer ``/health``.
          SamplerRejected: a remote sampler that refuses the weights version.
          SamplerStartupError: a subprocess that died or did not come up in time."""
        sc = self.spec
        path = self.weights_path(version)
        self._restartable = self.mode == "subprocess"
        self._proc = self._sampler = None
        if self.mode == "colocated":
            if params is None:
                raise ValueError("SamplerSupervisor.start: sampler.mode = 'colocated' needs the parameters")
            self._sampler = self.memory_engine(params, version, sc.quantization, self.compute_dtype)
            self.version = version
            self._generation += 1
            return
        if params is not None and not os.path.exists(os.path.join(path, META_FILE)):
            self.push_weights(params, version)
        if self.mode == "subprocess":
            self._proc = start_sampler_server(
                spec=self.engine_spec, model_config=os.path.join(self.workdir, "model", "config.json"), weights=path,
                version=version, checkpoint_root=self.workdir, startup_timeout_s=sc.startup_timeout_s,
                client_kwargs=dict(timeout_s=sc.request_timeout_s, retries=sc.retries), **self.compile_cache)
            self._sampler = self._proc.client
        elif self.mode == "remote":
            client = self._remote_client(sc)
            try:
                health = client.health()
            except Exception as e:  # noqa: BLE001 - any transport error means "not reachable"
                raise SamplerFailure(f"sampler.address = {sc.address!r} is not reachable "
                                     f"(after {sc.retries} retries): {e}") from e
            if sc.backend == "native":
                _check_served_noise(health, sc)
            try:
                client.load_weights(path, version)
            except ValueError as e:  # a 4xx (SamplerRequestError), or weights the vLLM export refuses
                raise SamplerRejected.from_error("load_weights", e) from e
            self._sampler = client
        else:
            self._sampler = self.local_engine(version, sc.quantization, self.compute_dtype)
        self.version = version
        self._generation += 1

    def _remote_client(self, sc):
        """The client of the server at ``sampler.address``: ours (`SamplerClient`), or a vLLM server's (`VLLMSampler`,
        ``sampler.backend = "vllm"``; weights go to ``sampler.vllm_weights_dir``)."""
        if sc.backend == "vllm":
            return VLLMSampler(sc.address, model_config=self.model_config, model=sc.vllm_model,
                               weights_dir=sc.vllm_weights_dir or os.path.join(self.workdir, "weights_hf"),
                               timeout_s=sc.request_timeout_s, retries=sc.retries, token=sc.token or None)
        return SamplerClient(sc.address, timeout_s=sc.request_timeout_s, retries=sc.retries, token=sc.token or None)

    def _restart(self, generation: int, fn_name: str, error: Exception, restarts: int) -> None:
        """Replaces a failed subprocess (unless another thread already did), SIGKILLing a stalled one; start-up failures
        use the budget too and leave no sampler, so `call` tries again while budget remains."""
        with self._lock:
            if generation != self._generation:
                return  # another thread already restarted it
            self.restarts_total += 1
            log.warning("sampler call %s failed (%s); restarting the sampler (%d/%d)", fn_name, error, restarts,
                        self.spec.max_restarts)
            proc, self._proc, self._sampler = self._proc, None, None
            if proc is not None:
                try:
                    proc.kill() if isinstance(error, SamplerStalled) else proc.stop()
                except Exception:  # noqa: BLE001 - it may already be gone
                    pass
            self._generation += 1  # a failed start leaves no live sampler: the next failure restarts again
            self.start(self.version)

    def call(self, fn_name: str, fn: Callable[[Sampler], Any]):
        """``fn(sampler)`` on the live `Sampler` (one protocol method, e.g. ``lambda s: s.generate(prompts, n=4)``;
        ``fn_name`` names it); restarts a dead or stalled subprocess (same weights) and retries. Requests carry a
        seed, so a retry returns the same rollouts.

        Raises:
          SamplerResponseError: the answer does not have the documented shape (never retried).
          SamplerRejected: the sampler refused the request; never retried, no restart.
          SamplerFailure: still failing after ``sampler.max_restarts`` restarts, or not a restartable subprocess."""
        restarts, startup_error = 0, None
        while True:
            generation = self._generation
            try:
                return self._call_once(fn_name, fn)
            except SamplerResponseError:  # an answer without the documented shape: named as such, not retried
                raise
            except (ValueError, TypeError) as e:  # the request itself is bad (SamplerRequestError is a ValueError)
                raise SamplerRejected.from_error(fn_name, e) from e
            except Exception as e:  # connection errors, timeouts, stalls, 5xx after the client's own retries
                if not self._restartable or restarts >= self.spec.max_restarts:
                    last = f"; the last start-up failed: {startup_error}" if startup_error and self._sampler is None \
                        else ""
                    raise SamplerFailure(f"sampler call {fn_name} failed after {restarts} restart(s) "
                                         f"(sampler.max_restarts = {self.spec.max_restarts}): {e}{last}") from e
                restarts += 1
                try:
                    self._restart(generation, fn_name, e, restarts)
                except SamplerStartupError as err:  # counts against the budget; the loop decides
                    startup_error = err
                    log.warning("restarting the sampler failed (%d/%d): %s", restarts, self.spec.max_restarts, err)

    def _call_once(self, fn_name: str, fn: Callable[[Sampler], Any]):
        """One attempt; calls on an HTTP sampler run under the stall probe (`_watched`)."""
        sampler = self._sampler
        if sampler is None:
            raise SamplerFailure("no live sampler (the last start-up failed or the sampler was stopped)")
        if self.stall_probe_misses and hasattr(sampler, "probe"):
            return self._watched(sampler, fn_name, fn)
        return fn(sampler)

    def _watched(self, sampler, fn_name: str, fn: Callable[[Sampler], Any]):
        """Runs ``fn(sampler)`` on a worker thread while probing /health from this one; returns or raises what ``fn``
        does, or raises `SamplerStalled` after ``stall_probe_misses`` missed probes (the daemon worker is abandoned)."""
        box, done = {}, threading.Event()

        def work():
            try:
                box["value"] = fn(sampler)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name=f"sampler-{fn_name}", daemon=True).start()
        misses = 0
        while not done.wait(self.stall_probe_interval_s):
            if sampler.probe(self.stall_probe_timeout_s):
                misses = 0
                continue
            misses += 1
            log.warning("sampler /health probe missed (%d/%d) while %s is in flight", misses,
                        self.stall_probe_misses, fn_name)
            if misses >= self.stall_probe_misses and not done.is_set():
                self.stalls_total += 1
                raise SamplerStalled(
                    f"sampler stalled: {misses} consecutive /health probes ({self.stall_probe_interval_s:g} s apart, "
                    f"{self.stall_probe_timeout_s:g} s timeout) got no answer while {fn_name} was in flight")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def generate(self, prompts, params: Optional[GenerateParams] = None, **fields) -> RolloutBatch:
        """Rollouts for ``prompts`` (token-id lists) of the request ``params`` with ``fields`` replaced
        (`GenerateParams.of`); the answer is checked against the request (`pdm_jax.rollout.check_answers`) before use.

        Raises:
          SamplerResponseError: the rollouts do not answer the request (naming the field).
          SamplerRejected, SamplerFailure: as `call`."""
        params = GenerateParams.of(params, **fields)
        batch = self.call("generate", lambda sampler: sampler.generate(prompts, params))
        max_new = params.max_new_tokens
        try:
            check_answers(batch, prompts, n=int(params.n),
                          max_new_tokens=int(self.engine_spec.max_new_tokens if max_new is None else max_new),
                          top_k_logprobs=int(params.top_k_logprobs),
                          vocab_size=getattr(self.model_config, "vocab_size", None))
        except ValueError as e:
            raise SamplerResponseError(f"the sampler's rollouts do not answer the request: {e}") from None
        return batch

    def sync(self, params, version: int) -> None:
        """Pushes ``params`` as weights version ``version`` and has the sampler load it.

        Raises:
          SamplerRejected: the sampler refused the version (non-finite or damaged weights), naming the version, path
            and reason; it keeps serving the previous one.
          SamplerFailure: as `call`."""
        t0 = time.perf_counter()
        if self.mode == "colocated":
            try:
                self.call("set_params", lambda sampler: sampler.set_params(params, version))
            except SamplerRejected as e:
                raise SamplerRejected("set_params", f"weights version {version} (in memory): {e.message}",
                                      field=e.field) from e
            self.last_sync_seconds = {"save": 0.0, "load": time.perf_counter() - t0}
            self.version = version
            return
        path = self.push_weights(params, version)
        t1 = time.perf_counter()
        try:
            answer = self.call("load_weights", lambda sampler: sampler.load_weights(path, version))
        except SamplerRejected as e:
            raise SamplerRejected("load_weights", f"weights version {version} at {path}: {e.message}",
                                  status=e.status, field=e.field) from e
        self.last_sync_seconds = {"save": t1 - t0, "load": time.perf_counter() - t1}
        if isinstance(answer, dict) and isinstance(answer.get(COMPILE_STATS), dict):
            self.sampler_compile_stats = dict(answer[COMPILE_STATS])
        self.version = version

    def kill_process(self) -> None:
        """SIGKILLs the sampler subprocess (fault injection for tests; no-op in other modes)."""
        if self._proc is not None:
            self._proc.proc.kill()

    def stop(self) -> None:
        """Stops a subprocess sampler and drops the handle (idempotent); no restart after this."""
        self._restartable = False
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        self._sampler = None
