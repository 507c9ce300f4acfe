"""Your own task, through config alone: prompts from examples/own_task/prompts.jsonl, rewards from reward.py.

480 of the 810 subtractions of a digit from a two-digit number ("76-1=", column ``answer`` "75", column
``borrow``: whether the ones digit borrows), drawn once with ``random.Random(0)``; 32 are held out. The reward
is ``exact + 0.5 * close`` (reward.py): full credit for the right difference, partial credit for a near miss,
and no reward from ``close`` (None) for a completion that starts with no number. The tiny model's character
tokenizer knows the characters "0123456789+-=" and nothing else, so every prompt is written in them, and it has
no chat template, so the prompts are raw text (``data.chat_template = "off"``). A warm start on the ``answer``
column, then GRPO.

    python -m pdm_jax.train --config=examples/own_task/config.py --workdir=runs/own_task
"""

import os

from pdm_jax.config import apply_arg, get_base_config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
    """The example's config (fields that differ from `pdm_jax.config.get_base_config`), `arg` overrides applied."""
    c = get_base_config()
    c.data.kind = "file"
    c.data.path = os.path.join(HERE, "prompts.jsonl")
    c.data.prompt_field = "prompt"
    c.data.answer_field = "answer"  # the warm start's target; the reward functions get it as `answer`
    c.data.chat_template = "off"  # the character tokenizer has no chat template
    c.data.num_eval = 32
    reward = os.path.join(HERE, "reward.py")
    c.reward.functions = f"{reward}:exact,{reward}:close"
    c.reward.weights = "1,0.5"
    c.sft.steps = 200
    c.sft.batch_size = 64
    c.rl.steps = 60
    c.rl.prompts_per_step = 16
    c.rl.max_new_tokens = 4  # a difference of at most 2 digits + the stop token
    c.rl.top_k_logprobs = 4
    c.rl.num_minibatches = 2
    c.eval.num_prompts = 32
    c.eval.every_steps = 20
    c.model.scan_layers = False
    return apply_arg(c, arg)
