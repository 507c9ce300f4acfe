"""The tiny task with a BPE vocabulary trained on its own text: many plausible continuations, K << V.

``configs/tiny.py`` with a vocabulary of 1024 tokens (issue 29's testbed candidate, where the top-K view
and the masks' direction tests have room to differ):

* ``tokenizer.kind = "bpe"``: byte-level byte-pair encoding trained with the ``tokenizers`` library on
  the task's training prompts and reference answers, to ``tokenizer.vocab_size`` = 1024 tokens (2
  special tokens, 256 bytes, 766 merges: a prompt like ``57+87=`` is 1-3 tokens, an answer one token
  of the ~300 numbers' and rarely two);
* the sampler's top-K view K = 20 of V = 1024 (the paper's K), completions of at most 4 tokens;
* a longer warm start (2,500 SFT steps instead of 700: the model learns each number's token from
  scratch): held-out avg@4 0.115 after it, against the char tokenizer's 0.48 after 700 steps.

What it shows and what it does not (a pilot of 200 RL steps per arm): ``reports/bpe_pilot/README.md``.

The behaviour/trainer mismatch lever is ``sampler.temperature`` (rollouts drawn, and log mu computed,
at their own temperature, while the loss's pi stays at ``rl.temperature``).

Argument string: ``configs/tiny_bpe.py:tokenizer.vocab_size=2048,sampler.temperature=1.2,delta=0.15``.
"""

import os
import runpy

from pdm_jax.config import apply_arg


def get_config(arg=None):
    """Returns the BPE testbed config, with `arg` overrides applied (after its own settings)."""
    tiny = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))  # not a package
    c = tiny["get_config"]()
    # The testbed keeps the tiny model it was measured with: configs/tiny.py's default run has 4 layers and a warm
    # start that ends on a token-accuracy target (its section of docs/benchmarks.md); this config's figures are the
    # 3-layer, fixed-length warm start's.
    c.model.num_hidden_layers = 3
    c.sft.target_token_accuracy = 0.0
    c.tokenizer.kind = "bpe"
    c.tokenizer.vocab_size = 1024
    c.sft.steps = 2500
    c.rl.top_k_logprobs = 20
    c.rl.max_new_tokens = 4  # answers of one or two tokens + the stop token, with room for a longer wrong one
    return apply_arg(c, arg)
