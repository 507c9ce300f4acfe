"""`pdm_jax.rollout`: the `RolloutBatch` contract, its one builder and its one prompt padding."""

import numpy as np
import pytest

from pdm_jax.rollout import ROUTING_PAD, RolloutBatch, build_batch, left_pad, right_pad_rows


def _rollout(n=2, t=3, k=2, p=2, **overrides) -> RolloutBatch:
    fields = dict(
        prompt_ids=np.ones((n, p), np.int32), prompt_mask=np.ones((n, p), bool),
        completion_ids=np.ones((n, t), np.int32), completion_mask=np.ones((n, t), bool),
        behavior_logprobs=np.full((n, t), -1.0, np.float32), topk_ids=np.zeros((n, t, k), np.int32),
        topk_logprobs=np.full((n, t, k), -1.0, np.float32), weights_version=np.zeros(n, np.int32),
        group_ids=np.arange(n) // 2, finish_reason=np.array(["stop"] * n, object))
    fields.update(overrides)
    return RolloutBatch(**fields)



def test_left_pad_places_each_prompt_in_its_last_columns():
    ids, mask = left_pad([[5, 6, 7], [9], []], 4, rows=4)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 9], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert ids.dtype == np.int32 and mask.dtype == bool
    assert left_pad([[1, 2], [3]])[0].shape == (2, 2)  # default width: the longest prompt
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens, longer than P = 2"):
        left_pad([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="2 prompts do not fit in 1 rows"):
        left_pad([[1], [2]], 2, rows=1)


def test_right_pad_rows_stacks_ragged_rows():
    out = right_pad_rows([np.ones((2, 3)), np.ones((0, 3))], dtype=np.int32)
    assert out.shape == (2, 2, 3) and out.dtype == np.int32 and out[0].all() and not out[1].any()
    assert right_pad_rows([[], []]).shape == (2, 1)  # width at least 1
    with pytest.raises(ValueError, match="row 0 has 3 entries, more than 2"):
        right_pad_rows([[1, 2, 3]], 2)


def test_build_batch_cuts_masks_and_pads_as_the_contract_says():
    prompts = [[11, 12, 13], [21]]
    n, t_in, k = 4, 5, 2
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (n, t_in))
    logp = -rng.random((n, t_in))
    tk_ids = rng.integers(0, 50, (n, t_in, k))
    tk_lp = -rng.random((n, t_in, k))
    lengths = np.array([3, 1, 0, 2])
    routed = rng.integers(0, 4, (n, 3 + t_in, 2, 1)).astype(np.int8)
    rb = build_batch(prompts, group_ids=[0, 0, 1, 1], lengths=lengths, completion_ids=ids, behavior_logprobs=logp,
                     topk_ids=tk_ids, topk_logprobs=tk_lp, weights_version=7,
                     finish_reason=["stop", "length", "length", "stop"], routed_experts=routed)
    t = 3  # the longest length
    mask = np.arange(t)[None] < lengths[:, None]
    np.testing.assert_array_equal(rb.completion_mask, mask)
    np.testing.assert_array_equal(rb.completion_ids, np.where(mask, ids[:, :t], 0))
    np.testing.assert_array_equal(rb.behavior_logprobs, np.where(mask, logp[:, :t], 0).astype(np.float32))
    np.testing.assert_array_equal(rb.topk_ids, np.where(mask[..., None], tk_ids[:, :t], 0))
    np.testing.assert_array_equal(rb.topk_logprobs, np.where(mask[..., None], tk_lp[:, :t], 0).astype(np.float32))
    np.testing.assert_array_equal(rb.prompt_ids, [[11, 12, 13]] * 2 + [[0, 0, 21]] * 2)
    np.testing.assert_array_equal(rb.prompt_mask, [[1, 1, 1]] * 2 + [[0, 0, 1]] * 2)
    np.testing.assert_array_equal(rb.weights_version, [7] * 4)
    np.testing.assert_array_equal(rb.group_ids, [0, 0, 1, 1])
    # routing: kept on real tokens (as sent), PAD on prompt pads and past each row's length
    fed = np.concatenate([rb.prompt_mask, mask], axis=1)
    want = np.where(fed[:, :, None, None], np.concatenate([routed[:, :3], routed[:, 3:3 + t]], 1), ROUTING_PAD)
    np.testing.assert_array_equal(rb.routed_experts, want)
    assert rb.routed_experts.dtype == np.int8
    # all rows empty, even sent as [N, 0]: one masked column
    empty = build_batch(prompts, group_ids=[0], lengths=[0], completion_ids=np.zeros((1, 0)),
                        behavior_logprobs=np.zeros((1, 0)), topk_ids=np.zeros((1, 0, k)),
                        topk_logprobs=np.zeros((1, 0, k)), weights_version=[1], finish_reason=["length"])
    assert empty.completion_ids.shape == (1, 1) and not empty.completion_mask.any()
    common = dict(completion_ids=ids, behavior_logprobs=logp, topk_ids=tk_ids, topk_logprobs=tk_lp,
                  weights_version=0, finish_reason=["stop"] * n)
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 2\), got -1..1"):
        build_batch(prompts, group_ids=[0, -1, 1, 1], lengths=lengths, **common)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 5\], got 0..6"):
        build_batch(prompts, group_ids=[0, 0, 1, 1], lengths=[6, 0, 0, 0], **common)
    with pytest.raises(ValueError, match="routed_experts must be"):
        build_batch(prompts, group_ids=[0, 0, 1, 1], lengths=lengths, routed_experts=routed[:, :4], **common)



def test_rollout_rejects_nonfinite_reward_naming_sample():
    with pytest.raises(ValueError, match=r"rewards\[1\].*nan"):
        _rollout(rewards=[1.0, np.nan])
    with pytest.raises(ValueError, match="rewards"):  # finite f64 that overflows f32
        _rollout(rewards=[1e300, 0.0])


def test_rollout_rejects_shape_and_mask_garbage():
    with pytest.raises(ValueError, match="topk_logprobs.*shape"):
        _rollout(topk_logprobs=np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="completion_mask"):
        _rollout(completion_mask=np.full((2, 3), 2))
    with pytest.raises(ValueError, match="weights_version"):
        _rollout(weights_version=[1.5, 1.0])
    with pytest.raises(ValueError, match="finish_reason"):
        _rollout(finish_reason=[b"stop", b"stop"])


def test_rollout_concatenate_pads_and_keeps_groups_distinct():
    a = _rollout(t=2, p=2)
    b = _rollout(n=4, t=4, p=3)
    empty = _rollout(n=0)
    cat = RolloutBatch.concatenate([empty, a, b])
    assert cat.completion_ids.shape == (6, 4) and cat.prompt_ids.shape == (6, 3)
    np.testing.assert_array_equal(cat.completion_mask.sum(1), [2, 2, 4, 4, 4, 4])
    assert not cat.prompt_mask[:2, 0].any() and cat.prompt_mask[:2, 1:].all()  # left-padded prompts
    np.testing.assert_array_equal(cat.group_ids, [0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="at least one"):
        RolloutBatch.concatenate([])
    with pytest.raises(ValueError, match="top_k"):
        RolloutBatch.concatenate([a, _rollout(k=3)])


def test_rollout_int_overflow_is_rejected_not_wrapped():
    with pytest.raises(ValueError, match="completion_ids"):
        _rollout(completion_ids=np.full((2, 3), 2**32 + 5, np.int64))


def test_rollout_string_ids_error_names_field():
    with pytest.raises(ValueError, match="completion_ids"):
        _rollout(completion_ids=np.full((2, 3), "1"))
