"""pdm_jax.data: prompt sources (reasoning-gym, local HF datasets) and verifiers.

Entry point: `make_source(config)` builds a `PromptSource` from an
ml_collections ConfigDict (or any mapping) with fields

  kind           "reasoning_gym" | "gsm8k" | "dapo_math"                (required)
  task           reasoning-gym task name, e.g. "chain_sum"            (reasoning_gym)
  task_config    dict of reasoning-gym config kwargs                  (reasoning_gym)
  prompt_format  "compact" | "question"  (default "compact" for reasoning_gym,
                 "question" for the math datasets, which only support it)
  path           local json/jsonl/parquet file                        (gsm8k, dapo_math)
  eval_path      optional separate held-out file                      (gsm8k, dapo_math)
  num_eval       held-out size (default 256)
  seed           int (default 0)
  train_size     reasoning_gym only: stream positions before wrapping (default 2**20)
  instruction    math only: text appended to each prompt (default "")
  verify_timeout_s  math only: math-verify budget per completion (default 5.0)
  chat_template  "auto" (the source's chat flag) | "on" (the tokenizer's chat template) |
                 "off" (raw prompt text, e.g. for a Base model)
  chat           (mappings only) optional override of the source's chat flag under "auto"

Unknown kind, missing path, bad task etc. raise ValueError naming the field.

Once the tokenizer exists, `filter_long_prompts(source, codec.encode_prompt,
config.sampler.max_prompt_length)` drops (and counts) the prompts longer than the
sampler accepts, from the training stream and the held-out set.
"""

from __future__ import annotations

from typing import Any, Mapping

from pdm_jax.data.tasks import (
    COMPACT_ALPHABET,
    Example,
    PromptSource,
    ReasoningGymSource,
    extract_compact_answer,
    extract_tagged_answer,
)
from pdm_jax.data.math_data import MathSource
from pdm_jax.data.prompt_filter import LengthFilteredSource, filter_long_prompts

KINDS = ("reasoning_gym", "gsm8k", "dapo_math")
#: data.chat_template: the source's own choice, the tokenizer's chat template, or raw prompt text.
CHAT_TEMPLATES = ("auto", "on", "off")

__all__ = [
    "COMPACT_ALPHABET",
    "Example",
    "KINDS",
    "LengthFilteredSource",
    "PromptSource",
    "ReasoningGymSource",
    "extract_compact_answer",
    "extract_tagged_answer",
    "filter_long_prompts",
    "make_source",
]


def _to_dict(value: Any) -> dict:
    if value is None:
        return {}
    if hasattr(value, "to_dict"):
        return dict(value.to_dict())
    if isinstance(value, Mapping):
        return dict(value)
    raise ValueError(f"data.task_config must be a dict, got {value!r}")


def make_source(config) -> PromptSource:
    """Build the prompt source described by `config` (see module docstring).

    Args:
      config: ml_collections.ConfigDict (or mapping) with the fields above.

    Returns:
      A `ReasoningGymSource` or `pdm_jax.data.math_data.MathSource`.

    Raises:
      ValueError: unknown kind, missing/non-existent path, unknown task, bad
        task_config, prompt_format or num_eval (the message names the field).
    """
    cfg = _to_dict(config)

    def get(name, default=None):
        value = cfg.get(name, default)
        return default if value is None else value

    kind = cfg.get("kind")
    if kind not in KINDS:
        raise ValueError(f"data.kind must be one of {KINDS}, got {kind!r}")
    num_eval = get("num_eval", 256)
    seed = get("seed", 0)
    template = cfg.get("chat_template", "auto")
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"data.chat_template must be one of {CHAT_TEMPLATES}, got {template!r}")
    chat = {"auto": cfg.get("chat"), "on": True, "off": False}[template]
    if kind == "reasoning_gym":
        task = cfg.get("task")
        if not task:
            raise ValueError(f"data.task is required for kind='reasoning_gym', got {task!r}")
        return ReasoningGymSource(
            task,
            _to_dict(cfg.get("task_config")),
            prompt_format=get("prompt_format", "compact"),
            num_eval=num_eval,
            seed=seed,
            train_size=get("train_size", 1 << 20),
            chat=chat,
        )
    return MathSource(
        kind,
        path=cfg.get("path"),
        eval_path=cfg.get("eval_path"),
        prompt_format=get("prompt_format", "question"),
        num_eval=num_eval,
        seed=seed,
        instruction=get("instruction", ""),
        verify_timeout_s=get("verify_timeout_s", 5.0),
        chat=chat,
    )
