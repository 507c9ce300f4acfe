"""`DataSpec`: the typed ``data`` section of a run config, the one input of `pdm_jax.data.make_source`.

`DataSpec.from_config` reads a validated config's section field by field, no fallbacks (defaults live in the schema);
tools and tests change fields with `dataclasses.replace`. Four fields are not in the run config; their defaults live
here."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional


def resolve_prompt_format(kind: str, prompt_format: str) -> str:
    """``data.prompt_format`` as the source takes it: ``"auto"`` is the kind's own format, ``"compact"`` for
    reasoning_gym and ``"question"`` for the file kinds (gsm8k, dapo_math); any other value unchanged."""
    if prompt_format != "auto":
        return prompt_format
    return "compact" if kind == "reasoning_gym" else "question"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The prompt source of a run (docs/configuration.md, section ``data``).

    Schema fields: ``kind``, ``task`` / ``task_config``, ``prompt_format`` (the config's "auto" resolved by
    `resolve_prompt_format`), ``chat_template``, ``enable_thinking`` (read by `TextCodec`), ``path`` / ``eval_path``
    ("" = none), ``num_eval``, ``seed``, ``prompt_field`` / ``answer_field``. Not in the run config: ``train_size``
    (reasoning-gym positions before wrapping), ``instruction`` (math kinds' appended text), ``verify_timeout_s``
    (seconds) and ``chat`` (None = the source's own choice)."""

    kind: str
    task: str
    task_config: Mapping[str, Any]
    prompt_format: str
    chat_template: str
    enable_thinking: bool
    path: str
    eval_path: str
    num_eval: int
    seed: int
    prompt_field: str
    answer_field: str
    train_size: int = 1 << 20
    instruction: str = ""
    verify_timeout_s: float = 5.0
    chat: Optional[bool] = None

    @classmethod
    def from_config(cls, data) -> "DataSpec":
        """The spec of a validated config's ``data`` section (a ConfigDict, or anything with its fields).

        Raises:
          AttributeError: naming a field the section lacks (a section that is not the schema's).
        """
        task_config = data.task_config
        task_config = dict(task_config.to_dict() if hasattr(task_config, "to_dict") else task_config or {})
        return cls(kind=str(data.kind), task=str(data.task), task_config=task_config,
                   prompt_format=resolve_prompt_format(str(data.kind), str(data.prompt_format)),
                   chat_template=str(data.chat_template),
                   enable_thinking=bool(data.enable_thinking), path=str(data.path), eval_path=str(data.eval_path),
                   num_eval=int(data.num_eval), seed=int(data.seed), prompt_field=str(data.prompt_field),
                   answer_field=str(data.answer_field))
