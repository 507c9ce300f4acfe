"""pdm_jax.data.tasks: the reasoning-gym source (compact and question formats, scoring, answer extraction)
through `make_source`. The local math datasets: tests/test_data_math_data.py; the math verifier:
tests/test_data_verifiers.py."""

import os

import pytest
import reasoning_gym

from pdm_jax.data import COMPACT_ALPHABET, Example, PromptSource, ReasoningGymSource, make_source
from pdm_jax.data.tasks import extract_compact_answer, extract_tagged_answer
from conftest import FIXTURES, data_spec, math_source_config

TINY_TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _rg_config(**overrides):
    fields = {
        "kind": "reasoning_gym",
        "task": "chain_sum",
        "task_config": dict(TINY_TASK_CONFIG),
        "prompt_format": "compact",
        "num_eval": 256,
        "seed": 0,
    }
    fields.update(overrides)  # replaces task_config wholesale (ConfigDict.update would merge)
    return data_spec(fields)


@pytest.fixture(scope="module")
def rg_source():
    return make_source(_rg_config())


# ---------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------


def test_rg_source_protocol_and_compact_format(rg_source):
    assert isinstance(rg_source, PromptSource)
    assert rg_source.chat is False
    batch = rg_source.train_batch(0, 300)
    assert [e.uid for e in batch[:3]] == ["chain_sum/train/0", "chain_sum/train/1", "chain_sum/train/2"]
    for example in batch + rg_source.eval_examples():
        assert isinstance(example, Example)
        assert set(example.prompt) <= set(COMPACT_ALPHABET)
        assert set(example.answer) <= set(COMPACT_ALPHABET) - {"=", "+"}
        assert example.prompt.endswith("=") and example.prompt.count("=") == 1
        # The prompt is the rg expression without spaces; the answer is its value.
        expression = example.meta["rg_metadata"]["expression"]
        assert example.prompt == expression.replace(" ", "") + "="
        assert int(example.answer) == eval(expression)  # independent recomputation
        left, right = example.prompt[:-1].replace("-", "+-").split("+", 1)
        assert 0 <= int(left) <= 99


def test_rg_train_stream_is_deterministic_and_wraps():
    a = make_source(_rg_config(num_eval=16, train_size=50))
    b = make_source(_rg_config(num_eval=16, train_size=50))
    assert a.train_batch(7, 20) == b.train_batch(7, 20)
    assert [e.prompt for e in a.train_batch(3, 5)] == [a.train_example(i).prompt for i in range(3, 8)]
    # Wrap-around: positions p and p + train_size carry the same example.
    assert a.train_example(3).prompt == a.train_example(53).prompt
    assert a.train_example(3).answer == a.train_example(53).answer
    c = make_source(_rg_config(num_eval=16, seed=1))
    assert [e.prompt for e in c.train_batch(0, 20)] != [e.prompt for e in a.train_batch(0, 20)]


def test_rg_eval_set_unique_and_disjoint_from_train(rg_source):
    eval_examples = rg_source.eval_examples()
    assert len(eval_examples) == 256
    eval_prompts = {e.prompt for e in eval_examples}
    assert len(eval_prompts) == 256  # de-duplicated
    assert eval_examples == make_source(_rg_config()).eval_examples()  # fixed
    # The 1-digit sub-space has only 200 prompts, so raw rg draws collide with
    # the held-out set often; the stream must skip every one of them.
    train_prompts = [e.prompt for e in rg_source.train_batch(0, 3000)]
    assert not eval_prompts.intersection(train_prompts)
    raw = reasoning_gym.create_dataset("chain_sum", seed=0, size=3000, **TINY_TASK_CONFIG)
    raw_prompts = [raw[i]["metadata"]["expression"].replace(" ", "") + "=" for i in range(3000)]
    collisions = sum(p in eval_prompts for p in raw_prompts)
    assert collisions > 50  # the check is exercised, not vacuous
    # Non-colliding positions are the raw rg items themselves.
    for i in range(3000):
        if raw_prompts[i] not in eval_prompts:
            assert train_prompts[i] == raw_prompts[i]


def test_rg_score_compact(rg_source):
    example = Example(prompt="57+87=", answer="144", uid="x", meta={})
    assert rg_source.score("144", example) == 1.0
    assert rg_source.score(" 144\n", example) == 1.0
    assert rg_source.score("144=57", example) == 1.0  # read up to the first non-answer char
    assert rg_source.score("145", example) == 0.0
    assert rg_source.score("", example) == 0.0
    assert rg_source.score("garbage", example) == 0.0
    assert rg_source.score("=144", example) == 0.0
    assert rg_source.score(None, example) == 0.0
    assert rg_source.score("\x00\uffff" * 50, example) == 0.0
    negative = Example(prompt="5-9=", answer="-4", uid="y", meta={})
    assert rg_source.score("-4", negative) == 1.0
    assert rg_source.score("4", negative) == 0.0


def test_rg_score_matches_reasoning_gym_verifier(rg_source):
    examples = rg_source.train_batch(0, 40) + rg_source.eval_examples()[:40]
    raw_train = reasoning_gym.create_dataset("chain_sum", seed=0, size=10, **TINY_TASK_CONFIG)
    for example in examples:
        entry = {"question": example.meta["question"], "answer": example.answer,
                 "metadata": example.meta["rg_metadata"]}
        for completion in (example.answer, str(int(example.answer) + 1), example.answer + "7", "0"):
            expected = raw_train.score_answer(completion, entry)
            assert rg_source.score(completion, example) == pytest.approx(expected)
        assert rg_source.score(rg_source.sft_target(example), example) == 1.0


def test_rg_question_format():
    source = make_source(_rg_config(prompt_format="question", num_eval=8))
    assert source.chat is True
    example = source.train_example(0)
    raw = reasoning_gym.create_dataset("chain_sum", seed=0, size=10, **TINY_TASK_CONFIG)[0]
    assert example.prompt == raw["question"] and example.answer == raw["answer"]
    assert source.score(f"Let me think.\n<answer>{example.answer}</answer>", example) == 1.0
    assert source.score(f"The sum is \\boxed{{{example.answer}}}.", example) == 1.0
    assert source.score(f"Answer: {example.answer}", example) == 1.0
    assert source.score("<answer>99999</answer>", example) == 0.0


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"kind": "nope"}, "data.kind"),
        ({"task": "no_such_task"}, "data.task"),
        ({"task_config": {"bogus": 1}}, "data.task_config"),
        ({"task_config": {"min_terms": 0}}, "data.task_config"),
        ({"task_config": {"seed": 3}}, "data.task_config"),
        ({"prompt_format": "verbose"}, "data.prompt_format"),
        ({"num_eval": 0}, "data.num_eval"),
        ({"task": "basic_arithmetic", "task_config": {}}, "data.prompt_format"),  # has * and /
        ({"task": "word_sorting", "task_config": {}}, "data.prompt_format"),  # no expression
        ({"task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
          "num_eval": 500}, "data.num_eval"),  # only 200 distinct prompts
    ],
)
def test_rg_bad_config_names_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_source(_rg_config(**overrides))


def test_rg_task_with_negation_stays_in_alphabet():
    source = ReasoningGymSource(
        "chain_sum", {"min_terms": 2, "max_terms": 3, "allow_negation": True, "max_digits": 2}, num_eval=32
    )
    for example in source.train_batch(0, 100):
        assert set(example.prompt + example.answer) <= set(COMPACT_ALPHABET)


# ---------------------------------------------------------------------------
# score_batch (also a math source's) and indices
# ---------------------------------------------------------------------------


def test_score_batch_matches_score(rg_source):
    examples = rg_source.train_batch(0, 6)
    completions = [e.answer for e in examples[:3]] + ["0", "", "x"]
    assert rg_source.score_batch(completions, examples) == [
        rg_source.score(c, e) for c, e in zip(completions, examples)]
    source = make_source(math_source_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.jsonl")))
    examples = source.train_batch(0, 4) * 2
    completions = [source.sft_target(e) for e in examples[:4]] + ["Answer: 999"] * 3 + ["no answer"]
    assert source.score_batch(completions, examples) == [1.0] * 4 + [0.0] * 4
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    with pytest.raises(ValueError, match="score_batch"):
        source.score_batch(completions[:2], examples)


def test_index_validation(rg_source):
    import numpy as np

    assert rg_source.train_example(np.int64(5)) == rg_source.train_example(5)
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="index"):
            rg_source.train_example(bad)
    with pytest.raises(ValueError, match="count"):
        rg_source.train_batch(0, -2)


# ---------------------------------------------------------------------------
# answer forms of real model responses (issue 15); the compact format unchanged
# ---------------------------------------------------------------------------


def _rg(**overrides):
    return make_source(_rg_config(**{"num_eval": 8, **overrides}))


@pytest.fixture(scope="module")
def question_source():
    return _rg(prompt_format="question")


@pytest.mark.parametrize("template, truncated, reward", [
    ("<answer>**{a}**</answer>", False, 1.0),
    ("<answer> ${a}$ </answer>", False, 1.0),
    ("Answer: **{a}**", False, 1.0),
    ("#### Step 1: add\nAnswer: {a}", False, 1.0),
    ("The sum is $\\boxed{{{a}}}$.", False, 1.0),
    ("{a}", False, 1.0),  # a short direct answer
    ("<answer>{a}</answer> wait, <answer>{a}", False, 0.0),  # the last <answer> never closes: cut off
    ("Answer: {a}", True, 0.0),
    ("Answer: {a}\nDone", True, 1.0),
])
def test_question_format_scores_response_forms(question_source, template, truncated, reward):
    example = question_source.train_example(0)
    assert question_source.score(template.format(a=example.answer), example, truncated=truncated) == reward


def test_extract_tagged_answer_precedence():
    assert extract_tagged_answer("\\boxed{1}\n<answer>2</answer>") == "2"  # a closed tag wins
    assert extract_tagged_answer("<answer>2</answer>\n\\boxed{1}") == "2"
    assert extract_tagged_answer("<answer>2") == ""
    assert extract_tagged_answer("so \\boxed{12") == ""
    assert extract_tagged_answer("  **7** ") == "7"
    assert extract_tagged_answer(None) == ""


def test_compact_format_is_unchanged():
    """The default run's scoring (leading integer of a compact completion) does not move, with or without
    the truncation flag."""
    source = _rg()
    minus = Example(prompt="5-33=", answer="-28", uid="m", meta={})
    assert extract_compact_answer("-28garbage") == "-28"
    assert source.score("-28garbage", minus) == 1.0
    assert source.score("-28garbage", minus, truncated=True) == 1.0
    assert source.score("**-28**", minus) == 0.0  # no markdown in the compact format
    plus = Example(prompt="57+87=", answer="144", uid="p", meta={})
    assert source.score("1445", plus) == pytest.approx(0.75)  # rg partial credit, as before
    assert source.score("14", plus, truncated=True) == 0.0
    assert source.score_batch(["144", "14"], [plus, plus], truncated=[True, False]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="truncated flags"):
        source.score_batch(["144"], [plus], truncated=[True, False])
