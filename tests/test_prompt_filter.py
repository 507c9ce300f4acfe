"""pdm_jax.data.filter_long_prompts: over-long prompts dropped and counted at load (issue 15).

Real pieces: the character tokenizer written to tmp_path, the run's TextCodec, reasoning-gym
chain_sum. With one character per token, a prompt's token count is its length: the tests use
that as the independent reference.
"""

from pathlib import Path

import pytest

from pdm_jax.data import COMPACT_ALPHABET, LengthFilteredSource, PromptSource, filter_long_prompts, make_source
from pdm_jax.data import prompt_filter
from pdm_jax.models.tokenizer import build_char_tokenizer
from pdm_jax.text import TextCodec
from conftest import data_spec

FIXTURES = Path(__file__).parent / "data" / "fixtures"


def _chain_sum(max_terms, num_eval=64, seed=0):
    return make_source(data_spec(dict(
        kind="reasoning_gym", task="chain_sum", prompt_format="compact", num_eval=num_eval, seed=seed,
        task_config=dict(min_terms=2, max_terms=max_terms, min_digits=1, max_digits=2))))


@pytest.fixture(scope="module")
def encode(tmp_path_factory):
    tokenizer = build_char_tokenizer(COMPACT_ALPHABET, tmp_path_factory.mktemp("tok"))
    return TextCodec(tokenizer, chat=False).encode_prompt


def test_issue_case_up_to_five_terms_with_max_prompt_length_10(encode):
    """chain_sum with 2-5 terms and sampler.max_prompt_length=10: before, the first over-long prompt
    killed the run at the warm-start evaluation. Now every prompt handed out fits, and the drops are counted."""
    source = _chain_sum(max_terms=5)
    assert len(encode("57+87=")) == 6 and len(encode("12+34+56=")) == 9  # one token per character
    filtered = filter_long_prompts(source, encode, 10)
    assert isinstance(filtered, PromptSource) and isinstance(filtered, LengthFilteredSource)
    long_eval = [e for e in source.eval_examples() if len(e.prompt) > 10]
    assert filtered.num_eval_dropped == len(long_eval) > 0
    assert filtered.eval_examples() == [e for e in source.eval_examples() if len(e.prompt) <= 10]
    scan = [source.train_example(i) for i in range(prompt_filter.SCAN_SIZE)]
    assert filtered.train_scan_dropped == sum(len(e.prompt) > 10 for e in scan) > 0
    train = filtered.train_batch(0, 200)
    assert all(len(encode(e.prompt)) <= 10 for e in train + filtered.eval_examples())
    skipped = 0
    for i, example in enumerate(train):  # a fitting position is the source's own; a long one is probed
        if len(scan[i].prompt) <= 10:
            assert example == scan[i]
        else:
            k = 1
            while len(source.train_example(i + k * prompt_filter.PROBE_STRIDE).prompt) > 10:
                k += 1
            assert example == source.train_example(i + k * prompt_filter.PROBE_STRIDE)
            skipped += k  # positions i, i + stride, ..., i + (k - 1) stride were too long
    assert filtered.num_train_dropped == skipped > 0  # counted as the stream is read
    # deterministic: a fresh source and wrapper give the same examples at the same positions
    again = filter_long_prompts(_chain_sum(max_terms=5), encode, 10)
    assert again.train_batch(150, 50) == train[150:]
    summary = filtered.summary()
    assert summary["max_prompt_length"] == 10 and summary["num_eval_dropped"] == len(long_eval)
    assert summary["longest_prompt"] > 10
    assert "sampler.max_prompt_length = 10" in filtered.describe()


def test_nothing_too_long_is_the_identity(encode):
    """The default run's data (2-term chain_sum, max_prompt_length 64): exactly the same examples, same order."""
    source = _chain_sum(max_terms=2, num_eval=256)
    filtered = filter_long_prompts(source, encode, 64)
    assert filtered.train_batch(0, 600) == source.train_batch(0, 600)
    assert filtered.train_batch(123_456, 5) == source.train_batch(123_456, 5)
    assert filtered.eval_examples() == source.eval_examples()
    assert (filtered.num_eval_dropped, filtered.train_scan_dropped, filtered.num_train_dropped) == (0, 0, 0)
    # everything else is the source's
    example = source.eval_examples()[0]
    assert (filtered.name, filtered.chat) == (source.name, source.chat)
    assert filtered.sft_target(example) == source.sft_target(example) == example.answer
    assert filtered.score(example.answer, example) == 1.0
    assert filtered.score(example.answer + "x", example, truncated=True) == 1.0
    assert filtered.score_batch([example.answer, "0"], [example, example]) == [1.0, 0.0]
    assert filtered.score_failures == 0 and filtered.prompt_format == "compact"


def test_every_prompt_too_long_fails_at_start_naming_the_field(encode):
    source = _chain_sum(max_terms=2)  # the shortest prompt is "1+2=": 4 tokens
    with pytest.raises(ValueError, match=r"sampler\.max_prompt_length = 3 tokens"):
        filter_long_prompts(source, encode, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10", None])
def test_bad_max_prompt_length(encode, bad):
    with pytest.raises(ValueError, match=r"sampler\.max_prompt_length must be an int >= 1"):
        filter_long_prompts(_chain_sum(max_terms=2, num_eval=4), encode, bad)


def test_math_source_with_a_word_count_encoder():
    """Any source and any encoder: GSM8K rows, "tokens" = words; the held-out set keeps its order."""
    source = make_source(data_spec(dict(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"),
                                                        num_eval=2, seed=0)))
    words = lambda text: text.split()  # noqa: E731
    lengths = sorted(len(words(e.prompt)) for e in source.train_batch(0, source.num_train) + source.eval_examples())
    limit = lengths[len(lengths) // 2]  # about half the prompts fit
    filtered = filter_long_prompts(source, words, limit)
    assert filtered.eval_examples() == [e for e in source.eval_examples() if len(words(e.prompt)) <= limit]
    assert all(len(words(e.prompt)) <= limit for e in filtered.train_batch(0, 40))
    assert filtered.num_eval_total == 2 and filtered.num_train_dropped > 0
