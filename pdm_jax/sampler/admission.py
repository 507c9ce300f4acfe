"""Admission of request bodies by bytes: a bound on the memory that concurrent requests' bodies may hold.

The sampler server (`pdm_jax.sampler.server`) decodes each body off the event loop, so concurrent requests decode
at once and each holds its raw bytes and its decoded form (JSON lists of integers take about ten times their text
in Python objects) until its answer is sent. A count of requests bounds none of that when bodies are large, so
every request with a body reserves its size (its ``Content-Length``, or the server's whole ``--max_body_bytes``
when it declares none) from one budget of bytes before any of it is read, and gives it back when its answer is
sent; the reservation shrinks to the bytes that arrived once the body is whole. A request that does not fit waits
its turn (first come, first served), at most ``timeout_s``; then the server answers 503 (``Retry-After``), which
clients retry. The memory bodies hold is then at most the budget times the decoding's expansion, whatever the
number of clients.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Optional


class BudgetTimeout(Exception):
    """A reservation did not fit the budget within its wait."""


class Reservation:
    """Bytes held from a `BodyBudget` (`BodyBudget.reserve`); ``nbytes`` is what it holds now."""

    def __init__(self, budget: "BodyBudget", nbytes: int):
        self.budget, self.nbytes = budget, int(nbytes)

    def shrink(self, nbytes: int) -> None:
        """Gives back what the reservation holds beyond `nbytes` (the body turned out smaller)."""
        nbytes = max(0, int(nbytes))
        if nbytes < self.nbytes:
            self.budget._give_back(self.nbytes - nbytes)
            self.nbytes = nbytes


class BodyBudget:
    """A budget of `limit_bytes` bytes shared by the bodies of the requests in flight (module docstring).

    Used from one event loop only (the server's); its accounting needs no lock. ``held`` is the bytes reserved
    now, ``peak`` the most ever reserved at once (never above ``limit_bytes``), ``waited`` and ``refused`` count
    the reservations that had to wait and those that timed out.

    Raises:
      ValueError: `limit_bytes` < 1.
    """

    def __init__(self, limit_bytes: int):
        if int(limit_bytes) < 1:
            raise ValueError(f"body budget must be >= 1 byte, got {limit_bytes!r}")
        self.limit = int(limit_bytes)
        self.held = self.peak = self.waited = self.refused = 0
        self._queue: collections.deque = collections.deque()  # [nbytes, future] of the waiting reservations

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        assert self.held <= self.limit, (self.held, self.limit)

    def _give_back(self, nbytes: int) -> None:
        self.held -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Admits the waiting reservations, first come first served, while the first of them fits."""
        while self._queue and self.held + self._queue[0][0] <= self.limit:
            nbytes, fut = self._queue.popleft()
            if not fut.done():
                self._take(nbytes)
                fut.set_result(None)

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, timeout_s: Optional[float]):
        """Holds `nbytes` (at most the limit) for the body of the block; yields the `Reservation`.

        Raises:
          ValueError: `nbytes` is negative or above the limit (the caller refuses such a body first).
          BudgetTimeout: it did not fit within `timeout_s` seconds (None: waits as long as it takes).
        """
        nbytes = int(nbytes)
        if not 0 <= nbytes <= self.limit:
            raise ValueError(f"a reservation of {nbytes} bytes never fits a budget of {self.limit} bytes")
        if not self._queue and self.held + nbytes <= self.limit:
            self._take(nbytes)
        else:
            self.waited += 1
            entry = [nbytes, asyncio.get_running_loop().create_future()]
            self._queue.append(entry)
            try:
                await asyncio.wait_for(asyncio.shield(entry[1]), timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError) as e:  # admitted meanwhile: give it back
                if entry[1].done() and not entry[1].cancelled():
                    self._give_back(nbytes)
                else:  # still waiting: leave the queue
                    entry[1].cancel()
                    with contextlib.suppress(ValueError):
                        self._queue.remove(entry)
                    self._wake()  # the next one may fit now that this one left the head
                if isinstance(e, asyncio.CancelledError):
                    raise
                self.refused += 1
                raise BudgetTimeout(f"{nbytes} bytes did not fit the body budget ({self.held} of {self.limit} "
                                    f"bytes held) within {timeout_s} s") from None
        reservation = Reservation(self, nbytes)
        try:
            yield reservation
        finally:
            self._give_back(reservation.nbytes)
            reservation.nbytes = 0
