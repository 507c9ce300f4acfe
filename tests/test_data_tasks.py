"""Tests for pdm_jax.data: reasoning-gym source, local math datasets, math verifier."""

import os
import threading
import time
from pathlib import Path

import ml_collections
import pytest
import reasoning_gym

from pdm_jax.data import COMPACT_ALPHABET, Example, PromptSource, ReasoningGymSource, make_source
from pdm_jax.data import verifiers
from pdm_jax.data.verifiers import (
    MathVerdict,
    extract_final_answer,
    math_reward,
    math_verdict,
    reset_verifier_counts,
    verifier_counts,
)

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
    return ml_collections.ConfigDict(fields)


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
# Local math datasets (GSM8K / DAPO-Math-17k schemas)
# ---------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "data" / "fixtures"


def _math_config(**fields):
    return ml_collections.ConfigDict({"num_eval": 2, "seed": 0, **fields})


def test_gsm8k_jsonl_source():
    source = make_source(_math_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl")))
    assert isinstance(source, PromptSource) and source.chat is True
    eval_examples = source.eval_examples()
    assert len(eval_examples) == 2 and source.num_train == 4
    train = source.train_batch(0, 12)  # three passes over the 4 training rows
    eval_prompts = {e.prompt for e in eval_examples}
    assert not eval_prompts.intersection(e.prompt for e in train)
    assert sorted(e.uid for e in train[:4]) == sorted(e.uid for e in train[4:8])  # each pass = all rows
    assert [e.uid for e in train[:4]] != [e.uid for e in train[4:8]] or [e.uid for e in train[4:8]] != [
        e.uid for e in train[8:12]]  # re-shuffled per epoch
    assert source.train_batch(5, 3) == make_source(
        _math_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"))).train_batch(5, 3)
    by_question = {e.prompt: e for e in train + eval_examples}
    marbles = by_question["Tom has 3 boxes with 250 marbles each and buys 2 more such boxes. "
                          "How many marbles does he have?"]
    assert marbles.answer == "1250"  # "#### 1,250" with the comma removed
    target = source.sft_target(marbles)
    assert target == "He has 3+2=5 boxes.\n5*250=1250 marbles.\n#### 1250"  # no <<...>> annotations
    assert source.score(target, marbles) == 1.0
    assert source.score("The answer is \\boxed{1250}.", marbles) == 1.0
    assert source.score("#### 1,250", marbles) == 1.0
    assert source.score("#### 1251", marbles) == 0.0
    assert source.score("", marbles) == 0.0


def test_gsm8k_separate_eval_file_drops_overlap():
    source = make_source(_math_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"),
                                      eval_path=str(FIXTURES / "gsm8k_tiny_eval.jsonl"), num_eval=3))
    eval_prompts = {e.prompt for e in source.eval_examples()}
    assert len(eval_prompts) == 3
    assert source.num_train == 4  # 6 rows minus the 2 that also appear in the eval file
    assert not eval_prompts.intersection(e.prompt for e in source.train_batch(0, 8))


@pytest.mark.parametrize("filename", ["dapo_math_tiny.jsonl", "dapo_math_tiny.parquet"])
def test_dapo_source_jsonl_and_parquet(filename):
    source = make_source(_math_config(kind="dapo_math", path=str(FIXTURES / filename),
                                      instruction=""))
    assert source.chat is True
    # 7 rows, one a repeated problem: de-duplicated to 6 = 2 eval + 4 train.
    assert len(source.eval_examples()) == 2 and source.num_train == 4
    examples = source.train_batch(0, 4) + source.eval_examples()
    assert len({e.prompt for e in examples}) == 6
    half = next(e for e in examples if "one half of one" in e.prompt)
    assert half.answer == "\\frac{1}{2}" and half.uid.endswith("/id-0000")
    assert half.prompt.startswith("Solve the following math problem")
    assert half.meta["messages"][0]["role"] == "user" and half.meta["data_source"] == "math_dapo"
    assert source.score("Half of one is 0.5.\nAnswer: 0.5", half) == 1.0
    assert source.score("Answer: 1/2", half) == 1.0
    assert source.score("Answer: 2", half) == 0.0
    assert source.score(source.sft_target(half), half) == 1.0


def test_jsonl_and_parquet_give_the_same_split():
    a = make_source(_math_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.jsonl")))
    b = make_source(_math_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.parquet")))
    assert a.eval_examples() == b.eval_examples()
    assert a.train_batch(0, 6) == b.train_batch(0, 6)


def test_math_instruction_is_appended():
    source = make_source(_math_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"),
                                      instruction="Put the final answer in \\boxed{}."))
    assert all(e.prompt.endswith("\n\nPut the final answer in \\boxed{}.") for e in source.eval_examples())


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"kind": "gsm8k"}, "data.path"),
        ({"kind": "gsm8k", "path": "/no/such/file.jsonl"}, "data.path"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "dapo_math_tiny.jsonl")}, "data.path"),  # wrong schema
        ({"kind": "dapo_math", "path": str(FIXTURES / "gsm8k_tiny.jsonl")}, "data.path"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "num_eval": 6}, "data.num_eval"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "prompt_format": "compact"},
         "data.prompt_format"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "eval_path": "/nope.parquet"},
         "data.eval_path"),
        ({"kind": "gsm8k", "path": str(FIXTURES)}, "data.path"),  # a directory
    ],
)
def test_math_bad_config_names_field(fields, field):
    with pytest.raises(ValueError, match=field):
        make_source(_math_config(**fields))


# ---------------------------------------------------------------------------
# math-verify verifier
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),  # last box, nested braces
        ("\\fbox{7}", "7"),
        ("\\boxed 5 apples", "5"),
        ("work\n#### 1,234\n", "1,234"),
        ("Answer: $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("The final answer: 12", "12"),
        ("\\boxed{3} and then\nAnswer: 4", "4"),  # the later final answer wins
        ("I think it is 7", None),
        ("\\boxed{unclosed", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


EQUIVALENT = [
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{1/2}", "0.5"),
    ("Answer: \\frac{1}{2}", "1/2"),
    ("\\boxed{3}", "3"),
    ("#### 3", "\\boxed{3}"),
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{1+x^2}", "x^2+1"),
    ("#### 1,000", "1000"),
    ("\\boxed{72.0}", "72"),
]
WRONG = [
    ("\\boxed{0.51}", "\\frac{1}{2}"),
    ("\\boxed{4}", "3"),
    ("Answer: -3", "3"),
    ("\\boxed{x^2-1}", "x^2+1"),
]


@pytest.mark.parametrize("in_process", [True, False])
def test_math_reward_equivalences(in_process):
    for completion, truth in EQUIVALENT:
        assert math_reward(completion, truth, timeout_s=5, in_process=in_process) == 1.0, (completion, truth)
    for completion, truth in WRONG:
        assert math_reward(completion, truth, timeout_s=5, in_process=in_process) == 0.0, (completion, truth)


def test_math_verdict_reasons_and_counts():
    reset_verifier_counts()
    assert math_verdict("3", "3", in_process=True) == MathVerdict(0.0, "no_answer", None)
    assert math_verdict("\\boxed{3}", "3", in_process=True).reason == "correct"
    assert math_verdict("\\boxed{4}", "3", in_process=True).reason == "wrong"
    assert math_verdict("\\boxed{3}", "", in_process=True).reason == "unparsable_gold"
    assert math_verdict(None, "3", in_process=True).reason == "error"
    counts = verifier_counts()
    assert counts["no_answer"] == counts["correct"] == counts["wrong"] == counts["unparsable_gold"] == 1
    assert counts["error"] == 1 and sum(counts.values()) == 5
    with pytest.raises(ValueError, match="timeout_s"):
        math_verdict("\\boxed{3}", "3", timeout_s=0)


def test_math_reward_from_threads():
    # math-verify's own signal.alarm timeouts raise in non-main threads; ours must not.
    cases = EQUIVALENT[:4] + WRONG[:2]
    results = {}

    def work(i, completion, truth):
        results[i] = (math_reward(completion, truth, timeout_s=5),
                      math_reward(completion, truth, timeout_s=5, in_process=True))

    threads = [threading.Thread(target=work, args=(i, c, t)) for i, (c, t) in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [results[i] for i in range(len(cases))] == [(1.0, 1.0)] * 4 + [(0.0, 0.0)] * 2


def test_math_reward_timeouts(monkeypatch):
    reset_verifier_counts()
    assert math_reward("\\boxed{2}", "2", timeout_s=5) == 1.0  # workers started
    # Soft timeout inside the worker (itimer): a huge power is abandoned on time.
    start = time.monotonic()
    assert math_verdict("\\boxed{9^{9^{9^{9}}}}", "3", timeout_s=0.2) == MathVerdict(0.0, "timeout", None)
    assert time.monotonic() - start < 0.2 + verifiers.HARD_TIMEOUT_GRACE_S
    # Hard deadline: make the caller's deadline expire before the worker's soft
    # budget, as when a worker is stuck in C code; the worker must be killed.
    pool = verifiers._get_pool()
    pids_before = {worker.proc.pid for worker in pool._all}
    monkeypatch.setattr(verifiers, "HARD_TIMEOUT_GRACE_S", -0.9)
    start = time.monotonic()
    assert math_verdict("\\boxed{9^{9^{9^{9}}}}", "3", timeout_s=1.0).reason == "timeout"
    assert time.monotonic() - start < 0.5
    killed = pids_before - {worker.proc.pid for worker in pool._all}
    assert len(killed) == 1
    monkeypatch.setattr(verifiers, "HARD_TIMEOUT_GRACE_S", 2.0)
    assert math_reward("\\boxed{2}", "2", timeout_s=5) == 1.0  # the pool recovers

    # Soft timeout in process, main thread: a Python-level loop is interrupted.
    def spin(completion, ground_truth, truncated=False):
        while True:
            pass

    monkeypatch.setattr(verifiers, "_verdict_unbounded", spin)
    start = time.monotonic()
    assert math_verdict("\\boxed{1}", "1", timeout_s=0.2, in_process=True).reason == "timeout"
    assert time.monotonic() - start < 2.0
    assert verifier_counts()["timeout"] == 3


def test_score_batch_matches_score(rg_source):
    examples = rg_source.train_batch(0, 6)
    completions = [e.answer for e in examples[:3]] + ["0", "", "x"]
    assert rg_source.score_batch(completions, examples) == [
        rg_source.score(c, e) for c, e in zip(completions, examples)]
    source = make_source(_math_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.jsonl")))
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
