"""`StepProfiler`: a ``jax.profiler`` trace of a range of RL steps (``--config.profile.steps=a:b``).

The trace goes to ``WORKDIR/profile`` (TensorBoard's profile plugin or Perfetto read
it: ``tensorboard --logdir WORKDIR/profile``, or open the ``*.trace.json.gz`` in
ui.perfetto.dev). Steps are 1-based RL steps, the range inclusive: ``2:4`` traces RL
steps 2, 3 and 4 (the first RL step also compiles, so start at 2 to see the steady state).
"""

from __future__ import annotations

import logging
import os
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
    """Starts a ``jax.profiler`` trace before RL step ``a`` and stops it after step ``b`` (see module doc).

    Args:
      workdir: the run directory; the trace goes to ``workdir/profile``.
      spec: ``profile.steps`` (``"a:b"`` or ``""``).
    """

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
