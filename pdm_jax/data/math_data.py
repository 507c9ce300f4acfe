"""Math prompt sources from LOCAL files through Hugging Face `datasets` (hub never contacted).

Schemas: GSM8K (openai/gsm8k) rows `{"question", "answer"}`, the answer worked reasoning ending in `#### <number>`;
DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k) rows `{"data_source", "prompt": [{"role", "content"}, ...],
"ability", "reward_model": {"ground_truth", "style"}, "extra_info": {"index"}}`, de-duplicated by prompt text (the
published parquet repeats every problem). Files: .json, .jsonl, .parquet.

Held-out split: without `eval_path`, the first `num_eval` rows of a `default_rng(seed)` permutation (at most half the
rows); with it, `num_eval` rows of that file, training rows with an eval prompt dropped: disjoint by prompt content.
Training position `index` is row `perm_e[index % n_train]`, `perm_e = default_rng([seed, 1, e]).permutation(n_train)`
for epoch `e = index // n_train`. Scoring: `verifiers.math_reward` on `verifiers.find_final_answer`'s answer, safe
from any thread. Reading: about 3 s per 100k rows (the 1.8M-row DAPO parquet: ~1 min)."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from pdm_jax.data.tasks import Example, _check_index, _json_safe, _truncation_flags
from pdm_jax.data import verifiers
from pdm_jax.data.verifiers import math_reward

log = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
_GSM8K_FINAL_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def load_records(path: str | os.PathLike, *, field: str = "data.path") -> Iterator[dict]:
    """The rows of a local json/jsonl/parquet file as Python dicts, via `datasets`, as an iterator converted in batches
    of 4096 (a 1.8M-row file is never materialised at once); sets HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1.

    Raises:
      ValueError: naming `field`: missing path, file not found, unsupported extension, or a file `datasets` cannot
        read."""
    if path is None or str(path) == "":
        raise ValueError(f"{field} is required (a local .json/.jsonl/.parquet file), got {path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{field}: file not found: {str(path)!r}")
    builder = _BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise ValueError(f"{field}: unsupported file type {file.suffix!r} in {str(path)!r} "
                         f"(expected one of {sorted(_BUILDERS)})")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets  # heavy (~2 s) and only for file-backed math sources

    try:
        dataset = datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as err:
        raise ValueError(f"{field}: cannot read {str(path)!r} with datasets ({builder}): {err}") from err
    return _iter_rows(dataset)


def _iter_rows(dataset, batch_size: int = 4096) -> Iterator[dict]:
    for batch in dataset.iter(batch_size=batch_size):
        columns = list(batch)
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield {name: batch[name][i] for name in columns}


def _require(row: dict, keys: tuple[str, ...], kind: str, field: str, row_number: int) -> None:
    missing = [key for key in keys if key not in row or row[key] is None]
    if missing:
        raise ValueError(f"{field}: row {row_number} lacks {missing} required by the {kind} schema "
                         f"(has {sorted(row)})")


def gsm8k_final_answer(answer_field: str) -> str:
    """The number after '####' in a GSM8K answer, commas removed ("#### 1,234" -> "1234").

    Raises ValueError when there is no '####' line."""
    match = _GSM8K_FINAL_RE.search(answer_field)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_field[-80:]!r}")
    return match.group(1).strip().replace(",", "")


def gsm8k_reasoning(answer_field: str) -> str:
    """The worked solution of a GSM8K answer without calculator annotations or the '####' line."""
    reasoning = answer_field.split("####")[0]
    return _CALCULATOR_RE.sub("", reasoning).strip()


def _gsm8k_row(row: dict, row_number: int, field: str) -> dict:
    _require(row, ("question", "answer"), "gsm8k", field, row_number)
    try:
        final = gsm8k_final_answer(str(row["answer"]))
    except ValueError as err:
        raise ValueError(f"{field}: row {row_number}: {err}") from None
    return {
        "prompt": str(row["question"]).strip(),
        "answer": final,
        "row_id": str(row_number),
        "meta": {"reasoning": gsm8k_reasoning(str(row["answer"])), "row": row_number},
    }


def _dapo_row(row: dict, row_number: int, field: str) -> dict:
    _require(row, ("prompt", "reward_model"), "dapo_math", field, row_number)
    messages = row["prompt"]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise ValueError(f"{field}: row {row_number}: 'prompt' has no user message: {messages!r:.200}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(f"{field}: row {row_number}: 'reward_model.ground_truth' missing")
    extra = row.get("extra_info") or {}
    index = extra.get("index") if isinstance(extra, dict) else None
    return {
        "prompt": users[-1]["content"],
        "answer": str(reward_model["ground_truth"]).strip(),
        "row_id": str(index) if index is not None else str(row_number),
        "meta": {
            "row": row_number,
            "data_source": row.get("data_source"),
            "ability": row.get("ability"),
            "style": reward_model.get("style"),
            "messages": _json_safe(messages),
        },
    }


_ROW_PARSERS = {"gsm8k": _gsm8k_row, "dapo_math": _dapo_row}


def load_math_rows(kind: str, path, *, field: str = "data.path") -> list[dict]:
    """Rows of a local file in the `kind` schema, normalised and de-duplicated by prompt.

    Returns dicts {prompt, answer, row_id, meta}. Raises ValueError (naming `field`) for unreadable files, missing
    columns or an empty file."""
    if kind not in _ROW_PARSERS:
        raise ValueError(f"data.kind must be one of {sorted(_ROW_PARSERS)} for math data, got {kind!r}")
    parse = _ROW_PARSERS[kind]
    rows, seen = [], set()
    for row_number, record in enumerate(load_records(path, field=field)):
        row = parse(record, row_number, field)
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        rows.append(row)
    if not rows:
        raise ValueError(f"{field}: {str(path)!r} has no rows")
    return rows


class MathSource:
    """GSM8K / DAPO-Math-17k rows from local files as a `PromptSource` (chat=True).

    Args:
      kind: "gsm8k" or "dapo_math" (the schema).
      path: local .json/.jsonl/.parquet file (training pool, and the eval pool without `eval_path`).
      eval_path: optional separate held-out file in the same schema.
      prompt_format: only "question".
      num_eval: held-out size (>= 1; at most the rows of `eval_path`, or half the distinct rows of `path`).
      seed: int seed of the split and the per-epoch shuffles.
      instruction: text appended to every prompt after a blank line ("" leaves prompts unchanged).
      verify_timeout_s: math-verify budget per completion, seconds.
      chat: override of the chat flag.

    Example.prompt is the (last) user message (DAPO's messages in `meta["messages"]`), Example.answer the final
    answer ("72", "\\frac{1}{2}"); `sft_target` is GSM8K's "<reasoning>\\n#### <answer>" or DAPO's "Answer:
    <answer>"; `score_batch` verifies concurrently.

    Raises:
      ValueError: naming the field: kind, path/eval_path, prompt_format, num_eval, verify_timeout_s."""

    #: The schemas this class reads (`pdm_jax.data.file_data.FileSource` reads "file" through `_load_rows`).
    KINDS = tuple(_ROW_PARSERS)

    def __init__(
        self,
        kind: str,
        *,
        path,
        eval_path=None,
        prompt_format: str = "question",
        num_eval: int = 256,
        seed: int = 0,
        instruction: str = "",
        verify_timeout_s: float = 5.0,
        chat: Optional[bool] = None,
    ):
        if kind not in self.KINDS:
            raise ValueError(f"data.kind must be one of {sorted(self.KINDS)}, got {kind!r}")
        if prompt_format != "question":
            raise ValueError(f"data.prompt_format: only 'question' is supported for kind={kind!r}, "
                             f"got {prompt_format!r}")
        if int(num_eval) < 1:
            raise ValueError(f"data.num_eval must be >= 1, got {num_eval!r}")
        if not float(verify_timeout_s) > 0:
            raise ValueError(f"data.verify_timeout_s must be > 0, got {verify_timeout_s!r}")
        self.kind = kind
        self.name = kind
        self.chat = True if chat is None else bool(chat)
        self.num_eval = int(num_eval)
        self.seed = int(seed)
        self.instruction = instruction or ""
        self.verify_timeout_s = float(verify_timeout_s)

        rows = self._load_rows(path, "data.path")
        if eval_path:
            eval_rows = self._load_rows(eval_path, "data.eval_path")
            if self.num_eval > len(eval_rows):
                raise ValueError(f"data.num_eval={self.num_eval} exceeds the {len(eval_rows)} distinct "
                                 f"rows of data.eval_path {str(eval_path)!r}")
            order = np.random.default_rng(self.seed).permutation(len(eval_rows))
            eval_rows = [eval_rows[i] for i in order[: self.num_eval]]
            eval_prompts = {row["prompt"] for row in eval_rows}
            train_rows = [row for row in rows if row["prompt"] not in eval_prompts]
        else:
            if self.num_eval > len(rows) // 2:
                raise ValueError(f"data.num_eval = {self.num_eval} would hold out {min(self.num_eval, len(rows))} "
                                 f"of the {len(rows)} distinct rows of data.path {str(path)!r} and leave "
                                 f"{max(len(rows) - self.num_eval, 0)} for training: at most half may be held "
                                 f"out (data.num_eval <= {len(rows) // 2}), or give the held-out prompts their own "
                                 "file in data.eval_path")
            order = np.random.default_rng(self.seed).permutation(len(rows))
            eval_rows = [rows[i] for i in order[: self.num_eval]]
            train_rows = [rows[i] for i in order[self.num_eval :]]
        if not train_rows:
            raise ValueError(f"data.path {str(path)!r}: every row is also in data.eval_path")
        log.info("%s: %d distinct rows of data.path for training, %d held out (data.num_eval) from %s", kind,
                 len(train_rows), len(eval_rows), "data.eval_path" if eval_path else "data.path")
        self._eval = [self._example(row, "eval") for row in eval_rows]
        self._train_rows = train_rows
        self._epoch_perms: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _load_rows(self, path, field: str) -> list[dict]:
        """The normalised rows {prompt, answer, row_id, meta} of one file (`load_math_rows`)."""
        return load_math_rows(self.kind, path, field=field)

    @property
    def num_train(self) -> int:
        """Distinct training rows (the pool the stream cycles through)."""
        return len(self._train_rows)

    def _example(self, row: dict, split: str) -> Example:
        prompt = row["prompt"] + ("\n\n" + self.instruction if self.instruction else "")
        meta = dict(row["meta"], source=self.kind, split=split)
        return Example(prompt=prompt, answer=row["answer"], uid=f"{self.kind}/{split}/{row['row_id']}",
                       meta=meta)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._epoch_perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, 1, epoch]).permutation(self.num_train)
            self._epoch_perms[epoch] = perm
            while len(self._epoch_perms) > 4:
                self._epoch_perms.popitem(last=False)
        return perm

    def train_example(self, index: int) -> Example:
        index = _check_index(index)
        epoch, position = divmod(index, self.num_train)
        return self._example(self._train_rows[int(self._permutation(epoch)[position])], "train")

    def train_batch(self, start: int, count: int) -> list[Example]:
        start = _check_index(start, "start")
        count = _check_index(count, "count")
        return [self.train_example(start + i) for i in range(count)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, completion: str, example: Example, *, truncated: bool = False) -> float:
        """`math_reward(completion, example.answer, truncated=truncated)`: 1.0 / 0.0, never raises.

        `truncated`: the completion was stopped by max_tokens (a final answer on its unterminated last line gets no
        credit; see `verifiers.find_final_answer`)."""
        try:
            return math_reward(completion, example.answer, timeout_s=self.verify_timeout_s,
                               truncated=truncated)
        except Exception:
            return 0.0

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example],
                    truncated: Optional[Sequence[bool]] = None) -> list[float]:
        """`[score(c, e, truncated=t) ...]` over the three sequences, verified concurrently by the math-verify worker
        processes (`verifiers.set_pool_workers`).

        Raises:
          ValueError: the sequences differ in length."""
        flags = _truncation_flags(completions, examples, truncated)
        if len(completions) <= 1:
            return [self.score(c, e, truncated=t) for c, e, t in zip(completions, examples, flags)]
        with ThreadPoolExecutor(max_workers=verifiers.pool_workers()) as executor:
            return list(executor.map(lambda c, e, t: self.score(c, e, truncated=t), completions, examples, flags))

    def sft_target(self, example: Example) -> str:
        reasoning = (example.meta or {}).get("reasoning")
        if self.kind == "gsm8k" and reasoning:
            return f"{reasoning}\n#### {example.answer}"
        if self.kind == "gsm8k":
            return f"#### {example.answer}"
        return f"Answer: {example.answer}"


def write_jsonl(rows: list[dict[str, Any]], path) -> None:
    """Write rows as JSON lines (used to make fixtures and small local files)."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
