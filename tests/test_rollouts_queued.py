"""pdm_jax.rollouts.queued: the batches sampled ahead of a checkpoint, saved with it and read back exactly."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from pdm_jax.checkpointing import Checkpointer, CheckpointError, abstract_like
from pdm_jax.data.tasks import Example
from pdm_jax.rollout import RolloutBatch
from pdm_jax.rollouts import queued
from pdm_jax.rollouts.dynamic_sampling import Draw


def _batch(seed, n=4, p=3, t=2, k=2, rewards=False):
    rng = np.random.default_rng(seed)
    return RolloutBatch(
        prompt_ids=rng.integers(1, 9, (n, p)), prompt_mask=rng.random((n, p)) > 0.3,
        completion_ids=rng.integers(1, 9, (n, t)), completion_mask=np.ones((n, t), bool),
        behavior_logprobs=-rng.random((n, t)), topk_ids=rng.integers(0, 9, (n, t, k)),
        topk_logprobs=-rng.random((n, t, k)), weights_version=np.array([1, 1, 2, 2]), group_ids=np.arange(n) // 2,
        finish_reason=["length", "stop", "stop", "length"], rewards=rng.random(n) if rewards else None)


def _items():
    exs = [Example(prompt="1+2=", answer="3", uid="chain_sum/train/7", meta={"terms": [1, 2]}),
           Example(prompt="4+5=", answer="9", uid="chain_sum/train/8", meta={})]
    return {5: (_batch(0), exs, 0.25), 6: (_batch(1, rewards=True), exs[::-1], 1.5)}


def _assert_items_equal(got, want):
    assert sorted(got) == sorted(want)
    for step, (rb, exs, seconds, *draw) in want.items():
        grb, gexs, gseconds, *gdraw = got[step]
        assert gexs == exs and gseconds == seconds and len(gdraw) == len(draw)
        for a, b in zip(gdraw, draw):  # dynamic sampling's Draw
            assert (a.data_end, a.counts) == (b.data_end, b.counts)
            assert (a.filler is None and b.filler is None) or np.array_equal(a.filler, b.filler)
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behavior_logprobs",
                     "topk_ids", "topk_logprobs", "weights_version", "group_ids", "finish_reason", "rewards"):
            a, b = getattr(grb, name), getattr(rb, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_encode_decode_is_exact_and_another_staleness_is_not_used(caplog):
    items = _items()
    data = queued.encode(items, max_staleness=2, process_count=1)
    _assert_items_equal(queued.decode(data, max_staleness=2, process_count=1), items)
    with caplog.at_level(logging.WARNING):
        assert queued.decode(data, max_staleness=3, process_count=1, where="ckpt/9") == {}
    assert "ckpt/9: queued rollouts written with rl.max_staleness = 2 on 1 process(es), this run has 3" in caplog.text
    assert queued.checkpoint_files({}, 0) is None


def test_dynamic_sampling_items_keep_their_draw():
    _, exs, _ = _items()[5]
    counts = dict(rounds=2, dropped=1, filler=0, surplus=1)
    items = {3: (_batch(2, rewards=True), exs, 0.5, Draw(data_end=40, filler=None, counts=counts)),
             4: (_batch(3, rewards=True), exs, 0.75, Draw(data_end=48, filler=np.array([0, 0, 1, 1], bool),
                                                           counts=dict(counts, filler=1)))}
    _assert_items_equal(queued.decode(queued.encode(items, max_staleness=1, process_count=1), max_staleness=1,
                                      process_count=1), items)
    with pytest.raises(TypeError, match=r"queued step 3: expected \(RolloutBatch, examples, seconds\[, Draw\]\)"):
        queued.encode({3: ("not a batch", exs, 0.5)}, max_staleness=1, process_count=1)


def test_saved_with_the_checkpoint_under_its_manifest(tmp_path):
    state = {"step": jnp.asarray(3, jnp.int32), "w": jnp.arange(8, dtype=jnp.float32)}
    c = Checkpointer(str(tmp_path / "ckpt"))
    c.save(3, state, {"rl_step": 3}, extra_files=queued.checkpoint_files(_items(), 2))
    c.save(4, state, {"rl_step": 4})  # no queue: nothing to read back
    _assert_items_equal(queued.read(c, 3, 2), _items())
    assert queued.read(c, 4, 2) == {}
    assert queued.read(c, None, 2) == {}
    assert queued.read(c, 3, 0) == {}
    c.restore(abstract_like(state), 3)  # the file is in the manifest
    path = tmp_path / "ckpt" / "3" / queued.file_name(0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="queued_rollouts.p0.npz"):
        c.restore(abstract_like(state), 3)
    c.close()


def test_a_file_of_other_batch_settings_is_not_used(caplog, tmp_path):
    """A resume may change the config: batches sampled under other rows, widths, temperature or item layout are
    not trained on (logged, naming the fields). Without the key a plain run's file resumed with rl.dynamic_sampling
    reached the trainer's ``ahead[max(ahead)][3]`` (IndexError), and 2 x 2 rows read as 1 x 4 were regrouped."""
    from types import SimpleNamespace
    rl = SimpleNamespace(prompts_per_step=2, group_size=2, max_new_tokens=2, top_k_logprobs=2)
    key = queued.batch_key(rl, 1.0, False)
    assert key == dict(prompts_per_step=2, group_size=2, max_new_tokens=2, top_k=2, temperature=1.0,
                       dynamic_sampling=False)
    data = queued.encode(_items(), max_staleness=2, process_count=1, key=key)
    _assert_items_equal(queued.decode(data, max_staleness=2, process_count=1, key=dict(key)), _items())
    for change, field in ((dict(dynamic_sampling=True), "dynamic_sampling"), (dict(group_size=4), "group_size"),
                          (dict(prompts_per_step=1), "prompts_per_step"), (dict(temperature=0.7), "temperature")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert queued.decode(data, max_staleness=2, process_count=1, key=dict(key, **change), where="c/9") == {}
        assert f"c/9: queued rollouts written with {{'{field}': {key[field]!r}}}, this run has" in caplog.text
    unkeyed = queued.encode(_items(), max_staleness=2, process_count=1)  # a file without a key: not used
    assert queued.decode(unkeyed, max_staleness=2, process_count=1, key=key) == {}
    c = Checkpointer(str(tmp_path / "ckpt"))  # through the checkpoint, as the trainer saves and reads it
    state = {"w": jnp.arange(4, dtype=jnp.float32)}
    c.save(3, state, {"rl_step": 3}, extra_files=queued.checkpoint_files(_items(), 2, key=key))
    _assert_items_equal(queued.read(c, 3, 2, key=key), _items())
    assert queued.read(c, 3, 2, key=dict(key, dynamic_sampling=True)) == {}
    c.close()
