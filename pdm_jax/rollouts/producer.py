"""`RolloutProducer`: rollout batches in step order, with at most ``max_staleness`` versions of lag.

The producer knows nothing of the trainer: it is handed ``make_batch(step)``, a
callable that returns the rollouts of RL step ``step`` (its prompts and seed are
a function of the step alone, so a retried or resumed batch is the same batch),
and is told each new sampler version with :meth:`notify_version`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class RolloutProducer:
    """Produces ``make_batch(step)`` for steps ``first_step .. last_step - 1`` in order.

    With ``max_staleness = 0`` generation is synchronous: :meth:`get` calls
    ``make_batch`` itself (batch i is sampled with version i, right after the
    trainer pushed it). With ``max_staleness = s > 0`` a background thread
    samples batch i as soon as the sampler holds a version >= i - s, overlapping
    generation with training.

    Args:
      make_batch: ``step -> item`` (whatever the caller wants back from :meth:`get`).
      first_step, last_step: the half-open range of RL steps to produce.
      max_staleness: s >= 0, versions the sampler may lag behind the trainer.
      version: the sampler's weights version now.

    An exception raised by ``make_batch`` on the thread is re-raised by :meth:`get`.
    """

    def __init__(self, make_batch: Callable[[int], Any], *, first_step: int, last_step: int, max_staleness: int,
                 version: int):
        self._make = make_batch
        self.staleness = int(max_staleness)
        self.version = version
        self._cv = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread = None
        if self.staleness > 0:
            self._thread = threading.Thread(target=self._loop, args=(first_step, last_step), daemon=True)
            self._thread.start()

    def _loop(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self.version >= step - self.staleness)
                    if self._stop:
                        return
                item = self._make(step)
                with self._cv:
                    self._ready[step] = item
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
