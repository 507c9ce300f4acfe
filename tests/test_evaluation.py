"""`pdm_jax.evaluation`: verifier rewards of rollouts and the held-out accuracy, with a scripted engine, source
and codec (no model): rows are prompt-major, a cut-off completion is scored as truncated, avg@k counts fully
correct answers only (partial credit goes to ``eval_reward``), greedy samples once at temperature 0, and one
process's share of the prompts is keyed by its first prompt index and gathered."""

import dataclasses
import types

import numpy as np
import pytest

from pdm_jax import evaluation
from pdm_jax.config import get_base_config
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rollout import build_batch

STOP = 9


class _Codec:
    """Digits as token ids; the stop id is dropped on decoding."""
    stop_ids = (STOP,)

    def encode_prompt(self, prompt):
        return [int(c) for c in prompt]

    def decode_completion(self, ids, mask):
        return "".join(str(int(t)) for t, m in zip(ids, mask) if m and int(t) not in self.stop_ids)


class _Source:
    """Answer == text: 1.0; the first digit right: 0.5 (partial credit); a truncated completion: 0.0."""

    def __init__(self, answers):
        self.examples = [types.SimpleNamespace(prompt=str(i), answer=a) for i, a in enumerate(answers)]
        self.scored = []

    def eval_examples(self):
        return list(self.examples)

    def score(self, text, example, truncated=False):
        self.scored.append((text, example.answer, truncated))
        if truncated:
            return 0.0
        return 1.0 if text == example.answer else 0.5 if text[:1] == example.answer[:1] else 0.0


class _Engine:
    """Answers each prompt (by its key: ``first_prompt_index`` + position) with the scripted (text, finish) rows."""

    def __init__(self, sampled, greedy):
        self.script = {True: sampled, False: greedy}
        self.calls = []

    def generate(self, prompts, *, n, temperature, seed, **kw):
        self.calls.append(dict(prompts=prompts, n=n, temperature=temperature, seed=seed, **kw))
        first = kw.get("first_prompt_index", 0)
        rows = [self.script[temperature > 0][first + i][j] for i in range(len(prompts)) for j in range(n)]
        ids = [[int(c) for c in text] + ([STOP] if finish == "stop" else []) for text, finish in rows]
        t = max(map(len, ids))
        completion = np.array([x + [0] * (t - len(x)) for x in ids], np.int32)
        return build_batch(prompts, group_ids=np.repeat(np.arange(len(prompts)), n), lengths=[len(x) for x in ids],
                           completion_ids=completion, behavior_logprobs=np.zeros(completion.shape, np.float32),
                           topk_ids=np.zeros(completion.shape + (1,), np.int32),
                           topk_logprobs=np.zeros(completion.shape + (1,), np.float32), weights_version=0,
                           finish_reason=[finish for _, finish in rows])


SAMPLED = {0: [("12", "stop"), ("1", "stop")],   # correct, partial
           1: [("34", "length"), ("35", "stop")]}  # right digits but cut off (no credit), partial
GREEDY = {0: [("12", "stop")], 1: [("34", "stop")]}
def _spec(**fields) -> EvalSpec:
    """The base config's `EvalSpec` with ``fields`` changed."""
    return dataclasses.replace(EvalSpec.from_config(get_base_config().eval), **fields)


EVAL = _spec(num_prompts=2, samples_per_prompt=2, greedy=True)


def test_eval_spec_reads_the_schema():
    c = get_base_config().eval
    assert EvalSpec.from_config(c) == EvalSpec(every_steps=c.every_steps, num_prompts=c.num_prompts,
                                               samples_per_prompt=c.samples_per_prompt, greedy=c.greedy,
                                               engine=c.engine)
    with pytest.raises(AttributeError, match="greedy"):
        EvalSpec.from_config(type("Section", (), dict(every_steps=1, num_prompts=1, samples_per_prompt=1))())


def test_avg_at_k_counts_only_fully_correct_answers_and_greedy_samples_once():
    source, engine = _Source(["12", "34", "56"]), _Engine(SAMPLED, GREEDY)
    out = evaluation.evaluate(engine, source, _Codec(), EVAL, temperature=0.7, max_new_tokens=4, seed=5)
    # sampled scores [1.0, 0.5, 0.0, 0.5]: one of four fully correct, mean reward 0.5; greedy: both correct
    assert out == dict(eval_accuracy=0.25, eval_reward=0.5, eval_greedy_accuracy=1.0)
    assert [(c["n"], c["temperature"], c["seed"]) for c in engine.calls] == [(2, 0.7, 5), (1, 0.0, 0)]
    assert all(c["prompts"] == [[0], [1]] and c["max_new_tokens"] == 4 and c["top_k_logprobs"] == 1
               and c["stop_token_ids"] == [STOP] and "first_prompt_index" not in c for c in engine.calls)
    # rows are prompt-major; the "length" row is scored as truncated, the stop id is not part of the text
    assert source.scored[:4] == [("12", "12", False), ("1", "12", False), ("34", "34", True), ("35", "34", False)]
    with pytest.raises(ValueError, match="eval.num_prompts = 4 but the source has only 3 held-out prompts"):
        evaluation.evaluate(engine, source, _Codec(), _spec(num_prompts=4, samples_per_prompt=1, greedy=False),
                            temperature=1.0, max_new_tokens=4, seed=0)


def test_a_share_of_the_prompts_is_keyed_by_its_index_and_gathered():
    source, engine = _Source(["12", "34"]), _Engine(SAMPLED, GREEDY)
    gathered = []

    def gather(scores, total, n):  # as per_host.gather_ragged: prompt 0's scores come from the other process
        gathered.append((scores.tolist(), total, n))
        return np.concatenate([np.ones(n, np.float32), scores])

    out = evaluation.evaluate(engine, source, _Codec(), EVAL, temperature=0.7, max_new_tokens=4, seed=5,
                              prompt_range=(1, 2), gather=gather)
    assert [c["prompts"] for c in engine.calls] == [[[1]], [[1]]]
    assert all(c["first_prompt_index"] == 1 for c in engine.calls)
    assert gathered == [([0.0, 0.5], 2, 2), ([1.0], 2, 1)]
    assert out == dict(eval_accuracy=0.5, eval_reward=0.625, eval_greedy_accuracy=1.0)


def test_a_source_that_scores_batches_gets_every_row_at_once():
    class Batched(_Source):
        def score_batch(self, texts, examples, truncated):
            self.batches = [(texts, [e.answer for e in examples], truncated)]
            return [1.0] * len(texts)

    source = Batched(["12", "34"])
    rb = _Engine(SAMPLED, GREEDY).generate([[0], [1]], n=2, temperature=1.0, seed=0)
    got = evaluation.score_rollouts(source, _Codec(), rb, source.examples, 2)
    assert got.dtype == np.float32 and got.tolist() == [1.0] * 4 and source.scored == []
    assert source.batches == [(["12", "1", "34", "35"], ["12", "12", "34", "34"], [False, False, True, False])]
