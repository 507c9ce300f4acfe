"""`pdm_jax.rollouts.producer.RolloutProducer`: rollouts sampled ahead within the staleness bound."""

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
