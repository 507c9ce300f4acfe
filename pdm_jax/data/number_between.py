"""``number_between``: a reasoning-gym task whose prompts have many right answers.

A prompt names an open interval, ``3721<x<3760=``, and any integer strictly inside it is right; the reference answer
is one drawn uniformly, so after the warm start the answer tokens stay uncertain: where the ratio (DPPO) and
predictive (PDM) direction tests can decide differently (reports/disagreement_map). Registered with
``reasoning_gym.register_dataset`` (``data.task = "number_between"``, ``data.prompt_format = "question"``, the config
below in ``data.task_config``); item ``i`` of seed ``s`` is drawn from ``random.Random(s + i)``. Scoring: 1.0 if the
stripped answer is a plain decimal integer (optional minus, ASCII digits, leading zeros up to one character more than
the longer bound) strictly between the bounds, else 0.0."""

from __future__ import annotations

import dataclasses
import random
import re
import threading
from typing import Any, Optional

from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS, register_dataset

NAME = "number_between"
_INTEGER_RE = re.compile(r"^-?[0-9]+$")
_REGISTER_LOCK = threading.Lock()


@dataclasses.dataclass
class NumberBetweenConfig:
    """The task's settings (``data.task_config``): bounds in [min_value, max_value], the interval's width ``hi - lo`` in
    [min_width, max_width] (``width - 1`` right answers), both drawn uniformly.

    Raises (`validate`): ValueError naming the field when a width is below 2 (no integer strictly inside),
    ``min_width > max_width``, or ``max_value - min_value < max_width``."""

    min_value: int = 0
    max_value: int = 9999
    min_width: int = 5
    max_width: int = 50
    seed: Optional[int] = None
    size: int = 500

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range (see the class docstring)."""
        for name in ("min_value", "max_value", "min_width", "max_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"data.task_config.{name} must be an integer, got {value!r}")
        if self.min_width < 2:
            raise ValueError(f"data.task_config.min_width must be >= 2 (an integer strictly inside), got "
                             f"{self.min_width}")
        if self.max_width < self.min_width:
            raise ValueError(f"data.task_config.max_width must be >= min_width = {self.min_width}, got "
                             f"{self.max_width}")
        if self.max_value - self.min_value < self.max_width:
            raise ValueError(f"data.task_config.max_value must be >= min_value + max_width = "
                             f"{self.min_value + self.max_width}, got {self.max_value}")


class NumberBetweenDataset(ProceduralDataset):
    """Items ``{"question": "lo<x<hi=", "answer": a uniform integer in (lo, hi), "metadata": {"lo", "hi"}}``."""

    def __init__(self, config: NumberBetweenConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Item ``idx``: drawn from ``random.Random(seed + idx)`` (any index, not only those below ``size``)."""
        c, rng = self.config, random.Random(self.seed + idx)
        width = rng.randint(c.min_width, c.max_width)
        lo = rng.randint(c.min_value, c.max_value - width)
        hi = lo + width
        return {"question": f"{lo}<x<{hi}=", "answer": str(rng.randint(lo + 1, hi - 1)),
                "metadata": {"lo": lo, "hi": hi}}

    def score_answer(self, answer: Optional[str], entry: dict[str, Any]) -> float:
        """1.0 for a plain integer strictly between ``entry["metadata"]``'s lo and hi, else 0.0 (never raises on a
        malformed answer; a malformed entry raises KeyError / TypeError, which the source counts)."""
        lo, hi = int(entry["metadata"]["lo"]), int(entry["metadata"]["hi"])
        if not isinstance(answer, str):
            return 0.0
        answer = answer.strip()
        # longer than any integer in (lo, hi) can be (leading zeros included up to that length): wrong, and never handed
        # to int(), which refuses strings of over 4,300 digits
        if len(answer) > max(len(str(lo)), len(str(hi))) + 1 or not _INTEGER_RE.match(answer):
            return 0.0
        return 1.0 if lo < int(answer) < hi else 0.0


def register() -> None:
    """Registers the task with reasoning-gym once per process (later calls, from any thread, do nothing)."""
    with _REGISTER_LOCK:
        if NAME not in DATASETS:
            register_dataset(NAME, NumberBetweenDataset, NumberBetweenConfig)
