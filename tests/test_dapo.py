"""DAPO's pieces (arXiv 2503.14476): overlong shaping (eq. 13) at its boundaries, overlong filtering, the
group filter and dynamic sampling's rounds (pdm_jax.rl.dapo, pdm_jax.rollouts.dynamic_sampling)."""


import numpy as np
import pytest

from pdm_jax.config import get_base_config, validate_config
from pdm_jax.rl import dapo
from pdm_jax.rl.dapo import DapoSpec
from pdm_jax.rollout import RolloutBatch
from pdm_jax.run_spec import dapo_spec


def eq13(y, l_max, l_cache):
    """DAPO's eq. 13 as printed, one completion length at a time."""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return ((l_max - l_cache) - y) / l_cache
    return -1.0


def test_length_penalty_at_the_boundaries_of_eq_13():
    l_max, l_cache = 10, 4
    lengths = [0, 6, 7, 8, 9, 10, 11, 50]  # 6 = L_max - L_cache, 7 = that + 1, 10 = L_max, 11 = L_max + 1
    got = dapo.length_penalty(lengths, max_length=l_max, buffer_len=l_cache)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(got, [eq13(y, l_max, l_cache) for y in lengths], atol=1e-7)
    half = dapo.length_penalty(lengths, max_length=l_max, buffer_len=l_cache, factor=0.5)
    np.testing.assert_allclose(half, 0.5 * got, atol=1e-7)
    # L_cache = L_max: the ramp starts at the first token
    np.testing.assert_allclose(dapo.length_penalty([0, 1, 4], max_length=4, buffer_len=4), [0.0, -0.25, -1.0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_length=10, buffer_len=0), r"rl\.overlong_buffer_len \(L_cache\) = 0"),
    (dict(max_length=3, buffer_len=4), r"rl\.overlong_max_length \(L_max\) = 3: must be an integer >= "),
    (dict(max_length=10, buffer_len=4, factor=float("nan")), r"rl\.overlong_penalty_factor = nan"),
    (dict(max_length=10, buffer_len=4, factor=-1.0), r"rl\.overlong_penalty_factor = -1\.0"),
])
def test_length_penalty_refuses_bad_parameters_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dapo.length_penalty([1, 2], **kwargs)


@pytest.mark.parametrize("overrides, match", [
    (dict(overlong_buffer_len=9), r"rl\.overlong_buffer_len = 9: L_cache must be <= L_max = 8"),
    (dict(overlong_buffer_len=4, overlong_max_length=3), r"rl\.overlong_buffer_len = 4: L_cache must be <= L_max = 3"),
    (dict(overlong_buffer_len=2, overlong_max_length=9), r"rl\.overlong_max_length = 9: must be in \[0, rl\.max_new_"),
    (dict(overlong_max_length=4), r"rl\.overlong_max_length = 4: sets L_max of the overlong shaping, which is off"),
    (dict(overlong_buffer_len=-1), r"rl\.overlong_buffer_len = -1: must be >= 0"),
    (dict(overlong_buffer_len=2, overlong_penalty_factor=-0.5), r"rl\.overlong_penalty_factor = -0\.5"),
    (dict(dynamic_sampling=True, dynamic_sampling_max_rounds=0), r"rl\.dynamic_sampling_max_rounds = 0: must be >= 1"),
])
def test_bad_dapo_fields_are_named(overrides, match):
    c = get_base_config()  # rl.max_new_tokens = 8
    c.rl.update(overrides, top_k_logprobs=4)
    with pytest.raises(ValueError, match=match):
        validate_config(c)


def test_the_spec_reads_the_fields_and_is_off_by_default():
    c = get_base_config()
    assert dapo_spec(c.rl) == DapoSpec(overlong_max_length=c.rl.max_new_tokens, max_rounds=3)
    spec = dapo_spec(c.rl)
    assert not (spec.dynamic_sampling or spec.shaping or spec.overlong_filtering)
    c.rl.update(dynamic_sampling=True, dynamic_sampling_max_rounds=5, overlong_buffer_len=2, overlong_max_length=6,
                overlong_penalty_factor=0.5, overlong_filtering=True, top_k_logprobs=4)
    validate_config(c)
    assert dapo_spec(c.rl) == DapoSpec(True, 5, 6, 2, 0.5, True)


def _batch(lengths, rewards, finish=None, t=6):
    """A RolloutBatch of rows with the given completion lengths and rewards (prompt-major, 2 rows a group)."""
    n = len(lengths)
    mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    finish = finish or ["stop"] * n
    return RolloutBatch(prompt_ids=np.ones((n, 2), np.int32), prompt_mask=np.ones((n, 2), bool),
                        completion_ids=np.where(mask, 3, 0), completion_mask=mask,
                        behavior_logprobs=np.where(mask, -0.5, 0.0), topk_ids=np.zeros((n, t, 2), np.int32),
                        topk_logprobs=np.zeros((n, t, 2)), weights_version=np.zeros(n, np.int32),
                        group_ids=np.arange(n) // 2, finish_reason=finish,
                        rewards=None if rewards is None else np.asarray(rewards, np.float32))


def test_training_rewards_add_the_penalty_only_when_on():
    rb = _batch([2, 5, 6, 6], [1.0, 1.0, 0.0, 1.0])
    assert dapo.training_rewards(rb, DapoSpec()) is rb.rewards  # off: the same array, nothing recomputed
    spec = DapoSpec(overlong_max_length=6, overlong_buffer_len=2, overlong_penalty_factor=1.0)
    np.testing.assert_allclose(dapo.training_rewards(rb, spec), [1.0, 0.5, -1.0, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match="scored RolloutBatch"):
        dapo.training_rewards(rb.replace(rewards=None), spec)


def test_overlong_filtering_zeroes_the_loss_mask_of_truncated_rows_only():
    rb = _batch([2, 6, 6, 3], [0.0, 1.0, 0.0, 1.0], finish=["stop", "length", "stop", "length"])
    assert dapo.no_loss_rows(rb, DapoSpec()) is None
    assert dapo.without_loss(rb, None) is rb
    rows = dapo.no_loss_rows(rb, DapoSpec(overlong_filtering=True))
    np.testing.assert_array_equal(rows, [False, True, False, True])  # a stop at the limit is not truncated
    out = dapo.without_loss(rb, rows)
    np.testing.assert_array_equal(out.completion_mask.sum(1), [2, 0, 6, 0])
    np.testing.assert_array_equal(out.rewards, rb.rewards)  # the baseline keeps them
    filler = np.array([True, False, False, False])
    np.testing.assert_array_equal(dapo.no_loss_rows(rb, DapoSpec(overlong_filtering=True), filler),
                                  [True, True, False, True])
    np.testing.assert_array_equal(dapo.no_loss_rows(rb, DapoSpec(), filler), filler)


def test_informative_groups_are_those_not_all_equal():
    rewards = [1, 1, 1, 0, 0, 0, 0.5, 0.5000001, 0.3, 0.3]
    np.testing.assert_array_equal(dapo.informative_groups(np.float32(rewards), 2), [False, True, False, True, False])
    with pytest.raises(ValueError, match="group_size = 3"):
        dapo.informative_groups(np.zeros(4), 3)


def test_choose_groups_keeps_the_first_informative_then_fills_at_the_bound():
    t, f = True, False
    enough = dapo.choose_groups([np.array([f, t, f, t]), np.array([t, t, f, t])], 3)
    assert enough.kept == [(0, 1), (0, 3), (1, 0)] and enough.filler == []
    assert (enough.dropped, enough.surplus) == (3, 2)
    short = dapo.choose_groups([np.array([f, t, f, f]), np.array([f, f, t, f])], 4)
    assert short.kept == [(0, 1), (1, 2)] and short.filler == [(0, 0), (0, 2)]
    assert (short.dropped, short.surplus) == (6, 0)
    none = dapo.choose_groups([np.array([f, f])], 2)
    assert none.kept == [] and none.filler == [(0, 0), (0, 1)] and none.dropped == 2
    with pytest.raises(ValueError, match="fewer than prompts_per_step"):
        dapo.choose_groups([np.array([t])], 2)


def test_round_seeds_keep_round_0_and_differ_per_round():
    assert dapo.round_seed(1234, 0) == 1234
    seeds = {dapo.round_seed(s, r) for s in range(50) for r in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2 ** 63 for s in seeds)
    # Pinned: a resumed run (or one on another machine or numpy) must draw the same rounds as the run it continues.
    assert (dapo.round_seed(7, 2), dapo.round_seed(1234, 1)) == (2167195393923510900, 6227735559454688670)
