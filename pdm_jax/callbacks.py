"""`TrainerCallback`: the interface of RL-phase hooks (the token-level analysis is one).

Kept apart from `pdm_jax.trainer` so that code which only observes a run (the analysis) depends on this interface, not
on the loop.
"""

from __future__ import annotations

from typing import Any

from pdm_jax.rl.step_batch import StepBatch


class TrainerCallback:
    """Base class of RL-phase hooks passed to ``Trainer(..., callbacks=[...])``; both methods do nothing.

    ``trainer`` exposes ``spec`` (the run's ``pdm_jax.run_spec.RunSpec``: a typed record per config section;
    ``spec.step`` holds the trust-region and loss configs of the step), ``graphdef`` (the model's ``nnx.GraphDef``)
    and ``model_config`` (``Qwen3Config``). ``state`` is the ``pdm_jax.rl.train_step.TrainState``; the step donates
    it, so read what you need in ``before_update``. Hooks must not change training.
    """

    def before_update(self, trainer: Any, rl_step: int, batch: StepBatch, state: Any) -> None:
        """Called before each optimizer step with the device `StepBatch` and the current state."""

    def after_update(self, trainer: Any, rl_step: int, batch: StepBatch, state: Any, metrics: dict) -> None:
        """Called after each optimizer step with the same batch, the new state and the step's metrics."""
