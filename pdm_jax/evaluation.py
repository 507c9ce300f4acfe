"""Verifier rewards of rollouts, and the held-out evaluation (avg@k and greedy accuracy)."""

from __future__ import annotations

import dataclasses

import numpy as np

from pdm_jax.rollout import RolloutBatch
from pdm_jax.text import TextCodec

CORRECT_SCORE = 0.999  # a verifier score at or above this counts as a correct answer


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """The held-out evaluation of a run (docs/configuration.md, section ``eval``): every ``every_steps`` RL steps (and
    at the last), the first ``num_prompts`` held-out prompts, ``samples_per_prompt`` samples each (avg@k at the training
    temperature), ``greedy`` accuracy too, on ``engine`` "f32" (an unquantized engine of the trainer's) or "rollout"
    (the rollout sampler)."""

    every_steps: int
    num_prompts: int
    samples_per_prompt: int
    greedy: bool
    engine: str

    @classmethod
    def from_config(cls, section) -> "EvalSpec":
        """The spec of a validated config's ``eval`` section, read field by field (no fallbacks).

        Raises:
          AttributeError: naming a field the section lacks.
        """
        return cls(every_steps=int(section.every_steps), num_prompts=int(section.num_prompts),
                   samples_per_prompt=int(section.samples_per_prompt), greedy=bool(section.greedy),
                   engine=str(section.engine))


def score_rollouts(source, codec: TextCodec, rb: RolloutBatch, examples, n: int) -> np.ndarray:
    """Verifier rewards ``[N]`` float32, row ``i`` against ``examples[i // n]``; "length" rows are scored with
    ``truncated=True``; a source's ``score_batch`` scores the batch concurrently, a `RewardedSource` gives its
    combined reward."""
    if hasattr(source, "score_rollout_batch"):  # the user's reward functions (pdm_jax.rewards.RewardedSource)
        return source.score_rollout_batch(codec, rb, examples, n)[0]
    texts = [codec.decode_completion(rb.completion_ids[i], rb.completion_mask[i]) for i in range(rb.num_sequences)]
    exs = [examples[i // n] for i in range(rb.num_sequences)]
    # A completion cut off by max_tokens ("length") gets no credit for an answer on its unfinished last line.
    truncated = [str(r) == "length" for r in rb.finish_reason]
    if hasattr(source, "score_batch"):
        return np.asarray(source.score_batch(texts, exs, truncated=truncated), np.float32)
    return np.asarray([source.score(t, e, truncated=c) for t, e, c in zip(texts, exs, truncated)], np.float32)


def evaluate(engine, source, codec: TextCodec, eval_spec: EvalSpec, *, temperature: float, max_new_tokens: int,
             seed: int, prompt_range=None, gather=None) -> dict:
    """Accuracy on the first ``eval_spec.num_prompts`` held-out prompts.

    Args:
      engine: a sampler with ``generate``.
      source: the prompt source; codec: the run's `TextCodec`.
      eval_spec: the run's `EvalSpec` (num_prompts, samples_per_prompt k, greedy).
      temperature: τ of the avg@k samples; max_new_tokens: completion budget (tokens); seed: the avg@k seed.
      prompt_range: ``(lo, hi)``: sample only those held-out prompts (``first_prompt_index=lo``), e.g. one process's
        share; None = all.
      gather: with ``prompt_range``, ``gather(scores, num_prompts, samples_per_prompt)`` -> all prompts' scores in
        order (a collective, `per_host.gather_ragged`).

    Returns:
      ``eval_accuracy`` (avg@k: fully correct samples per prompt, averaged), ``eval_reward`` (mean score) and with
      ``greedy`` ``eval_greedy_accuracy`` (τ = 0, one sample).

    Raises:
      ValueError: fewer held-out prompts than ``eval_spec.num_prompts``."""
    exs = source.eval_examples()[: eval_spec.num_prompts]
    if len(exs) < eval_spec.num_prompts:
        raise ValueError(f"eval.num_prompts = {eval_spec.num_prompts} but the source has only {len(exs)} "
                         "held-out prompts")
    lo, hi = (0, len(exs)) if prompt_range is None else prompt_range
    total, exs = len(exs), exs[lo:hi]
    prompts = [codec.encode_prompt(e.prompt) for e in exs]
    common = dict(max_new_tokens=max_new_tokens, top_k_logprobs=1, stop_token_ids=list(codec.stop_ids),
                  **(dict(first_prompt_index=lo) if lo else {}))

    def scores(n, **kw):
        got = score_rollouts(source, codec, engine.generate(prompts, n=n, **kw, **common), exs, n) if exs \
            else np.zeros((0,), np.float32)
        return got if gather is None else gather(got, total, n)

    k = eval_spec.samples_per_prompt
    avg = scores(k, temperature=temperature, seed=seed)
    # Accuracy counts fully correct answers only (some verifiers give partial credit).
    out = dict(eval_accuracy=float(np.mean(avg >= CORRECT_SCORE)), eval_reward=float(np.mean(avg)))
    if eval_spec.greedy:
        out["eval_greedy_accuracy"] = float(np.mean(scores(1, temperature=0.0, seed=0) >= CORRECT_SCORE))
    return out
