"""The `Sampler` protocol: what the trainer's side asks of any rollout backend.

Every backend implements it: `pdm_jax.rollouts.client.SamplerClient` (the native server over HTTP),
`pdm_jax.rollouts.vllm_client.VLLMSampler` (a vLLM OpenAI-compatible server) and
`pdm_jax.rollouts.in_process.InProcessSampler` (an engine in this process; it also implements `InMemorySampler`).
`pdm_jax.rollouts.supervisor.SamplerSupervisor` holds one and calls these methods (tests/test_rollouts_base.py checks
each class against the protocol). tunix's ``BaseRollout`` is the same idea.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

from pdm_jax.rollout import GenerateParams, RolloutBatch


@runtime_checkable
class Sampler(Protocol):
    """A rollout backend: generates rollouts with the weights version it holds, loads new versions."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[GenerateParams] = None,
                 **fields) -> RolloutBatch:
        """``n`` samples of each prompt (token-id lists), rows prompt-major, with behaviour log μ and the top-K;
        the request is ``params`` with ``fields`` replaced (`GenerateParams.of`).

        Raises ValueError (a refused request, naming the field) or another error for a failed call.
        """

    def load_weights(self, path: str, version: int) -> dict:
        """Loads weights version ``version`` from the directory ``path`` (`pdm_jax.sampler.weights` format).

        Returns the backend's answer (a dict; ``"version"`` at least). Raises ValueError when it refuses.
        """

    def health(self) -> dict:
        """The backend's status: ``{"status", "model", "version", ...}`` (the server's ``GET /health``)."""

    @property
    def version(self) -> Optional[int]:
        """The weights version generation uses now (None before a backend loaded any)."""


@runtime_checkable
class InMemorySampler(Sampler, Protocol):
    """A `Sampler` that also takes the trainer's parameters in memory (``sampler.mode=colocated``)."""

    def set_params(self, params, version: int) -> dict:
        """Installs the parameter tree ``params`` as weights version ``version``; returns ``{"version", "seconds"}``."""
