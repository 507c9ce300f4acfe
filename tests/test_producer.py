"""`pdm_jax.rollouts.producer.RolloutProducer`: rollouts sampled ahead within the staleness bound."""

import time

import pytest

from pdm_jax.rollouts.producer import RolloutProducer


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_producer_keeps_step_order_and_the_staleness_bound(staleness):
    seen = []
    producer = None

    def make(step):
        seen.append((step, producer.version if producer else 0))
        return f"batch {step}"

    producer = RolloutProducer(make, first_step=0, last_step=5, max_staleness=staleness, version=0)
    try:
        for step in range(5):
            assert producer.get(step) == f"batch {step}"
            producer.notify_version(step + 1)
    finally:
        producer.close()
    assert [s for s, _ in seen] == list(range(5))
    assert all(v >= s - staleness for s, v in seen)  # batch s sampled with a version >= s - staleness


def test_producer_surfaces_the_thread_error():
    def make(step):
        raise RuntimeError(f"boom at {step}")

    producer = RolloutProducer(make, first_step=0, last_step=3, max_staleness=1, version=0)
    with pytest.raises(RuntimeError, match="boom at 0"):
        producer.get(0)
    producer.close()


class _Sampler:
    """The weights version the sampler serves; ``make`` records it with the step, as a rollout batch's version."""

    def __init__(self, version):
        self.version = version

    def make(self, step):
        return step, self.version


def _drive(producer, sampler, steps, last, log):
    """Trains ``steps`` as the trainer does (get, then the next version), with the sampler the faster side: after
    each new version every batch it allows is sampled before the next step, so the versions are deterministic."""
    for step in steps:
        log.append(producer.get(step))
        sampler.version = step + 1
        producer.notify_version(step + 1)
        want = set(range(step + 1, min(step + 2 + producer.staleness, last)))
        deadline = time.monotonic() + 60
        while set(producer.snapshot()) != want:
            assert time.monotonic() < deadline, (step, sorted(producer.snapshot()), sorted(want))
            time.sleep(0.001)


def _run(first, last, staleness, steps, log, queued=None):
    """A producer from ``first`` (the sampler at version ``first``) driven over ``steps``; returns its final queue."""
    sampler = _Sampler(first)
    producer = RolloutProducer(sampler.make, first_step=first, last_step=last, max_staleness=staleness,
                               version=first, queued=queued)
    try:
        _drive(producer, sampler, steps, last, log)
        return producer.snapshot()
    finally:
        producer.close()


def test_a_resumed_producer_trains_on_the_batches_queued_at_the_checkpoint():
    # Batch i is sampled with the version the sampler holds then (>= i - s). Uninterrupted, s = 2 and a fast
    # sampler: batch i at version max(0, i - 2), staleness (i + 1) - 1 - version = min(i, 2). A run stopped after
    # step 4 resumes with the snapshot of its queue: the same (step, version) batches, hence the same staleness.
    # Without the queue it samples batches 4-6 at version 4 (staleness 0, 1, 2: the ramp restarts).
    s, last = 2, 8
    ref = []
    _run(0, last, s, range(last), ref)
    assert ref == [(i, max(0, i - s)) for i in range(last)]
    got = []
    queue = _run(0, last, s, range(4), got)  # what the checkpoint after step 4 saves
    assert queue == {4: (4, 2), 5: (5, 3), 6: (6, 4)}  # s + 1 batches: 6 needs version >= 4, just pushed
    _run(4, last, s, range(4, last), got, queued=queue)  # the resumed run
    assert got == ref
    assert [step - version for step, version in got] == [0, 1, 2, 2, 2, 2, 2, 2]  # the rl records' staleness
    fresh = []
    _run(4, last, s, range(4, last), fresh)  # no queue: the sampler starts from the checkpoint's version
    assert [step - version for step, version in fresh] == [0, 1, 2, 2]


def test_queued_batches_need_staleness_and_consecutive_steps():
    with pytest.raises(ValueError, match="max_staleness > 0"):
        RolloutProducer(lambda s: s, first_step=3, last_step=5, max_staleness=0, version=3, queued={3: "b"})
    with pytest.raises(ValueError, match="consecutive steps from first_step = 3"):
        RolloutProducer(lambda s: s, first_step=3, last_step=6, max_staleness=2, version=3, queued={4: "b"})
