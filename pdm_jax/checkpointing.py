"""Training checkpoints with orbax: model, optimizer, step, RNG, data position, sampler version.

A checkpoint is one orbax `CheckpointManager` step with two items:
``state`` (the `TrainState` pytree: step, params, optax state; StandardSave)
and ``meta`` (JSON: phase, RL step, data position, sampler weights version,
the run's seed, warm-start accuracies, wall time so far). The RNG state is the
pair (seed, RL step): every random draw of the loop (rollout sampling seeds,
mini-batch permutations) is derived from it, so a resumed run draws exactly
what the uninterrupted run would have. `--workdir` resumes from the latest one.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores (TrainState, meta) under `directory` with orbax.

    Args:
      directory: absolute or relative path; created if missing.
      max_to_keep: number of most recent checkpoints kept (older ones deleted).
    """

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> Optional[int]:
        """The newest saved step (an int id chosen by the caller), or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Saves `state` (a pytree of arrays) and `meta` (JSON-serialisable) as checkpoint `step`, synchronously."""
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: Optional[int] = None):
        """Restores (state, meta) of `step` (default: latest) into the structure/shardings of `abstract_state`.

        Raises FileNotFoundError if there is no checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                    meta=ocp.args.JsonRestore()),
        )
        return restored["state"], restored["meta"]

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """A pytree of jax.ShapeDtypeStruct (with shardings) matching `tree`, for restore targets."""

    def f(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(f, tree)
