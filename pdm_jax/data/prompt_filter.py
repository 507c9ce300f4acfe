"""Over-long prompts filtered when the data is loaded, not discovered mid-run.

The sampler refuses a prompt over ``sampler.max_prompt_length`` tokens; `filter_long_prompts` wraps a source once the
tokenizer exists and drops such examples from the training stream and the held-out set, counting them (as verl's
``filter_overlong_prompts`` and EasyR1 do). Training position ``i`` is the source's ``i`` when it fits, else the
first fitting one of ``i + PROBE_STRIDE``, ``i + 2 * PROBE_STRIDE``, ... (at most MAX_PROBES; an odd prime stride
steps through every residue of a wrapping pool): deterministic, and the identity when nothing is too long."""

from __future__ import annotations

import logging
import operator
import threading
from typing import Callable, Sequence

from pdm_jax.data.tasks import Example, PromptSource, _check_index

__all__ = ["LengthFilteredSource", "filter_long_prompts", "MAX_PROBES", "PROBE_STRIDE", "SCAN_SIZE"]

logger = logging.getLogger(__name__)

#: Stride between the source positions probed for one filtered position (an odd prime).
PROBE_STRIDE = 1_000_003
#: Probes per training position before a RuntimeError (below (1 - 1/SCAN_SIZE) ** MAX_PROBES ~ 3e-9 per position:
#: the load-time scan found a fitting prompt).
MAX_PROBES = 10_000
#: Training positions 0 .. SCAN_SIZE - 1 are encoded at load: their over-long count is logged and
#: a stream in which none fits fails at start.
SCAN_SIZE = 512

_FIELD = "sampler.max_prompt_length"


class LengthFilteredSource:
    """A `PromptSource` without the examples whose prompt encodes to more than `max_prompt_length` tokens; everything
    else is the wrapped source's.

    Attributes:
      source: the wrapped source.
      max_prompt_length: the limit in tokens (inclusive).
      num_eval_dropped / num_eval_total: held-out examples dropped / of the source.
      train_scan_size / train_scan_dropped: training positions encoded at load, and how many were too long.
      num_train_dropped: over-long training examples skipped while serving the stream (thread-safe).
      longest_prompt: the longest prompt seen in tokens."""

    def __init__(self, source: PromptSource, encode: Callable[[str], Sequence[int]], max_prompt_length: int):
        try:
            if isinstance(max_prompt_length, bool):
                raise TypeError
            max_prompt_length = operator.index(max_prompt_length)  # int, numpy integer; not float
        except TypeError:
            raise ValueError(f"{_FIELD} must be an int >= 1, got {max_prompt_length!r}") from None
        if max_prompt_length < 1:
            raise ValueError(f"{_FIELD} must be an int >= 1, got {max_prompt_length!r}")
        self.source = source
        self.max_prompt_length = max_prompt_length
        self._encode = encode
        self._lock = threading.Lock()
        self.num_train_dropped = 0
        self.longest_prompt = 0
        eval_all = source.eval_examples()
        self._eval = [ex for ex in eval_all if self._fits(ex)]
        self.num_eval_total = len(eval_all)
        self.num_eval_dropped = len(eval_all) - len(self._eval)
        scan = [source.train_example(i) for i in range(SCAN_SIZE)]
        self.train_scan_size = len(scan)
        self.train_scan_dropped = sum(not self._fits(ex) for ex in scan)
        self._check_something_fits()
        if self.num_eval_dropped or self.train_scan_dropped:
            logger.warning("data: %s", self.describe())
        else:
            logger.info("data: %s", self.describe())

    # -- internals -------------------------------------------------------------------------

    def _fits(self, example: Example) -> bool:
        length = len(self._encode(example.prompt))
        with self._lock:
            self.longest_prompt = max(self.longest_prompt, length)
        return length <= self.max_prompt_length

    def _check_something_fits(self) -> None:
        limit = f"{_FIELD} = {self.max_prompt_length} tokens"
        if self.num_eval_total and not self._eval:
            raise ValueError(f"every one of the {self.num_eval_total} held-out prompts of {self.source.name} is "
                             f"longer than {limit} (longest {self.longest_prompt}): raise {_FIELD} or "
                             "shorten the prompts")
        if self.train_scan_dropped == self.train_scan_size:
            raise ValueError(f"every one of the first {self.train_scan_size} training prompts of "
                             f"{self.source.name} is longer than {limit} (longest {self.longest_prompt}): "
                             f"raise {_FIELD} or shorten the prompts")

    def describe(self) -> str:
        """One log line: what was dropped, out of what, and the limit."""
        return (f"{self.source.name}: dropped {self.num_eval_dropped} of {self.num_eval_total} held-out prompts "
                f"and {self.train_scan_dropped} of the first {self.train_scan_size} training prompts longer than "
                f"{_FIELD} = {self.max_prompt_length} tokens (longest seen: {self.longest_prompt})")

    def summary(self) -> dict:
        """The counts as a JSON-ready dict (see the class attributes)."""
        with self._lock:
            dropped = self.num_train_dropped
        return dict(max_prompt_length=self.max_prompt_length, num_eval_dropped=self.num_eval_dropped,
                    num_eval_total=self.num_eval_total, train_scan_size=self.train_scan_size,
                    train_scan_dropped=self.train_scan_dropped, num_train_dropped=dropped,
                    longest_prompt=self.longest_prompt)

    # -- PromptSource -----------------------------------------------------------------------

    def __getattr__(self, name):
        # Only called for attributes not found on the wrapper: the source's name, chat, score, ...
        if name == "source":  # not yet set (during __init__ or unpickling)
            raise AttributeError(name)
        return getattr(self.source, name)

    def train_example(self, index: int) -> Example:
        """The first fitting example of source positions index, index + PROBE_STRIDE, ...; ValueError for a bad index,
        RuntimeError after MAX_PROBES over-long prompts in a row."""
        index = _check_index(index)
        for probe in range(MAX_PROBES):
            example = self.source.train_example(index + probe * PROBE_STRIDE)
            if self._fits(example):
                return example
            with self._lock:
                self.num_train_dropped += 1
        raise RuntimeError(f"{self.source.name}: {MAX_PROBES} training prompts in a row at stream position {index} "
                           f"are longer than {_FIELD} = {self.max_prompt_length} tokens")

    def train_batch(self, start: int, count: int) -> list[Example]:
        """`[train_example(start + i) for i in range(count)]`."""
        start = _check_index(start, "start")
        count = _check_index(count, "count")
        return [self.train_example(start + i) for i in range(count)]

    def eval_examples(self) -> list[Example]:
        """The source's held-out set without its over-long prompts (same order)."""
        return list(self._eval)

    def score(self, completion: str, example: Example, **kwargs) -> float:
        """The source's `score` (keyword arguments such as `truncated` passed through)."""
        return self.source.score(completion, example, **kwargs)

    def sft_target(self, example: Example) -> str:
        """The source's `sft_target`."""
        return self.source.sft_target(example)


def filter_long_prompts(source: PromptSource, encode: Callable[[str], Sequence[int]],
                        max_prompt_length: int) -> LengthFilteredSource:
    """`source` without the prompts that encode to more than `max_prompt_length` tokens, e.g.
    ``filter_long_prompts(source, codec.encode_prompt, config.sampler.max_prompt_length)``; the held-out set and the
    first SCAN_SIZE training positions are encoded at once, later ones as the stream is read.

    Args:
      source: a `PromptSource`.
      encode: prompt text -> token ids (as the sampler will see them).
      max_prompt_length: the longest accepted prompt, tokens (int >= 1).

    Returns:
      A `LengthFilteredSource`.

    Raises:
      ValueError: `max_prompt_length` not an int >= 1; every held-out prompt, or every one of the first SCAN_SIZE
        training prompts, too long (naming `sampler.max_prompt_length`)."""
    return LengthFilteredSource(source, encode, max_prompt_length)
