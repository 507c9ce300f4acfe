"""Prompt sources: the `Example` record, the `PromptSource` protocol and the offline reasoning-gym source.

A prompt source gives the trainer an index-addressed training stream (`train_example(index)`, so a resumed run sees
the same prompts), a held-out evaluation set disjoint *by prompt content* from it (`eval_examples()`), a verifier
(`score(completion, example) -> float in [0, 1]`, never raising on garbage) and the warm-start target
(`sft_target(example)`). Reasoning-gym (https://github.com/open-thought/reasoning-gym, v0.1.25) item `i` of seed `s`
is generated from `random.Random(s + i)`, so any index is produced on demand, offline."""

from __future__ import annotations

import dataclasses
import json
import operator
import re
import threading
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from pdm_jax.data.verifiers import TRUNCATED, find_final_answer, unwrap_answer

# reasoning_gym is imported lazily (it takes ~3 s): the math sources and the verifier worker processes import this
# module without needing it.

# Characters of the tiny model's character tokenizer (besides its special tokens). Compact chain-sum prompts and answers
# use only these.
COMPACT_ALPHABET = "0123456789+-="

# The held-out set's seed offset: reasoning-gym seeds item i with `seed + i`, so it must exceed any index the training
# stream probes (< train_size * MAX_PROBES).
EVAL_SEED_OFFSET = 1 << 40
# The train stream replaces an example whose prompt is in the held-out set by probing rg indices j, j + train_size, j +
# 2 * train_size, ... (see `ReasoningGymSource.train_example`). This bounds the probing.
MAX_PROBES = 1000

_COMPACT_PROMPT_RE = re.compile(r"^[0-9+\-]+=$")
_COMPACT_ANSWER_RE = re.compile(r"^-?[0-9]+$")
_COMPACT_EXTRACT_RE = re.compile(r"\s*(-?[0-9]+)")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    Attributes:
      prompt: text for the tokenizer (under the source's `chat`, the caller applies the chat template as one user
        turn).
      answer: reference answer string, for the verifier and `PromptSource.sft_target`.
      uid: stable id, e.g. "chain_sum/train/123" or "gsm8k/eval/7".
      meta: JSON-serialisable source metadata."""

    prompt: str
    answer: str
    uid: str
    meta: dict


@runtime_checkable
class PromptSource(Protocol):
    """What the trainer needs from a task. See the module docstring."""

    name: str
    chat: bool

    def train_example(self, index: int) -> Example:
        """The training example at stream position `index` (int >= 0).

        Deterministic in (config seed, index); wraps around the training pool; never returns a held-out example
        (disjoint by prompt content)."""
        ...

    def train_batch(self, start: int, count: int) -> list[Example]:
        """`[train_example(start + i) for i in range(count)]`."""
        ...

    def eval_examples(self) -> list[Example]:
        """The fixed held-out set (num_eval examples, unique prompts)."""
        ...

    def score(self, completion: str, example: Example, *, truncated: bool = False) -> float:
        """Reward in [0, 1] for `completion`; returns 0.0 (never raises) on garbage.

        `truncated`: the completion was stopped by max_tokens (the rollout's finish_reason "length"); free-form sources
        then give no credit to a final answer that may be cut off."""
        ...

    def sft_target(self, example: Example) -> str:
        """Completion text used for the supervised warm start."""
        ...


def _json_safe(value: Any) -> Any:
    """Round-trip through JSON (tuples -> lists, unknown objects -> str)."""
    return json.loads(json.dumps(value, default=str))


def _truncation_flags(completions: Sequence[str], examples: Sequence[Example],
                      truncated: Optional[Sequence[bool]]) -> list[bool]:
    """`truncated` as a list of bools (all False when None), checked against the batch's length."""
    if len(completions) != len(examples):
        raise ValueError(f"score_batch: {len(completions)} completions for {len(examples)} examples")
    if truncated is None:
        return [False] * len(completions)
    flags = [bool(t) for t in truncated]
    if len(flags) != len(completions):
        raise ValueError(f"score_batch: {len(flags)} truncated flags for {len(completions)} completions")
    return flags


def _check_index(index: int, name: str = "index") -> int:
    if isinstance(index, bool):
        raise ValueError(f"{name} must be an int, got {index!r}")
    try:
        index = operator.index(index)  # int, numpy integer; not float
    except TypeError:
        raise ValueError(f"{name} must be an int, got {index!r}") from None
    if index < 0:
        raise ValueError(f"{name} must be >= 0, got {index}")
    return index


# ---- Answer extraction for reasoning-gym "question" prompts. ---------------------------------------------



def extract_compact_answer(completion: str) -> str:
    """Leading integer of a compact completion ("144=..." -> "144", "x" -> "").

    The completion is stripped of leading whitespace and read up to the first character that cannot belong to an integer
    answer ([-]digits)."""
    if not isinstance(completion, str):
        return ""
    match = _COMPACT_EXTRACT_RE.match(completion)
    return match.group(1) if match else ""


def extract_tagged_answer(completion: str, *, truncated: bool = False) -> str:
    """Final answer of a free-form completion, for reasoning-gym question prompts ("" for non-strings).

    The last complete `<answer>x</answer>` (any case; unwrapped by `verifiers.unwrap_answer`), "" when an `<answer>`
    after the last `</answer>` was cut off; else `verifiers.find_final_answer` (with its truncation rules); else the
    whole stripped completion, unwrapped.

    Args:
      completion: the completion text.
      truncated: the completion was stopped by max_tokens."""
    if not isinstance(completion, str):
        return ""
    lowered = completion.lower()  # str.rfind: linear time on any input
    close = lowered.rfind("</answer>")
    if lowered.find("<answer>", close + 1 if close >= 0 else 0) >= 0:
        return ""  # an <answer> that never closes: cut off
    if close >= 0:
        start = lowered.rfind("<answer>", 0, close)
        if start >= 0:
            return unwrap_answer(completion[start + len("<answer>") : close])[0]
    found = find_final_answer(completion, truncated=truncated)
    if found.status == TRUNCATED:
        return ""
    if found.answer is not None:
        return found.answer
    return unwrap_answer(completion)[0]


# ---- Reasoning-gym source. -------------------------------------------------------------------------------


class ReasoningGymSource:
    """A reasoning-gym task as a `PromptSource`, fully offline.

    Train: stream position `index` maps to rg index `j = index % train_size` of seed `seed`; a held-out prompt is
    skipped by probing `j + train_size`, `j + 2 * train_size`, ... (at most MAX_PROBES, else RuntimeError). Eval:
    seed `seed + EVAL_SEED_OFFSET`, the first `num_eval` distinct prompts. Every train example is checked against the
    held-out prompts.

    Formats: "compact" (`expression-without-spaces + "="`, e.g. "57+87=", answer "144"; only for tasks whose metadata
    has an integer +/- `expression`, within COMPACT_ALPHABET; `chat` False) or "question" (rg's question text; `chat`
    True). Scoring: the extracted answer (`extract_compact_answer` / `extract_tagged_answer`) by the task's own
    `score_answer` on the regenerated rg entry (chain_sum: 1.0 if equal, partial credit len(oracle)/len(answer) when
    the oracle is a substring); accuracy is `score == 1.0`; exceptions in the rg scorer count in `score_failures` and
    give 0.0.

    Args:
      task: reasoning-gym dataset name (e.g. "chain_sum") or "number_between" (`pdm_jax.data.number_between`).
      task_config: kwargs of the task's rg config, without `seed` or `size`.
      prompt_format: "compact" or "question".
      num_eval: held-out examples (>= 1).
      seed: int, base seed of both streams.
      train_size: stream positions before the train stream wraps.
      chat: override of the `chat` flag.

    Raises:
      ValueError: naming the field and value: an unknown task, bad task_config, an unknown prompt_format, a task
        without a compact form, num_eval / train_size < 1, or a task too small for num_eval distinct held-out
        prompts."""

    def __init__(
        self,
        task: str,
        task_config: Mapping[str, Any] | None = None,
        *,
        prompt_format: str = "compact",
        num_eval: int = 256,
        seed: int = 0,
        train_size: int = 1 << 20,
        chat: bool | None = None,
    ):
        import reasoning_gym  # heavy (~1 s) and only for reasoning-gym sources

        from pdm_jax.data import number_between

        number_between.register()  # this project's own task (many right answers), served like rg's
        task_config = dict(task_config or {})
        if not isinstance(task, str) or task not in reasoning_gym.factory.DATASETS:
            raise ValueError(f"data.task: unknown reasoning-gym task {task!r}")
        for reserved in ("seed", "size"):
            if reserved in task_config:
                raise ValueError(
                    f"data.task_config: {reserved!r} is set by the source (use data.seed / "
                    f"data.train_size), got {reserved}={task_config[reserved]!r}"
                )
        if prompt_format not in ("compact", "question"):
            raise ValueError(
                f"data.prompt_format must be 'compact' or 'question', got {prompt_format!r}"
            )
        if int(num_eval) < 1:
            raise ValueError(f"data.num_eval must be >= 1, got {num_eval!r}")
        if int(train_size) < 1:
            raise ValueError(f"data.train_size must be >= 1, got {train_size!r}")
        self.task = task
        self.task_config = task_config
        self.prompt_format = prompt_format
        self.num_eval = int(num_eval)
        self.seed = int(seed)
        self.train_size = int(train_size)
        self.name = f"reasoning_gym/{task}"
        self.chat = (prompt_format == "question") if chat is None else bool(chat)
        self.score_failures = 0
        self._lock = threading.Lock()

        # The rg dataset `size` only bounds its own iteration; __getitem__ accepts any index. Set it to the largest
        # index we may touch.
        train_span = self.train_size * MAX_PROBES
        self._train_ds = self._create(self.seed, train_span)
        eval_attempts = max(20 * self.num_eval, 2_000)
        self._eval_ds = self._create(self.seed + EVAL_SEED_OFFSET, eval_attempts)

        self._eval: list[Example] = []
        self._eval_entries: dict[int, dict] = {}
        seen: set[str] = set()
        for rg_index in range(eval_attempts):
            entry = self._eval_ds[rg_index]
            example = self._make_example(entry, "eval", rg_index, len(self._eval))
            if example.prompt in seen:
                continue
            seen.add(example.prompt)
            self._eval.append(example)
            if len(self._eval) == self.num_eval:
                break
        if len(self._eval) < self.num_eval:
            raise ValueError(
                f"data.num_eval={self.num_eval}: task {task!r} with task_config {task_config!r} "
                f"yielded only {len(self._eval)} distinct prompts in {eval_attempts} draws"
            )
        self._eval_prompts = frozenset(seen)

    # -- construction helpers ------------------------------------------------

    def _create(self, seed: int, size: int):
        import reasoning_gym  # heavy (~1 s) and only for reasoning-gym sources

        try:
            return reasoning_gym.create_dataset(self.task, seed=seed, size=size, **self.task_config)
        except (TypeError, AssertionError, ValueError) as err:
            raise ValueError(
                f"data.task_config: invalid config {self.task_config!r} for reasoning-gym task "
                f"{self.task!r}: {err}"
            ) from err

    def _make_example(self, entry: Mapping[str, Any], split: str, rg_index: int, position: int) -> Example:
        answer = str(entry["answer"])
        metadata = entry.get("metadata", {})
        if self.prompt_format == "compact":
            expression = metadata.get("expression") if isinstance(metadata, Mapping) else None
            if not isinstance(expression, str):
                raise ValueError(
                    f"data.prompt_format='compact' needs a task whose metadata has an "
                    f"'expression'; task {self.task!r} has none"
                )
            prompt = expression.replace(" ", "") + "="
            if not _COMPACT_PROMPT_RE.match(prompt) or not _COMPACT_ANSWER_RE.match(answer):
                raise ValueError(
                    f"data.prompt_format='compact': task {self.task!r} produced prompt {prompt!r} / "
                    f"answer {answer!r} outside the compact alphabet {COMPACT_ALPHABET!r}"
                )
        else:
            prompt = str(entry["question"])
        meta = {
            "source": self.name,
            "split": split,
            "rg_seed": self.seed if split == "train" else self.seed + EVAL_SEED_OFFSET,
            "rg_index": rg_index,
            "question": str(entry["question"]),
            "rg_metadata": _json_safe(metadata),
        }
        uid = f"{self.task}/{split}/{position}"
        return Example(prompt=prompt, answer=answer, uid=uid, meta=meta)

    # -- PromptSource ------------------------------------------------------------

    def train_example(self, index: int) -> Example:
        """See the class docstring (probing past held-out prompts)."""
        index = _check_index(index)
        base = index % self.train_size
        for probe in range(MAX_PROBES):
            rg_index = base + probe * self.train_size
            example = self._make_example(self._train_ds[rg_index], "train", rg_index, index)
            # Disjointness check: never hand out a held-out prompt.
            if example.prompt not in self._eval_prompts:
                return example
        raise RuntimeError(
            f"{self.name}: {MAX_PROBES} probes at stream index {index} all hit held-out prompts; "
            f"the task space is too small for data.num_eval={self.num_eval}"
        )

    def train_batch(self, start: int, count: int) -> list[Example]:
        start = _check_index(start, "start")
        count = _check_index(count, "count")
        return [self.train_example(start + i) for i in range(count)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def extract_answer(self, completion: str, *, truncated: bool = False) -> str:
        """The answer string the verifier scores (see class docstring). The compact format ignores `truncated` (its
        leading-integer rule is what the default run is scored by)."""
        if self.prompt_format == "compact":
            return extract_compact_answer(completion)
        return extract_tagged_answer(completion, truncated=truncated)

    def _entry(self, example: Example) -> dict:
        meta = example.meta or {}
        try:
            dataset = self._train_ds if meta["split"] == "train" else self._eval_ds
            entry = dataset[int(meta["rg_index"])]
            if str(entry["answer"]) == example.answer:
                return entry
        except Exception:  # foreign/hand-built example: fall back below
            pass
        return {"question": meta.get("question", example.prompt), "answer": example.answer,
                "metadata": meta.get("rg_metadata", {})}

    def score(self, completion: str, example: Example, *, truncated: bool = False) -> float:
        """rg `score_answer` on the extracted answer, clipped to [0, 1]; 0.0 on any failure.

        `truncated` (finish_reason "length"): see `extract_tagged_answer`; ignored by the compact format."""
        try:
            answer = self.extract_answer(completion, truncated=truncated)
            if not answer:
                return 0.0
            reward = float(self._train_ds.score_answer(answer, self._entry(example)))
        except Exception:
            with self._lock:
                self.score_failures += 1
            return 0.0
        if not reward == reward:  # NaN
            with self._lock:
                self.score_failures += 1
            return 0.0
        return min(max(reward, 0.0), 1.0)

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example],
                    truncated: Optional[Sequence[bool]] = None) -> list[float]:
        """`[score(c, e, truncated=t) ...]` over the three sequences (rg scoring is cheap).

        Raises:
          ValueError: the sequences differ in length."""
        flags = _truncation_flags(completions, examples, truncated)
        return [self.score(c, e, truncated=t) for c, e, t in zip(completions, examples, flags)]

    def sft_target(self, example: Example) -> str:
        """The reference answer itself (compact and question formats)."""
        return example.answer
