"""`RolloutProducer`: rollout batches in step order, with at most ``max_staleness`` versions of lag.

It is handed ``make_batch(step)`` (a batch is a function of its step, so a retried batch is the same) and told each
new sampler version (:meth:`notify_version`). With ``max_staleness`` > 0 a batch's weights version is not a function
of its step, so :meth:`snapshot` returns the batches queued ahead for the checkpoint (``pdm_jax.rollouts.queued``)
and ``queued=`` hands them back on resume: the resumed run trains on the uninterrupted run's very batches."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class RolloutProducer:
    """Produces ``make_batch(step)`` for steps ``first_step .. last_step - 1`` in order: synchronously in :meth:`get`
    with ``max_staleness = 0``, else on a background thread as soon as the sampler holds a version >= i - s.

    Args:
      make_batch: ``step -> item``.
      first_step, last_step: the half-open range of RL steps.
      max_staleness: s >= 0, versions the sampler may lag behind the trainer.
      version: the sampler's weights version now.
      queued: ``{step: item}`` of consecutive steps from ``first_step`` produced before a checkpoint (only with s >
        0).

    An exception of ``make_batch`` on the thread is re-raised by :meth:`get`.

    Raises:
      ValueError: ``queued`` with ``max_staleness`` = 0, or not ``first_step, first_step + 1, ...``."""

    def __init__(self, make_batch: Callable[[int], Any], *, first_step: int, last_step: int, max_staleness: int,
                 version: int, queued: Optional[dict] = None):
        self._make = make_batch
        self.staleness = int(max_staleness)
        self.version = version
        self._cv = threading.Condition()
        self._ready: dict[int, Any] = dict(queued or {})
        if self._ready and (self.staleness == 0 or sorted(self._ready) != list(
                range(first_step, first_step + len(self._ready)))):
            raise ValueError(f"queued batches for steps {sorted(self._ready)} need max_staleness > 0 (got "
                             f"{self.staleness}) and consecutive steps from first_step = {first_step}")
        self._error: Optional[BaseException] = None
        self._stop = False
        self._paused = False
        self._making = False
        self._thread = None
        if self.staleness > 0:
            self._thread = threading.Thread(target=self._loop, args=(first_step + len(self._ready), last_step),
                                            daemon=True)
            self._thread.start()

    def _loop(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or (not self._paused
                                                             and self.version >= step - self.staleness))
                    if self._stop:
                        return
                    self._making = True
                try:
                    item = self._make(step)
                except BaseException:
                    with self._cv:
                        self._making = False
                    raise
                with self._cv:  # stored and no longer in the making at once: a snapshot sees it either way
                    self._ready[step] = item
                    self._making = False
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced in get()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def get(self, step: int):
        """The item of ``step`` (blocks until it is produced); re-raises the producer thread's error."""
        if self._thread is None:
            return self._make(step)
        with self._cv:
            self._cv.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                raise self._error
            return self._ready.pop(step)

    def snapshot(self) -> dict:
        """A copy of ``{step: item}`` produced ahead and not yet taken (empty with s = 0), for a checkpoint; waits for a
        batch being sampled. Call it between :meth:`get` calls."""
        if self._thread is None:
            return {}
        with self._cv:
            self._paused = True
            try:
                self._cv.wait_for(lambda: not self._making)
                return dict(self._ready)
            finally:
                self._paused = False
                self._cv.notify_all()

    def notify_version(self, version: int) -> None:
        """Tells the producer that the sampler now serves weights ``version``."""
        with self._cv:
            self.version = version
            self._cv.notify_all()

    def close(self) -> None:
        """Stops the thread (after its current batch) and waits for it, at most 60 s."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
