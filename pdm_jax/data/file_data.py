"""``data.kind = "file"``: prompts from the user's own local file, through Hugging Face `datasets`.

``data.path``: a local .json / .jsonl / .parquet file (`pdm_jax.data.math_data.load_records`) or a
``Dataset.save_to_disk`` directory; the hub is never contacted. The column ``data.prompt_field`` holds text (one user
turn under the chat template unless ``data.chat_template = "off"``) or a list of chat messages ``[{"role",
"content"}, ...]`` (rendered whole by the chat template, which must be on). ``data.answer_field`` (optional) is the
reference answer: the built-in math verifier's ground truth and the warm-start target. Every other column is kept in
``Example.meta["columns"]`` for ``reward.functions`` (the names ``prompts``, ``completions``, ``completion_ids`` and
``truncated`` are refused). Duplicate prompts are kept once; the split, stream and scoring are `MathSource`'s.

Errors (ValueError naming the field): a missing or unreadable path, no rows, a row without the prompt or answer
column, a prompt that is neither non-empty text nor a list of {role, content} messages, a reserved column name,
chat-message prompts with ``data.chat_template = "off"``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Optional

from pdm_jax.data.math_data import MathSource, _iter_rows, load_records
from pdm_jax.data.tasks import Example, _json_safe

__all__ = ["FileSource", "RESERVED_COLUMNS", "load_file_rows"]

#: The reward functions' own argument names (`pdm_jax.rewards`): a data column may not take them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "truncated")


def _records(path, field: str) -> Iterator[dict]:
    """The rows of a local file (`load_records`) or of a ``save_to_disk`` directory, as dicts."""
    if path is None or str(path) == "":
        raise ValueError(f"{field} is required (a local .json/.jsonl/.parquet file or a datasets.save_to_disk "
                         f"directory), got {path!r}")
    location = Path(path).expanduser()
    if location.is_file() and location.stat().st_size == 0:
        raise ValueError(f"{field}: {str(path)!r} is empty (no rows)")
    if not location.is_dir():
        return load_records(path, field=field)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets  # heavy (~2 s), as in math_data

    try:
        dataset = datasets.load_from_disk(str(location))
    except Exception as err:
        raise ValueError(f"{field}: cannot read the directory {str(path)!r} with datasets.load_from_disk: "
                         f"{err}") from err
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"{field}: {str(path)!r} holds a DatasetDict with splits {sorted(dataset)}: point "
                         f"{field} at one split's directory")
    return _iter_rows(dataset)


def _prompt_value(value, row_number: int, prompt_field: str):
    """``(text or JSON of the messages, is_messages)`` of a row's prompt, or a ValueError naming the row."""
    if isinstance(value, str):
        if value.strip():
            return value, False
    elif isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        return json.dumps(messages, ensure_ascii=False), True
    raise ValueError(f"data.prompt_field = {prompt_field!r}: row {row_number} holds {value!r:.200}, not non-empty "
                     "text or a list of chat messages {role, content}")


def load_file_rows(path, *, prompt_field: str, answer_field: str = "", field: str = "data.path") -> list[dict]:
    """The rows of the user's file as `MathSource` rows, de-duplicated by prompt: dicts ``{prompt, answer, row_id,
    meta}`` (``prompt`` the text or the JSON of the messages, with ``meta["chat_messages"]``; ``answer`` as text, ""
    without a column; ``meta["columns"]`` every other column; ``meta["row"]`` the row number).

    Raises:
      ValueError: see the module docstring (naming ``field``, ``data.prompt_field`` or ``data.answer_field``)."""
    rows, seen = [], set()
    for row_number, record in enumerate(_records(path, field)):
        if prompt_field not in record or record[prompt_field] is None:
            raise ValueError(f"data.prompt_field = {prompt_field!r}: row {row_number} of {field} {str(path)!r} has "
                             f"no such column (columns: {sorted(record)})")
        if answer_field and (answer_field not in record or record[answer_field] is None):
            raise ValueError(f"data.answer_field = {answer_field!r}: row {row_number} of {field} {str(path)!r} has "
                             f"no such column (columns: {sorted(record)})")
        reserved = sorted(set(record) & set(RESERVED_COLUMNS) - {prompt_field})
        if reserved:
            raise ValueError(f"{field}: {str(path)!r} has the column {reserved[0]!r}, a name the reward functions "
                             f"take for themselves ({', '.join(RESERVED_COLUMNS)}): rename it")
        prompt, is_messages = _prompt_value(record[prompt_field], row_number, prompt_field)
        if prompt in seen:
            continue
        seen.add(prompt)
        columns = {k: _json_safe(v) for k, v in record.items() if k != prompt_field}
        rows.append(dict(prompt=prompt, answer=str(record[answer_field]).strip() if answer_field else "",
                         row_id=str(row_number),
                         meta=dict(row=row_number, columns=columns, chat_messages=is_messages)))
    if not rows:
        raise ValueError(f"{field}: {str(path)!r} has no rows")
    return rows


class FileSource(MathSource):
    """The user's prompt file as a `PromptSource`; `score` is the built-in math verifier against ``Example.answer``,
    `sft_target` the answer text.

    Args:
      path, eval_path, num_eval, seed, verify_timeout_s: as `MathSource`.
      prompt_field: the prompt column; answer_field: the reference-answer column ("" = none).
      chat: whether prompts go through the tokenizer's chat template.

    Raises:
      ValueError: as `load_file_rows`; chat-message prompts without the chat template (naming
        ``data.chat_template``)."""

    KINDS = ("file",)

    def __init__(self, *, path, eval_path=None, prompt_field: str = "prompt", answer_field: str = "",
                 num_eval: int = 256, seed: int = 0, verify_timeout_s: float = 5.0, chat: Optional[bool] = None):
        if not prompt_field:
            raise ValueError(f"data.prompt_field must name a column for kind='file', got {prompt_field!r}")
        self.prompt_field, self.answer_field = str(prompt_field), str(answer_field)
        super().__init__("file", path=path, eval_path=eval_path, prompt_format="question", num_eval=num_eval,
                         seed=seed, verify_timeout_s=verify_timeout_s, chat=chat)
        if not self.chat and any(row["meta"]["chat_messages"] for row in self._train_rows) or not self.chat and any(
                isinstance(example.prompt, list) for example in self._eval):
            raise ValueError("data.chat_template = 'off', and data.prompt_field holds chat messages, which only the "
                             "tokenizer's chat template renders: set data.chat_template to 'auto' or 'on'")

    def _load_rows(self, path, field: str) -> list[dict]:
        return load_file_rows(path, prompt_field=self.prompt_field, answer_field=self.answer_field, field=field)

    def _example(self, row: dict, split: str) -> Example:
        prompt = json.loads(row["prompt"]) if row["meta"]["chat_messages"] else row["prompt"]
        return Example(prompt=prompt, answer=row["answer"], uid=f"file/{split}/{row['row_id']}",
                       meta=dict(row["meta"], source="file", split=split))

    def sft_target(self, example: Example) -> str:
        """The reference answer's text (the ``data.answer_field`` column).

        Raises:
          ValueError: no ``data.answer_field`` (the warm start has no target)."""
        if not self.answer_field:
            raise ValueError("sft.steps > 0 needs a reference answer: set data.answer_field (kind='file')")
        return example.answer
