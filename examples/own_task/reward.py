"""Reward functions of the worked example (``reward.functions`` in examples/own_task/config.py).

Each takes the batch's prompts and completions and, as keyword arguments, the prompt file's other columns
(``answer``, ``borrow``) plus ``completion_ids`` and ``truncated``, one entry per completion, and returns one
float or None per completion (TRL's ``reward_funcs`` convention; docs: pdm_jax/rewards.py).
"""

import re

_LEADING_INT = re.compile(r"\s*(-?[0-9]+)")


def _leading_int(text):
    match = _LEADING_INT.match(text)
    return int(match.group(1)) if match else None


def exact(prompts, completions, answer, **kwargs):
    """1.0 when the completion starts with the right difference, else 0.0."""
    return [1.0 if _leading_int(c) == int(a) else 0.0 for c, a in zip(completions, answer)]


def close(prompts, completions, answer, **kwargs):
    """Partial credit for a near miss: max(0, 1 - |x - answer| / 10) for the completion's leading integer x;
    None (no reward from this function) when the completion starts with no integer."""
    out = []
    for completion, a in zip(completions, answer):
        x = _leading_int(completion)
        out.append(None if x is None else max(0.0, 1.0 - abs(x - int(a)) / 10.0))
    return out
