"""`SamplerSupervisor`: the trainer's one handle on the rollout sampler.

It owns everything about the sampler that is not sampling itself: where weights
versions live (``WORKDIR/weights/vNNNNNN``) and pushing them, starting the
sampler in the configured mode (``subprocess``: a ``pdm_jax.sampler.server``
child process on loopback; ``remote``: a running server at ``sampler.address``;
``in_process``: an engine in this process), health, calls with restarts of a
dead subprocess within ``sampler.max_restarts``, and stopping it. The trainer
and the rollout producer only call :meth:`generate` and :meth:`sync`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Optional

from pdm_jax.rollout import RolloutBatch
from pdm_jax.sampler.client import SamplerClient
from pdm_jax.sampler.engine import InProcessSampler, SamplingEngine
from pdm_jax.sampler.launcher import SamplerStartupError, start_sampler_server
from pdm_jax.sampler.weights import load_weights, save_weights

log = logging.getLogger("pdm_jax.sampler")


class SamplerFailure(RuntimeError):
    """The sampler could not serve a request after the configured restarts/retries."""


class SamplerSupervisor:
    """Starts, calls, restarts, feeds weights to and stops the rollout sampler.

    Args:
      sampler_config: the run config's ``sampler`` section (mode, address, token,
        quantization, startup/request timeouts in seconds, retries, max_restarts,
        max_prompt_length and max_batch_size in tokens / sequences).
      workdir: the run directory; weights versions go to ``workdir/weights``, the
        model's Hugging Face config is read from ``workdir/model/config.json``.
      model_config: the ``Qwen3Config`` (for in-process engines).
      max_new_tokens: the longest completion the engine must serve (tokens).

    Thread safety: :meth:`call` may run on the rollout producer's thread while the
    trainer pushes weights; a restart happens once per failure (a generation counter).
    """

    def __init__(self, sampler_config, *, workdir: str, model_config, max_new_tokens: int):
        self.config = sampler_config
        self.workdir = workdir
        self.model_config = model_config
        self.limits = dict(max_prompt_length=int(sampler_config.max_prompt_length),
                           max_new_tokens=int(max_new_tokens), max_batch_size=int(sampler_config.max_batch_size))
        self._sampler = None
        self._proc = None
        self._lock = threading.RLock()
        self._generation = 0
        self.restarts_total = 0
        self.version: Optional[int] = None

    # ---------------------------------------------------------------- weights versions
    def weights_path(self, version: int) -> str:
        """The directory of weights version ``version`` (``WORKDIR/weights/vNNNNNN``)."""
        return os.path.join(self.workdir, "weights", f"v{version:06d}")

    def push_weights(self, params, version: int) -> str:
        """Saves ``params`` as weights version ``version`` and keeps only it, version - 1 and version 0 on disk."""
        path = self.weights_path(version)
        if os.path.exists(path):
            shutil.rmtree(path)
        save_weights(params, path, version=version)
        root = os.path.dirname(path)
        keep = {os.path.basename(self.weights_path(v)) for v in (version, version - 1, 0)}
        for name in os.listdir(root):
            if name.startswith("v") and name not in keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        return path

    def local_engine(self, version: int, quantization: str) -> InProcessSampler:
        """An in-process engine on weights version ``version`` with ``quantization`` ("none" | "bf16" | "fp8")."""
        path = self.weights_path(version)
        engine = SamplingEngine(self.model_config, load_weights(path, self.model_config), quantization=quantization,
                                version=version, weights_path=path, **self.limits)
        return InProcessSampler(engine, checkpoint_root=self.workdir)

    # ---------------------------------------------------------------- lifecycle
    def start(self, version: int) -> None:
        """Starts (or connects to) the sampler serving weights version ``version`` (already pushed).

        Raises:
          SamplerFailure: a remote sampler that does not answer ``/health``.
          SamplerStartupError: a subprocess that died or did not come up in time.
        """
        sc = self.config
        path = self.weights_path(version)
        if sc.mode == "subprocess":
            self._proc = start_sampler_server(
                model_config=os.path.join(self.workdir, "model", "config.json"), weights=path, version=version,
                quantization=sc.quantization, checkpoint_root=self.workdir, startup_timeout_s=sc.startup_timeout_s,
                client_kwargs=dict(timeout_s=sc.request_timeout_s, retries=sc.retries), **self.limits)
            self._sampler = self._proc.client
        elif sc.mode == "remote":
            self._proc = None
            self._sampler = SamplerClient(sc.address, timeout_s=sc.request_timeout_s, retries=sc.retries,
                                          token=sc.token or None)
            try:
                self._sampler.health()
            except Exception as e:  # noqa: BLE001 - any transport error means "not reachable"
                raise SamplerFailure(f"sampler.address = {sc.address!r} is not reachable "
                                     f"(after {sc.retries} retries): {e}") from e
            self._sampler.load_weights(path, version)
        else:
            self._proc = None
            self._sampler = self.local_engine(version, sc.quantization)
        self.version = version
        self._generation += 1

    def _restart(self, generation: int, fn_name: str, error: Exception, restarts: int) -> None:
        """Replaces a failed subprocess (unless another thread already did); start-up failures use the budget too."""
        with self._lock:
            if generation != self._generation:
                return  # another thread already restarted it
            self.restarts_total += 1
            log.warning("sampler call %s failed (%s); restarting the sampler (%d/%d)", fn_name, error, restarts,
                        self.config.max_restarts)
            try:
                self._proc.stop()
            except Exception:  # noqa: BLE001 - it may already be gone
                pass
            self._generation += 1  # a failed start leaves no live sampler: the next failure restarts again
            self.start(self.version)

    def call(self, fn_name: str, *args, **kwargs):
        """Calls ``fn_name`` on the sampler; restarts a dead subprocess (same weights) and retries.

        Generation requests carry a seed, so a retried request returns the same
        rollouts: no training batch is lost or duplicated.

        Raises:
          ValueError, TypeError: the request itself is bad (never retried).
          SamplerFailure: the call still failed after ``sampler.max_restarts`` restarts,
            or the sampler is not a restartable subprocess.
        """
        restarts = 0
        while True:
            generation = self._generation
            try:
                return getattr(self._sampler, fn_name)(*args, **kwargs)
            except (ValueError, TypeError):
                raise
            except Exception as e:  # connection errors, timeouts, 5xx after the client's own retries
                if self._proc is None or restarts >= self.config.max_restarts:
                    raise SamplerFailure(f"sampler call {fn_name} failed after {restarts} restarts: {e}") from e
                restarts += 1
                try:
                    self._restart(generation, fn_name, e, restarts)
                except SamplerStartupError as startup_error:  # counts against the budget; the loop decides
                    log.warning("restarting the sampler failed: %s", startup_error)

    def generate(self, prompts, **kwargs) -> RolloutBatch:
        """Rollouts for ``prompts`` (lists of token ids); keyword arguments as ``SamplerClient.generate``."""
        return self.call("generate", prompts, **kwargs)

    def sync(self, params, version: int) -> None:
        """Pushes ``params`` as weights version ``version`` and has the sampler load it."""
        path = self.push_weights(params, version)
        self.call("load_weights", path, version)
        self.version = version

    def kill_process(self) -> None:
        """SIGKILLs the sampler subprocess (fault injection for tests; no-op in other modes)."""
        if self._proc is not None:
            self._proc.proc.kill()

    def stop(self) -> None:
        """Stops a subprocess sampler and drops the handle (idempotent)."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        self._sampler = None
