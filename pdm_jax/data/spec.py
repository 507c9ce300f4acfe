"""`DataSpec`: the typed ``data`` section of a run config, the one input of `pdm_jax.data.make_source`.

The run config is validated once (`pdm_jax.config.validate_config`); `DataSpec.from_config` then reads its ``data``
section field by field, with no fallbacks: every default of a run lives once, in the schema
(`pdm_jax.config.get_base_config`, docs/configuration.md). Tools and tests that want another source build the spec from
the base config and change fields with `dataclasses.replace`. Three fields are not in the run config (tools and tests
set them); their defaults live here only.
"""

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

    Fields of the schema: ``kind`` ("reasoning_gym" | "gsm8k" | "dapo_math"), ``task`` and ``task_config`` (a
    reasoning-gym task and its keyword arguments), ``prompt_format`` ("compact" | "question"; the config's "auto"
    resolved by `resolve_prompt_format`), ``chat_template`` ("auto" | "on" | "off"), ``enable_thinking`` (read by
    `pdm_jax.text.TextCodec`, not by the source), ``path`` / ``eval_path`` (local json / jsonl / parquet files; "" =
    none), ``num_eval`` (held-out prompts), ``seed``, ``prompt_field`` / ``answer_field`` (kind "file": the prompt and
    reference-answer columns).

    Not in the run config: ``train_size`` (reasoning-gym stream positions before wrapping), ``instruction`` (math kinds:
    text appended to each prompt), ``verify_timeout_s`` (math kinds: math-verify's budget per completion, seconds) and
    ``chat`` (under ``chat_template="auto"``: None = the source's own choice, or an override).
    """

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
