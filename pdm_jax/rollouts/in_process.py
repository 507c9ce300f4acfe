"""`InProcessSampler`: the `pdm_jax.rollouts.base.Sampler` interface over a `SamplingEngine` in this process.

The ``in_process`` and ``colocated`` sampler modes (`pdm_jax.rollouts.supervisor`) and the tests use it: the same calls
as `pdm_jax.rollouts.client.SamplerClient`, answered by the engine directly, with the server's weights-path rule
(`pdm_jax.sampler.engine.check_weights_path`).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from pdm_jax.rollout import GenerateParams, RolloutBatch
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler.engine import SamplingEngine, StaleWeightsError, check_weights_path


class InProcessSampler:
    """The `SamplerClient` interface over an in-process `SamplingEngine` (tests, in-process trainer).

    ``load_weights`` applies the server's path rule when `checkpoint_root` is given (see `check_weights_path`).
    """

    def __init__(self, engine: SamplingEngine, *, checkpoint_root: Optional[str] = None):
        self.engine = engine
        self.checkpoint_root = checkpoint_root

    def health(self) -> dict:
        """Same fields as the server's ``GET /health``."""
        return self.engine.health()

    def generate(self, prompts, params=None, **fields) -> RolloutBatch:
        """See `SamplingEngine.generate`."""
        return self.engine.generate(prompts, GenerateParams.of(params, **fields))

    def load_weights(self, path: str, version: int) -> dict:
        """See `SamplingEngine.load_weights` (plus the checkpoint-root rule)."""
        if self.checkpoint_root is not None:
            path = check_weights_path(path, self.checkpoint_root)
        return self.engine.load_weights(path, version, root=self.checkpoint_root)

    def set_params(self, params, version: int) -> dict:
        """Installs in-memory ``params`` as weights ``version`` (`SamplingEngine.set_params`; colocated sync).

        Returns ``{"version", "seconds"}`` (seconds: the reshard + re-quantization, finished).
        Raises:
          StaleWeightsError: ``version`` is not newer than the engine's.
          WeightsError: non-finite values (naming the parameter) or a tree that does not fit
            the model; the current weights stay.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) \
                or not 0 <= version <= wts.MAX_VERSION:
            raise wts.WeightsError(f"version must be an integer in [0, 2**31), got {version!r}")
        if version <= self.engine.version:
            raise StaleWeightsError(f"stale weights version {version}: the sampler holds version "
                                    f"{self.engine.version}; an in-memory load needs a higher version")
        t0 = time.perf_counter()
        self.engine.set_params(params, version=int(version))
        return {"version": int(version), "seconds": time.perf_counter() - t0}

    @property
    def version(self) -> int:
        """The engine's current weights version."""
        return self.engine.version
