"""A task with many right answers on a BPE vocabulary: issue 29's candidate testbed where the masks can differ.

``configs/tiny_bpe.py`` (the tiny model, a 1,024-token byte-level BPE trained on the task's own text, K = 20) with
the task ``number_between`` (`pdm_jax.data.number_between`): a prompt ``53721<x<53960=`` asks for any integer
strictly inside the interval (bounds up to 99,999, widths 10-400), and every one of them earns reward 1.

* The warm start's targets are uniform over the valid answers, so the model's answer tokens stay uncertain (a
  spread over many right continuations, not over wrong ones), and a 5-digit answer spans 2-3 BPE tokens.
* The 2,500-step warm start (about 4 min on a 2-core CPU) gives held-out avg@4 0.72, greedy 0.875.
* The behaviour/trainer mismatch lever is ``sampler.weight_noise`` (a fixed perturbation of the sampler's copy, of
  a chosen size, docs/sampler.md); the default here is 0 (the sampler's fp8 copy alone).

Argument string: ``configs/tiny_between.py:sampler.weight_noise=0.1,delta=0.05``.
"""

import os
import runpy

import ml_collections

from pdm_jax.config import apply_arg


def get_config(arg=None):
    """Returns the number_between testbed config, with `arg` overrides applied (after its own settings)."""
    here = os.path.dirname(os.path.abspath(__file__))
    c = runpy.run_path(os.path.join(here, "tiny_bpe.py"))["get_config"]()  # configs/ is not a package
    c.data.task = "number_between"
    c.data.task_config = ml_collections.ConfigDict(dict(min_value=0, max_value=99999, min_width=10, max_width=400))
    c.data.prompt_format = "question"  # the question text is the prompt; the answer is the completion itself
    c.data.chat_template = "off"  # a trained BPE has no chat template
    c.rl.max_new_tokens = 6  # a 5-digit answer is 2-3 tokens, then the stop token
    return apply_arg(c, arg)
