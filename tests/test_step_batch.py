"""`pdm_jax.rl.step_batch.StepBatch`: the jitted step's batch built from rollouts."""

import numpy as np
import pytest

from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.rollout import RolloutBatch


def _rollouts(n=4, p=3, t=2, k=2):
    rng = np.random.default_rng(0)
    return RolloutBatch(
        prompt_ids=rng.integers(1, 9, (n, p)), prompt_mask=np.ones((n, p), bool),
        completion_ids=rng.integers(1, 9, (n, t)), completion_mask=np.ones((n, t), bool),
        behavior_logprobs=-rng.random((n, t)), topk_ids=rng.integers(0, 9, (n, t, k)),
        topk_logprobs=-rng.random((n, t, k)), weights_version=np.arange(n), group_ids=np.arange(n) // 2,
        finish_reason=["length"] * n)


def test_step_batch_from_rollouts_pads_to_static_lengths():
    rb = _rollouts()
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    b = StepBatch.from_rollouts(rb, adv, prompt_len=8, completion_len=5)
    assert b.prompt_ids.shape == (4, 8) and b.completion_ids.shape == (4, 5) and b.topk_ids.shape == (4, 5, 2)
    np.testing.assert_array_equal(b.prompt_ids[:, 5:], rb.prompt_ids)  # left-padded
    assert not b.prompt_mask[:, :5].any() and b.prompt_mask[:, 5:].all()
    np.testing.assert_array_equal(b.completion_ids[:, :2], rb.completion_ids)  # right-padded
    assert not b.completion_mask[:, 2:].any()
    np.testing.assert_array_equal(b.advantages, adv)
    np.testing.assert_array_equal(b.weights_version, rb.weights_version)
    assert b.ref_logprobs is None
    sub = b.select(np.array([2, 0]))
    np.testing.assert_array_equal(sub.completion_ids, b.completion_ids[[2, 0]])
    assert sub.num_sequences == 2 and sub.ref_logprobs is None
    with pytest.raises(ValueError, match="advantages has shape"):
        StepBatch.from_rollouts(rb, adv[:3], prompt_len=8, completion_len=5)
    with pytest.raises(ValueError, match="cannot pad"):
        StepBatch.from_rollouts(rb, adv, prompt_len=2, completion_len=5)
