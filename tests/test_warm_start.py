"""`pdm_jax.warm_start.run_warm_start`: the warm start runs sft.steps steps, or ends at the step where the mean token
accuracy of the last window reaches the target, and logs its records (a fake step: no program is compiled)."""

import numpy as np

from pdm_jax.run_spec import SftSpec
from pdm_jax.warm_start import LOG_EVERY, run_warm_start


class Writer:
    def __init__(self):
        self.records = []

    def write(self, step, phase, metrics):
        self.records.append((step, phase, round(float(metrics["token_accuracy"]), 6)))


def _step(accuracies):
    """A step whose state counts the steps and whose token accuracy at step i is accuracies[i]."""
    def step_fn(state, batch):
        assert batch == state  # batch_at(step) is the batch of this step
        return state + 1, dict(loss=np.float32(1.0), token_accuracy=np.float32(accuracies[state]))
    return step_fn


def test_without_a_target_every_step_runs():
    writer = Writer()
    state, steps = run_warm_start(SftSpec(steps=120, batch_size=4), _step([0.99] * 120), 0, lambda s: s, writer,
                                  disable=True)
    assert (state, steps) == (120, 120)
    assert [r[0] for r in writer.records] == [LOG_EVERY, 2 * LOG_EVERY, 120]


def test_the_warm_start_ends_where_the_window_reaches_the_target():
    acc = [0.5] * 60 + [0.95] * 100  # window 10: mean of steps 61..70 is 0.95 first at step 70 (1-based)
    acc[65] = 0.0  # ... but this dip keeps the mean of steps 61..70 at 0.855 and of 62..71 too; 67..76 is clear
    writer = Writer()
    sft = SftSpec(steps=160, batch_size=4, target_token_accuracy=0.9, target_window=10)
    state, steps = run_warm_start(sft, _step(acc), 0, lambda s: s, writer, disable=True)
    assert (state, steps) == (76, 76)
    assert writer.records == [(50, "sft", 0.5), (76, "sft", 0.95)]
