"""DAPO's dynamic sampling (pdm_jax.rollouts.dynamic_sampling): rounds, dropped and filler groups, resume."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from pdm_jax.rl import dapo
from pdm_jax.rl.dapo import DapoSpec
from pdm_jax.rollouts.dynamic_sampling import DynamicSampler, refuse_per_host
from test_dapo import _batch  # one RolloutBatch builder for both files


class FakeDraws:
    """``draw`` for DynamicSampler: prompt i's group gets rewards REWARDS[i] (all equal when i % 3 == 0)."""

    def __init__(self, group_size=2):
        self.g = group_size
        self.calls = []

    @staticmethod
    def rewards(i, g):
        return [float(i % 2)] * g if i % 3 == 0 else [float(j % 2) for j in range(g)]

    def __call__(self, position, step, round_, prompts=3):
        self.calls.append((position, step, round_))
        n = prompts * self.g
        rb = _batch([1 + (position + k // self.g) % 5 for k in range(n)], None, t=6)
        rb = rb.replace(group_ids=np.arange(n) // self.g)
        return rb, [position + i for i in range(prompts)], 0.5

    def score(self, rb, examples):
        return np.concatenate([self.rewards(e, self.g) for e in examples]).astype(np.float32)


def test_dynamic_sampler_drops_all_equal_groups_and_counts_the_rounds():
    fake = FakeDraws()
    sampler = DynamicSampler(DapoSpec(dynamic_sampling=True, max_rounds=4), draw=fake, score=fake.score,
                             prompts_per_step=3, group_size=2, first_step=0, position=0)
    rb, examples, seconds, draw = sampler(0)
    # prompts 0..2: 0 all-equal; 3..5: 3 all-equal -> 4 informative after 2 rounds; keep 1, 2, 4
    assert examples == [1, 2, 4] and fake.calls == [(0, 0, 0), (3, 0, 1)] and seconds == 1.0
    assert draw.counts == dict(rounds=2, dropped=2, filler=0, surplus=1) and draw.filler is None
    assert draw.data_end == 6
    np.testing.assert_array_equal(rb.group_ids, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(rb.rewards, fake.score(None, [1, 2, 4]))
    np.testing.assert_array_equal(rb.completion_mask.sum(1), [2, 2, 3, 3, 5, 5])  # the rows of prompts 1, 2, 4
    # step 1 starts where step 0 ended; a sampler resumed there draws the same prompts with the same seeds
    rb1, ex1, _, d1 = sampler(1)
    resumed_fake = FakeDraws()
    resumed = DynamicSampler(sampler.spec, draw=resumed_fake, score=resumed_fake.score, prompts_per_step=3,
                             group_size=2, first_step=1, position=draw.data_end)
    rb1r, ex1r, _, d1r = resumed(1)
    assert ex1 == ex1r == [7, 8, 10] and d1 == d1r and resumed_fake.calls == fake.calls[2:]
    np.testing.assert_array_equal(rb1.completion_ids, rb1r.completion_ids)
    with pytest.raises(RuntimeError, match="asked for step 5, expected 2"):
        sampler(5)


def test_dynamic_sampler_at_its_bound_fills_with_masked_groups(caplog):
    fake = FakeDraws()
    spec = DapoSpec(dynamic_sampling=True, max_rounds=1)
    sampler = DynamicSampler(spec, draw=fake, score=fake.score, prompts_per_step=3, group_size=2, first_step=0,
                             position=3)
    with caplog.at_level(logging.WARNING, logger="pdm_jax"):
        rb, examples, _, draw = sampler(0)
    assert examples == [4, 5, 3]  # the informative 4 and 5, then the all-equal 3 as filler
    assert draw.counts == dict(rounds=1, dropped=1, filler=1, surplus=0) and draw.data_end == 6
    np.testing.assert_array_equal(draw.filler, [False, False, False, False, True, True])
    assert "holds 2 informative groups of 3 after 1 rounds" in caplog.text
    masked = dapo.without_loss(rb, dapo.no_loss_rows(rb, spec, draw.filler))
    np.testing.assert_array_equal(masked.completion_mask.sum(1)[4:], [0, 0])
    rec = dapo.step_record(dict(length=rb.completion_mask.sum(1)), spec, draw.counts)
    assert rec == dict(dynamic_sampling_rounds=1.0, dynamic_sampling_dropped_groups=1.0,
                       dynamic_sampling_filler_groups=1.0, dynamic_sampling_surplus_groups=0.0)


def test_the_shaping_decides_which_groups_are_informative():
    """A group of equal task rewards and different lengths in the buffer is informative once shaped."""
    fake = FakeDraws()
    spec = DapoSpec(dynamic_sampling=True, max_rounds=1, overlong_max_length=6, overlong_buffer_len=4)
    rb, _, _, draw = DynamicSampler(spec, draw=lambda p, s, r: fake(p, s, r, prompts=1), score=lambda rb, ex:
                                    np.ones(2, np.float32), prompts_per_step=1, group_size=2, first_step=0,
                                    position=0)(0)
    assert draw.counts["filler"] == 1  # lengths 1, 1: both unpunished, all equal
    rb, _, _, draw = DynamicSampler(spec, draw=lambda p, s, r: (_batch([2, 5], None), [0], 0.0), score=lambda rb, ex:
                                    np.ones(2, np.float32), prompts_per_step=1, group_size=2, first_step=0,
                                    position=0)(0)
    assert draw.counts["filler"] == 0 and draw.filler is None  # 2 -> 0, 5 -> -0.75


def test_step_record_overlong_fields():
    spec = DapoSpec(overlong_max_length=6, overlong_buffer_len=2, overlong_filtering=True)
    rec = dapo.step_record(dict(length=np.array([2, 5, 6, 6]), truncated=np.array([False, False, True, False])), spec)
    assert rec == pytest.approx(dict(overlong_penalty=(0 - 0.5 - 1 - 1) / 4, overlong_filtered=0.25))
    assert dapo.step_record(dict(length=np.array([9])), DapoSpec()) == {}


def test_dynamic_sampling_is_refused_with_per_host_rollouts():
    refuse_per_host(DapoSpec(dynamic_sampling=True), False)
    refuse_per_host(DapoSpec(), True)
    with pytest.raises(ValueError, match=r"rl\.dynamic_sampling = True: not implemented with per-host"):
        refuse_per_host(DapoSpec(dynamic_sampling=True), True)


@pytest.mark.slow
def test_a_tiny_run_with_dynamic_sampling_logs_its_dropped_groups(tmp_path, monkeypatch):
    """Two RL steps of a barely warm-started model with dynamic sampling (2 rounds) and overlong filtering: few
    groups are informative, so each step samples both rounds, drops its all-equal groups and fills up at the
    bound; the records count them, the step batch carries no loss on filler and truncated rows, and the
    checkpoint's data position is where the rounds' prompts ended."""
    from test_trainer import _rl_records, tiny_test_config
    from pdm_jax.trainer import Trainer

    c = tiny_test_config(**{"sampler.mode": "in_process", "rl.steps": 2, "rl.dynamic_sampling": True,
                            "rl.dynamic_sampling_max_rounds": 2, "rl.overlong_filtering": True, "sft.steps": 4})
    seen, real = [], Trainer._step_batch

    def spy(self, rb, ref, filler=None):
        batch = real(self, rb, ref, filler)
        seen.append((rb, filler, batch))
        return batch

    monkeypatch.setattr(Trainer, "_step_batch", spy)
    Trainer(c, str(tmp_path)).run()
    recs = _rl_records(tmp_path)
    assert sorted(recs) == [1, 2] and len(seen) == 2
    g = c.rl.group_size
    for (rb, filler, batch), r in zip(seen, (recs[1], recs[2])):
        assert 1 <= r["dynamic_sampling_rounds"] <= 2
        assert r["dynamic_sampling_filler_groups"] <= r["dynamic_sampling_dropped_groups"]
        n_filler = 0 if filler is None else int(filler.sum())
        assert n_filler == g * r["dynamic_sampling_filler_groups"]
        assert rb.num_sequences == c.rl.prompts_per_step * g  # the static shape
        truncated = rb.finish_reason == "length"
        assert r["overlong_filtered"] == pytest.approx(truncated.mean())
        no_loss = truncated | (filler if filler is not None else False)
        want = np.where(no_loss, 0, rb.completion_mask.sum(1))
        np.testing.assert_array_equal(np.asarray(batch.completion_mask).sum(1), want)
        if filler is not None:
            assert not np.asarray(batch.advantages)[filler].any()  # all-equal groups: zero advantage too
        assert r["num_valid"] * c.rl.num_minibatches == want.sum()  # the loss's tokens: the rest only
        assert r["response_length"] == pytest.approx(rb.completion_mask.sum(1).mean())  # as sampled
    assert sum(r["dynamic_sampling_dropped_groups"] for r in recs.values()) > 0
    assert sum(r["dynamic_sampling_filler_groups"] for r in recs.values()) > 0  # the bound, reached and counted
    ckpts = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    meta = json.load(open(tmp_path / "checkpoints" / str(ckpts[-1]) / "meta" / "metadata"))
    assert meta["data_position"] == c.rl.prompts_per_step * sum(r["dynamic_sampling_rounds"] for r in recs.values())
    # Resumed after RL step 1 (its checkpoint the latest), step 2 draws the same prompts and rows again.
    shutil.rmtree(tmp_path / "checkpoints" / str(ckpts[-1]))
    Trainer(c, str(tmp_path)).run()
    assert len(seen) == 3
    np.testing.assert_array_equal(seen[2][0].completion_ids, seen[1][0].completion_ids)
    np.testing.assert_array_equal(seen[2][0].prompt_ids, seen[1][0].prompt_ids)
    redone = _rl_records(tmp_path)[2]
    for k in ("dynamic_sampling_rounds", "dynamic_sampling_dropped_groups", "dynamic_sampling_filler_groups",
              "reward", "response_length", "overlong_filtered", "num_valid"):
        assert redone[k] == recs[2][k], k
