"""pdm_jax.data: prompt sources (reasoning-gym, local HF datasets) and verifiers.

`make_source(spec)` builds a `PromptSource` from a `DataSpec` (``DataSpec.from_config(config.data)``; fields and
units in docs/configuration.md): ``kind`` "reasoning_gym" | "gsm8k" | "dapo_math" | "file", with ``task`` /
``task_config`` / ``prompt_format`` (reasoning-gym), ``path`` (the files), ``prompt_field`` / ``answer_field``
(file), ``eval_path``, ``num_eval``, ``seed`` and ``chat_template``. A bad field raises ValueError naming it. Once
the tokenizer exists, `filter_long_prompts` drops (and counts) prompts longer than the sampler accepts."""

from __future__ import annotations

from typing import Mapping

from pdm_jax.data.tasks import (
    COMPACT_ALPHABET,
    Example,
    PromptSource,
    ReasoningGymSource,
    extract_compact_answer,
    extract_tagged_answer,
)
from pdm_jax.data.math_data import MathSource
from pdm_jax.data.file_data import FileSource
from pdm_jax.data.prompt_filter import LengthFilteredSource, filter_long_prompts
from pdm_jax.data.spec import DataSpec

KINDS = ("reasoning_gym", "gsm8k", "dapo_math", "file")
#: data.prompt_format: "auto" is the kind's own (`DataSpec.from_config` resolves it: reasoning_gym "compact", the
#: file kinds "question").
PROMPT_FORMATS = ("auto", "compact", "question")
#: data.chat_template: the source's own choice, the tokenizer's chat template, or raw prompt text.
CHAT_TEMPLATES = ("auto", "on", "off")

__all__ = [
    "COMPACT_ALPHABET",
    "DataSpec",
    "applies_chat_template",
    "Example",
    "FileSource",
    "KINDS",
    "PROMPT_FORMATS",
    "LengthFilteredSource",
    "PromptSource",
    "ReasoningGymSource",
    "extract_compact_answer",
    "extract_tagged_answer",
    "filter_long_prompts",
    "make_source",
]


def applies_chat_template(kind: str, prompt_format: str, chat_template: str, chat=None) -> bool:
    """Whether a source's prompts go through the tokenizer's chat template: ``chat_template`` "on" / "off" decide; under
    "auto" an explicit ``DataSpec.chat``, else the source (reasoning-gym "question", gsm8k, dapo_math and file do,
    reasoning-gym "compact" does not)."""
    if chat_template != "auto":
        return chat_template == "on"
    if chat is not None:
        return bool(chat)
    return kind != "reasoning_gym" or prompt_format == "question"


def make_source(spec: DataSpec) -> PromptSource:
    """The `ReasoningGymSource`, `MathSource` or `FileSource` a `DataSpec` describes.

    Raises:
      TypeError: ``spec`` is not a `DataSpec`.
      ValueError: unknown kind, missing path, unknown task, bad task_config, prompt_format or num_eval (naming the
        field)."""
    if not isinstance(spec, DataSpec):
        raise TypeError(f"make_source takes a DataSpec (DataSpec.from_config(config.data)), got {type(spec).__name__}")
    if spec.kind not in KINDS:
        raise ValueError(f"data.kind must be one of {KINDS}, got {spec.kind!r}")
    if spec.chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"data.chat_template must be one of {CHAT_TEMPLATES}, got {spec.chat_template!r}")
    if not isinstance(spec.task_config, Mapping):
        raise ValueError(f"data.task_config must be a dict, got {spec.task_config!r}")
    chat = applies_chat_template(spec.kind, spec.prompt_format, spec.chat_template, spec.chat)
    if spec.kind == "reasoning_gym":
        if not spec.task:
            raise ValueError(f"data.task is required for kind='reasoning_gym', got {spec.task!r}")
        return ReasoningGymSource(spec.task, dict(spec.task_config), prompt_format=spec.prompt_format,
                                  num_eval=spec.num_eval, seed=spec.seed, train_size=spec.train_size, chat=chat)
    if spec.kind == "file":
        return FileSource(path=spec.path, eval_path=spec.eval_path or None, prompt_field=spec.prompt_field,
                          answer_field=spec.answer_field, num_eval=spec.num_eval, seed=spec.seed,
                          verify_timeout_s=spec.verify_timeout_s, chat=chat)
    return MathSource(spec.kind, path=spec.path or None, eval_path=spec.eval_path or None,
                      prompt_format=spec.prompt_format, num_eval=spec.num_eval, seed=spec.seed,
                      instruction=spec.instruction, verify_timeout_s=spec.verify_timeout_s, chat=chat)
