"""pdm_jax.data.verifiers: final-answer extraction and the math-verify verifier.

Answer extraction from real model response forms (issue 15): precedence, markdown, math, truncation.
Each case is a response form with its right answer (or the right "no credit"), checked on
`verifiers.find_final_answer` and on the math verifier's reward (the reasoning-gym question-format scorer
and the unchanged compact format: tests/test_data_tasks.py). Then math-verify itself: equivalences,
verdict reasons and counts, calls from threads, soft and hard timeouts.
"""

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdm_jax.data import verifiers
from pdm_jax.data.tasks import extract_tagged_answer
from pdm_jax.data.verifiers import (
    ABSENT,
    FOUND,
    TRUNCATED,
    Extraction,
    MathVerdict,
    extract_final_answer,
    find_final_answer,
    math_reward,
    math_verdict,
    reset_verifier_counts,
    verifier_counts,
)

# (completion, truncated, answer, status, marker)
FORMS = [
    # the two reported cases
    ("Answer: **73**", False, "73", FOUND, "answer_line"),
    ("#### Step 1: add\n2+3=5\n\nAnswer: 5", False, "5", FOUND, "answer_line"),
    # markdown emphasis on the marker or the answer
    ("**Answer:** 42", False, "42", FOUND, "answer_line"),
    ("**Answer**: 42", False, "42", FOUND, "answer_line"),
    ("*Final answer:* __42__", False, "42", FOUND, "answer_line"),
    ("Answer: *5*", False, "5", FOUND, "answer_line"),
    ("Answer: `5`", False, "5", FOUND, "answer_line"),
    # headings: an answer heading introduces the next line; other #### lines are headings, not answers
    ("## Final Answer\n\n17", False, "17", FOUND, "answer_line"),
    ("**Final Answer**\n5", False, "5", FOUND, "answer_line"),
    ("### Step 1\n#### 5\n#### Step 2: check the sum", False, "5", FOUND, "hash_line"),
    ("#### Step 1: add", False, None, ABSENT, None),
    # display and inline math around the answer
    ("Answer: $\\frac{3}{4}$.", False, "\\frac{3}{4}", FOUND, "answer_line"),
    ("Answer: $$5$$", False, "5", FOUND, "answer_line"),
    ("Answer: \\(7\\)", False, "7", FOUND, "answer_line"),
    ("Answer:\n\\[ \\frac{1}{2} \\]", False, "\\frac{1}{2}", FOUND, "answer_line"),
    ("## Final Answer\n$$\n17\n$$\nDone.", False, "17", FOUND, "answer_line"),
    ("**Final Answer:** The total is $42$ dollars.", False, "42", FOUND, "answer_line"),
    ("Answer: $1,250", False, "1,250", FOUND, "answer_line"),  # a currency sign, not math
    ("so the result is $\\boxed{12}$.", False, "12", FOUND, "boxed"),
    ("\\[\\boxed{\\frac{a}{b^{2}}}\\]", False, "\\frac{a}{b^{2}}", FOUND, "boxed"),
    # several candidate markers: the later of the last box and the last Answer: line wins; the last Answer: line
    # over ####
    ("\\boxed{3} and then\nAnswer: 4", False, "4", FOUND, "answer_line"),  # the later final answer wins (issue 31)
    ("\\boxed{1} then \\boxed{2}", False, "2", FOUND, "boxed"),
    ("#### 72\nAnswer: 73", False, "73", FOUND, "answer_line"),
    ("Answer: 5\nchecking...\nAnswer: 6", False, "6", FOUND, "answer_line"),
    ("work\n#### 1,234\n", False, "1,234", FOUND, "hash_line"),
    ("#### 3\n#### 4", False, "4", FOUND, "hash_line"),
    # cut off in the middle of the final answer: no credit, and no fallback to an earlier candidate
    ("\\boxed{3} is wrong, so \\boxed{12", False, None, TRUNCATED, "boxed"),
    ("Answer: $\\frac{1}{2", False, None, TRUNCATED, "answer_line"),
    ("Answer:\n$$\n\\frac{1}{", False, None, TRUNCATED, "answer_line"),
    ("Answer: 12", True, None, TRUNCATED, "answer_line"),  # stopped by max_tokens: "125" may follow
    ("#### 72", True, None, TRUNCATED, "hash_line"),
    ("\\boxed 12", True, None, TRUNCATED, "boxed"),
    ("Answer:", True, None, TRUNCATED, "answer_line"),
    # ... but an answer that ended before the cut still counts
    ("Answer: 12\nLet me double-check: 5+7=", True, "12", FOUND, "answer_line"),
    ("Answer: $12$", True, "12", FOUND, "answer_line"),  # its closing $ ends it
    ("\\boxed{12} and more tex", True, "12", FOUND, "boxed"),
    ("Answer: 12", False, "12", FOUND, "answer_line"),  # stopped by its stop token: complete
    # nothing to extract
    ("I think it is 7", False, None, ABSENT, None),
    ("", False, None, ABSENT, None),
    (None, False, None, ABSENT, None),
]


@pytest.mark.parametrize("text, truncated, answer, status, marker", FORMS)
def test_find_final_answer_forms(text, truncated, answer, status, marker):
    assert find_final_answer(text, truncated=truncated) == Extraction(answer, status, marker)


# (completion, truncated, gold, reward, reason) through math-verify
REWARDS = [
    ("Answer: **73**", False, "73", 1.0, "correct"),
    ("#### Step 1: add\n2+3=5\n\nAnswer: 5", False, "5", 1.0, "correct"),
    ("**Final Answer:** The total is $42$ dollars.", False, "42", 1.0, "correct"),
    ("Answer:\n\\[ \\frac{1}{2} \\]", False, "0.5", 1.0, "correct"),
    ("#### $1,250", False, "1250", 1.0, "correct"),
    ("#### 72\nAnswer: 73", False, "72", 0.0, "wrong"),
    ("\\boxed{5} so far, final: \\boxed{12", False, "5", 0.0, "truncated"),
    ("Answer: 12", True, "125", 0.0, "truncated"),
    ("Answer: 12", True, "12", 0.0, "truncated"),  # even when it happens to match: the number may be cut
    ("Answer: 12\nLet me check", True, "12", 1.0, "correct"),
]


@pytest.mark.parametrize("completion, truncated, gold, reward, reason", REWARDS)
def test_math_verdict_of_response_forms(completion, truncated, gold, reward, reason):
    verdict = math_verdict(completion, gold, in_process=True, truncated=truncated, timeout_s=60)
    assert (verdict.reward, verdict.reason) == (reward, reason)


def test_truncated_flag_reaches_the_worker_process():
    """The default (pool) path carries `truncated` over the worker's JSON protocol."""
    assert math_verdict("Answer: 12", "12", truncated=True, timeout_s=60) == MathVerdict(0.0, "truncated", None)
    assert math_reward("Answer: 12", "12", truncated=False, timeout_s=60) == 1.0


PIECES = ["Answer", "answer:", "Final", "**", "*", "_", "__", "`", "$", "$$", "\\(", "\\)", "\\[", "\\]", "\\boxed",
          "{", "}", "####", "#", "\n", " ", "\t", "12", "-3", "1,234", ".", ":", "<answer>", "</answer>", "x", "é"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.booleans())
def test_extraction_never_raises_and_is_consistent(pieces, truncated):
    text = "".join(pieces)
    found = find_final_answer(text, truncated=truncated)
    assert found.status in (FOUND, ABSENT, TRUNCATED)
    assert (found.answer is not None) == (found.status == FOUND)
    assert isinstance(extract_tagged_answer(text, truncated=truncated), str)
    if found.status == FOUND and not truncated:  # the flag only ever takes credit away
        assert find_final_answer(text, truncated=True).answer in (found.answer, None)


@pytest.mark.parametrize("text", [
    " " * 20000 + "x", "## " + " \t" * 10000 + "Final", "Answer: " + "\\(" * 5000, "Answer: x" + " $a" * 5000,
    "<answer>" * 5000, "\\boxed{" * 5000, "final " * 5000, ("Answer:\n" + " " * 100) * 200, "#### " + "1," * 10000])
def test_extraction_is_fast_on_pathological_inputs(text):
    """Linear-time extraction: no regex backtracking blow-up (a heading regex took 38 s on 20,000 spaces)."""
    start = time.perf_counter()
    find_final_answer(text, truncated=True)
    extract_tagged_answer(text)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text, truncated, answer, status, marker", [
    ("scratch \\boxed{3}. So\nAnswer: 5", False, "5", "found", "answer_line"),  # the later final answer wins
    ("Answer: \\boxed{5}", False, "5", "found", "boxed"),
    ("<think>try \\boxed{3}</think>So the answer: \\boxed{5}", False, "5", "found", "boxed"),
    ("<think>try \\boxed{3}</think>Answer: 5", False, "5", "found", "answer_line"),
    ("<think>a box in the reasoning \\boxed{5}", False, None, "absent", "think"),  # never closed: no answer
    ("<think>a box in the reasoning \\boxed{5}", True, None, "truncated", "think"),
    ("\\[Answer: 5\\]", False, "5", "found", "answer_line"),  # the display block's closer is not the answer
    ("\\[\\text{Answer: } 5\\]", False, "5", "found", "answer_line"),
    ("$$Answer: \\frac{1}{2}$$", False, "\\frac{1}{2}", "found", "answer_line"),
])
def test_reasoning_and_the_later_final_answer(text, truncated, answer, status, marker):
    got = find_final_answer(text, truncated=truncated)
    assert (got.answer, got.status, got.marker) == (answer, status, marker)


@pytest.mark.parametrize("pred, gold, reward", [
    ("\\frac{1}{2006!}", "\\frac{1}{2004!}", 0.0),  # equal to 1e-16 in floats; not equal
    ("\\frac{1}{2^{98}}", "\\frac{1}{2^{99}}", 0.0),
    ("\\frac{1}{2^{99}}", "\\frac{1}{2^{99}}", 1.0),
    ("\\frac{2}{4}", "\\frac{1}{2}", 1.0),
    ("2^{10}", "1024", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),  # a decimal stays with math-verify's comparison
    ("x+1", "1+x", 1.0),  # symbols too
])
def test_exact_numbers_are_compared_exactly(pred, gold, reward):
    assert math_verdict(f"Answer: ${pred}$", gold, in_process=True, timeout_s=60).reward == reward


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
