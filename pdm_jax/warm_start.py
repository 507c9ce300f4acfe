"""The supervised warm start's loop: optimizer steps on the task's reference answers until ``sft.steps`` or, with
``sft.target_token_accuracy``, until the mean token accuracy of the last ``sft.target_window`` steps reaches it
(`pdm_jax.run_spec.SftSpec`). The trainer builds the jitted step and the batches; this module runs and logs them."""

from __future__ import annotations

import logging

import jax
import numpy as np
from tqdm.auto import tqdm

log = logging.getLogger("pdm_jax.warm_start")

#: Steps between the warm start's metrics records (and progress-bar updates).
LOG_EVERY = 50


def run_warm_start(sft, step_fn, state, batch_at, writer, **bar_kwargs):
    """Runs the warm start; returns ``(state, steps run)``.

    Args:
      sft: the `SftSpec` (``steps``, ``target_token_accuracy``, ``target_window``, ``target_reached``).
      step_fn: ``(state, batch) -> (state, metrics)``, the jitted SFT step; its metrics hold scalar ``loss`` and
        ``token_accuracy`` (fraction of target tokens predicted, on the step's own batch before its update).
      state: the initial train state.
      batch_at: ``step -> batch`` (on the devices), the batch of warm-start step ``step`` (0-based).
      writer: the run's metrics writer; an ``sft`` record every `LOG_EVERY` steps, at the last and at a reached
        target.
      **bar_kwargs: passed to tqdm (``disable``, ``mininterval``).
    """
    accuracies, steps_run = [], 0
    bar = tqdm(range(sft.steps), desc="warm start (SFT)", **bar_kwargs)
    for step in bar:
        state, m = step_fn(state, batch_at(step))
        steps_run = step + 1
        if sft.target_token_accuracy > 0:  # one host sync a step, only with a target
            accuracies.append(float(m["token_accuracy"]))
        if done := sft.target_reached(accuracies):
            log.info("warm start: token accuracy %.4f over steps %d-%d reached sft.target_token_accuracy %.4f",
                     np.mean(accuracies[-sft.target_window:]), steps_run - sft.target_window + 1, steps_run,
                     sft.target_token_accuracy)
        if steps_run % LOG_EVERY == 0 or steps_run == sft.steps or done:
            m = jax.device_get(m)
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", acc=f"{float(m['token_accuracy']):.3f}", refresh=False)
            writer.write(steps_run, "sft", m)
        if done:
            break
    bar.close()
    return state, steps_run
