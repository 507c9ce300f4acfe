"""`pdm_jax.sampler.admission`: the byte budget that admits the sampler server's request bodies (its accounting;
tests/test_sampler_hostile.py checks it in a real server)."""

import asyncio

import pytest

from pdm_jax.sampler.admission import BodyBudget, BudgetTimeout


def test_body_budget_never_admits_more_than_its_bytes_first_come_first_served():
    """The accounting alone: 12 reservations of 3..7 bytes against a budget of 10 never hold more than 10 at once,
    are admitted in arrival order (a large one is not overtaken), a wait past its bound is refused and leaves no
    bytes behind, and a reservation shrinks to its body's size."""
    async def scenario():
        budget = BodyBudget(10)
        order, seen = [], []

        async def request(i, n):
            async with budget.reserve(n, timeout_s=5) as r:
                order.append(i)
                seen.append(budget.held)
                await asyncio.sleep(0.01 * (1 + i % 3))
                r.shrink(n - 1)
                seen.append(budget.held)

        sizes = [3, 7, 5, 4, 6, 3, 7, 5, 4, 6, 3, 7]
        await asyncio.gather(*(request(i, n) for i, n in enumerate(sizes)))
        assert order == list(range(len(sizes)))  # FIFO: the 7s waited for room, nobody overtook them
        assert max(seen) <= 10 and budget.peak <= 10 and budget.held == 0 and budget.waited >= 6
        async with budget.reserve(10, timeout_s=5):
            with pytest.raises(BudgetTimeout, match="1 bytes did not fit the body budget"):
                async with budget.reserve(1, timeout_s=0.05):
                    pass
        assert budget.held == 0 and budget.refused == 1 and not budget._queue
        with pytest.raises(ValueError, match="never fits"):
            async with budget.reserve(11, timeout_s=1):
                pass
    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_the_queue_and_wakes_the_next():
    """A waiting request whose client went away (its task cancelled) neither keeps bytes nor blocks the requests
    behind it."""
    async def scenario():
        budget = BodyBudget(10)
        admitted = []

        async def request(n, name):
            async with budget.reserve(n, timeout_s=5):
                admitted.append(name)
                await asyncio.sleep(0.05)

        async with budget.reserve(6, timeout_s=1):
            big = asyncio.ensure_future(request(8, "big"))  # waits: 6 + 8 > 10
            await asyncio.sleep(0.01)
            small = asyncio.ensure_future(request(2, "small"))  # fits, but waits behind big (first come first served)
            await asyncio.sleep(0.01)
            assert admitted == [] and len(budget._queue) == 2
            big.cancel()
            await asyncio.sleep(0.01)
            assert admitted == ["small"] and budget.held == 8
        await small
        with pytest.raises(asyncio.CancelledError):
            await big
        assert budget.held == 0 and not budget._queue and budget.refused == 0
    asyncio.run(scenario())
