"""Tokenizers in Hugging Face format: character-level and task-trained BPE tokenizers for tiny tasks, local loading.

Everything here goes through the `tokenizers` library (the Rust backend) and
`transformers` (``PreTrainedTokenizerFast`` / ``AutoTokenizer``), so a directory
written by :func:`build_char_tokenizer` is an ordinary Hugging Face tokenizer
directory (``tokenizer.json`` + ``tokenizer_config.json``) that any
``AutoTokenizer.from_pretrained(dir)`` loads offline.

The real Qwen3 tokenizer is built by :mod:`pdm_jax.models.build_qwen3_tokenizer`.

Public API:
  * :func:`build_char_tokenizer` -- character-level tokenizer (one token per symbol).
  * :func:`build_bpe_tokenizer` -- byte-pair encoding trained on a corpus (e.g. a task's text).
  * :func:`shared_tokenizer` -- a built tokenizer in a directory several processes share
    (built once, published whole).
  * :func:`encode_strict` -- encode text, raising ``ValueError`` on characters the
    tokenizer cannot represent (never a silent unknown token).
  * :func:`load_tokenizer` -- ``AutoTokenizer`` from a local directory only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["TOKENIZER_FILES", "build_bpe_tokenizer", "build_char_tokenizer", "checkpoint_tokenizer_file", "encode_strict",
           "load_tokenizer", "shared_tokenizer"]

# Files whose presence marks a directory as a Hugging Face tokenizer directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# Never present in a char vocabulary (it is two characters long), so the WordLevel
# model raises instead of emitting an unknown id if ``tokenizer(text)`` is called
# on an unrepresentable character without going through :func:`encode_strict`.
_ABSENT_UNK = "<unk-not-in-vocab>"


def _describe_char(ch: str) -> str:
    name = unicodedata.name(ch, "unnamed")
    return f"{ch!r} (U+{ord(ch):04X} {name})"


CHAR_SPECIAL_TOKENS = 2  # <pad> = 0, <eos> = 1 (build_char_tokenizer's defaults, no bos)


def char_vocab_size(symbols: str) -> int:
    """The vocabulary size ``build_char_tokenizer(symbols, ...)`` gives with its default special tokens.

    Raises:
      ValueError: ``symbols`` empty, not a string, or with a repeated character (field ``tokenizer.symbols``).
    """
    if not isinstance(symbols, str) or not symbols or len(set(symbols)) != len(symbols):
        raise ValueError(f"tokenizer.symbols = {symbols!r}: must be a non-empty string of distinct characters")
    return len(symbols) + CHAR_SPECIAL_TOKENS


def build_char_tokenizer(
    symbols: str,
    out_dir: str | os.PathLike[str],
    *,
    pad_token: str = "<pad>",
    eos_token: str = "<eos>",
    bos_token: str | None = None,
) -> PreTrainedTokenizerFast:
    """Builds and saves a character-level tokenizer in Hugging Face format.

    Vocabulary layout (ids are ``int32``-safe small integers):
      * ``pad_token`` -> 0, ``eos_token`` -> 1, ``bos_token`` -> 2 when given,
      * then ``symbols[i]`` -> ``num_special + i`` in the order given.

    Each symbol is exactly one token: the backend is a ``tokenizers`` ``WordLevel``
    model over single characters behind a ``Split`` pre-tokenizer that isolates every
    character (``[\\s\\S]``, so spaces and newlines are symbols like any other), and
    a ``Fuse`` decoder that concatenates tokens with no separator, so
    ``decode(encode(x)) == x`` for every string over ``symbols``. No special token is
    added automatically (no post-processor); callers append ``eos`` explicitly, e.g.
    with :func:`encode_strict` ``(add_eos=True)``. There is no chat template.

    The directory gets ``tokenizer.json`` and ``tokenizer_config.json``
    (``tokenizer_class: PreTrainedTokenizerFast``), loadable offline with
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` or :func:`load_tokenizer`.

    Args:
      symbols: the characters of the vocabulary, each exactly once, e.g.
        ``"0123456789+-= "``.
      out_dir: directory to write (created if missing; existing tokenizer files
        are overwritten).
      pad_token, eos_token: special tokens with ids 0 and 1 (multi-character strings
        are recommended, so they can never collide with a symbol).
      bos_token: optional special token with id 2.

    Returns:
      The tokenizer, as reloaded from ``out_dir`` (so the caller holds exactly what
      a later ``from_pretrained`` returns).

    Raises:
      ValueError: ``symbols`` empty or with a repeated character; a special token
        empty, repeated, or equal to one of the symbols.
    """
    if not isinstance(symbols, str) or not symbols:
        raise ValueError(f"symbols must be a non-empty string, got {symbols!r}")
    seen: set[str] = set()
    for i, ch in enumerate(symbols):
        if ch in seen:
            raise ValueError(f"symbols has a repeated character {_describe_char(ch)} at position {i}")
        seen.add(ch)
    specials = [("pad_token", pad_token), ("eos_token", eos_token)]
    if bos_token is not None:
        specials.append(("bos_token", bos_token))
    special_values: set[str] = set()
    for field, value in specials:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{field} must be a non-empty string, got {value!r}")
        if value in special_values:
            raise ValueError(f"{field}={value!r} repeats another special token")
        if value in seen:
            raise ValueError(f"{field}={value!r} is also one of the symbols")
        special_values.add(value)

    vocab = {value: i for i, (_, value) in enumerate(specials)}
    for ch in symbols:
        vocab[ch] = len(vocab)

    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=_ABSENT_UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Registers the specials as added tokens at their existing ids (0, 1, 2).
    backend.add_special_tokens([tokenizers.AddedToken(v, special=True, normalized=False) for _, v in specials])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        **{field: value for field, value in specials},
    )
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_path))
    _public_tokenizer_class(out_path)
    reloaded = load_tokenizer(out_path)
    got = {value: reloaded.convert_tokens_to_ids(value) for value in vocab}
    if got != vocab:  # guards the contract against a transformers behaviour change
        raise RuntimeError(f"saved char tokenizer in {out_path} reloads with ids {got}, expected {vocab}")
    return reloaded


#: The file beside a built tokenizer's that records what it was built from (`shared_tokenizer`'s ``recipe``).
RECIPE_FILE = "pdm_jax_tokenizer.json"


def shared_tokenizer(out_dir: str | os.PathLike[str], build: Callable[[Path], object],
                     recipe: dict | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer in ``out_dir``, written there by ``build`` first when absent; safe for processes sharing it.

    The processes of a multi-process run (one per host, or several on one host) share the workdir and
    each may find ``out_dir`` missing. Each one that does calls ``build`` on a private sibling directory
    and renames it onto ``out_dir``; a directory rename is atomic, so a reader sees either no
    ``out_dir`` or a complete one (building straight into ``out_dir`` let another process read a
    half-written ``tokenizer.json``). The first rename wins; a loser discards its copy, so ``build``
    must be deterministic (the char and BPE builders are: same inputs, same files).

    ``recipe`` (JSON-able: what the tokenizer is built from, e.g. ``{"kind": "bpe", "vocab_size": 1024,
    ...}``) is saved beside it as ``RECIPE_FILE`` with the list of its ``files``. A run that finds
    ``out_dir`` built from another recipe (a resume with another ``tokenizer.vocab_size``, or a workdir an
    earlier run with another config left) is refused: a run's tokenizer cannot change under its
    checkpoints. A directory without the file (built before it existed) is checked for its kind only
    (a ``WordLevel`` model is ``char``, a ``BPE`` one ``bpe``).

    Args:
      out_dir: a local directory, e.g. ``WORKDIR/tokenizer``; its parent is created if missing.
      build: writes a tokenizer into the directory it is given, e.g.
        ``lambda d: build_char_tokenizer(symbols, d)``.
      recipe: what ``build`` builds from; None checks nothing.

    Returns:
      The tokenizer loaded from ``out_dir`` (:func:`load_tokenizer`).

    Raises:
      ValueError: what ``build`` raises (bad symbols, an empty corpus); ``out_dir`` built from another
        recipe (naming each differing field, both values and the directory); ``out_dir`` exists, is not
        empty and holds no ``tokenizer.json`` (left by something else: the message names it).
    """
    out = Path(out_dir).expanduser()
    recipe = None if recipe is None else json.loads(json.dumps(recipe, default=str))  # as it is read back
    if not (out / "tokenizer.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        # A private name made with a plain mkdir (the umask's mode, unlike mkdtemp's 0700), never an existing one.
        tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            build(tmp)
            if recipe is not None:
                files = sorted(p.name for p in tmp.iterdir())
                (tmp / RECIPE_FILE).write_text(json.dumps(dict(recipe, files=files), indent=2) + "\n")
            try:
                os.rename(tmp, out)  # onto a missing or empty directory; refused onto a non-empty one
            except OSError as e:
                if not (out / "tokenizer.json").is_file():  # not another process's tokenizer: something else
                    raise ValueError(f"tokenizer directory {str(out)!r} exists without a tokenizer.json and is "
                                     f"not empty ({type(e).__name__}: {e}); remove it to have it rebuilt") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; a loser's copy
    if recipe is not None:
        _check_recipe(out, recipe)
    return load_tokenizer(out)


def _check_recipe(out: Path, recipe: dict) -> None:
    """Refuses a tokenizer directory built from another recipe (see `shared_tokenizer`)."""
    path = out / RECIPE_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{str(path)!r} is not JSON ({e}); remove {str(out)!r} to have it rebuilt") from e
        keys = [k for k in recipe if saved.get(k) != recipe[k]]
    else:  # built before recipes were saved: its kind is all there is to check
        model = json.loads((out / "tokenizer.json").read_text(encoding="utf-8")).get("model", {}).get("type")
        saved = {"kind": {"WordLevel": "char", "BPE": "bpe"}.get(model, model)}
        keys = ["kind"] if "kind" in recipe and saved["kind"] != recipe["kind"] else []
    if keys:
        diff = "; ".join(f"{k}: built with {saved.get(k)!r}, the config has {recipe[k]!r}" for k in keys)
        raise ValueError(f"the tokenizer in {str(out)!r} was built from another config ({diff}): a run keeps the "
                         "tokenizer its checkpoints were trained with; restore those values, or use a new workdir "
                         "(or remove that directory if nothing was trained with it)")


BPE_SPECIAL_TOKENS = ("<pad>", "<eos>")  # ids 0, 1 of build_bpe_tokenizer
#: Byte-level BPE: every one of the 256 bytes has a token, so any text encodes (no unknown token).
BPE_ALPHABET_SIZE = 256
#: The largest ``tokenizer.vocab_size`` accepted (Qwen3's is 151,669; the trainer reserves memory for it up front).
MAX_BPE_VOCAB_SIZE = 1 << 20


def build_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
) -> PreTrainedTokenizerFast:
    """Trains a byte-level byte-pair-encoding tokenizer on ``texts`` and saves it in Hugging Face format.

    As GPT-2's and Qwen's tokenizers, it works on the UTF-8 bytes of the text (``tokenizers``'
    ``ByteLevel`` pre-tokenizer and decoder): each of the 256 bytes has a token, so every string
    encodes and ``decode(encode(x)) == x`` for any ``x``; there is no unknown token. Unlike theirs,
    no regex splits the text into words first (``use_regex=False``), so merges may span any
    character, and each text stays apart from the others (e.g. a prompt and its answer: no token
    crosses between them). The ``tokenizers`` library's ``BpeTrainer`` learns merges of pairs that
    occur at least twice until the vocabulary has ``vocab_size`` entries. Ids: ``<pad>`` 0,
    ``<eos>`` 1, then the 256 bytes, then the merges in the order learnt. No chat template.
    Training is deterministic: the same texts give the same files.

    Args:
      texts: the corpus, e.g. a task's training prompts and reference answers (each a string).
      out_dir: directory to write (created if missing).
      vocab_size: the most entries, the 2 special tokens and the 256 bytes included (field
        ``tokenizer.vocab_size``), at most ``MAX_BPE_VOCAB_SIZE``.

    Returns:
      The tokenizer, as reloaded from ``out_dir``; ``len(tokenizer)`` may be below ``vocab_size``
      when the corpus has too few repeated pairs.

    Raises:
      ValueError: ``vocab_size`` not an int in (258, ``MAX_BPE_VOCAB_SIZE``]; ``texts`` empty or
        holding a non-string.
    """
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        bad = next((t for t in texts if not isinstance(t, str)), None)
        raise ValueError(f"the BPE corpus must be a non-empty list of strings, got {len(texts)} texts"
                         + (f" including {bad!r}" if texts else ""))
    least = len(BPE_SPECIAL_TOKENS) + BPE_ALPHABET_SIZE
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not least < vocab_size <= MAX_BPE_VOCAB_SIZE:
        raise ValueError(f"tokenizer.vocab_size = {vocab_size!r}: must be an int above the {len(BPE_SPECIAL_TOKENS)} "
                         f"special tokens + the {BPE_ALPHABET_SIZE} bytes ({least}) and at most {MAX_BPE_VOCAB_SIZE}")
    pad, eos = BPE_SPECIAL_TOKENS
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                        model_max_length=1 << 20, pad_token=pad, eos_token=eos)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_path))
    _public_tokenizer_class(out_path)
    reloaded = load_tokenizer(out_path)
    got = [reloaded.convert_tokens_to_ids(t) for t in BPE_SPECIAL_TOKENS]
    if got != [0, 1]:  # guards the contract against a tokenizers / transformers behaviour change
        raise RuntimeError(f"saved BPE tokenizer in {out_path} reloads with special ids {got}, expected [0, 1]")
    return reloaded


def _public_tokenizer_class(out_path: Path) -> None:
    """transformers 5 writes its internal class name "TokenizersBackend"; the public alias also loads in
    transformers 4 and in other consumers of the HF layout."""
    config_path = out_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _char_vocab(tokenizer: PreTrainedTokenizerBase) -> dict[str, int] | None:
    """The symbol -> id map of a char-level (WordLevel) tokenizer, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, models.WordLevel):
        return None
    specials = set(tokenizer.all_special_tokens)
    return {tok: i for tok, i in tokenizer.get_vocab().items() if len(tok) == 1 and tok not in specials}


def encode_strict(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    add_bos: bool = False,
    add_eos: bool = False,
) -> list[int]:
    """Encodes ``text`` exactly, refusing characters the tokenizer cannot represent.

    For a char-level tokenizer (from :func:`build_char_tokenizer`) every character of
    ``text`` must be one of its symbols and maps to that symbol's id; special-token
    strings inside ``text`` are NOT interpreted (``"<eos>"`` is five characters, all
    of which must be symbols). For any other tokenizer the text is encoded without
    automatic special tokens (a special-token string inside the text, e.g. ``"<eos>"`` for a
    :func:`build_bpe_tokenizer` one, is read as that token, as Hugging Face tokenizers do) and an
    output containing the unknown-token id is refused.

    Args:
      tokenizer: a Hugging Face tokenizer.
      text: the string to encode.
      add_bos: prepend ``tokenizer.bos_token_id`` (error if the tokenizer has none).
      add_eos: append ``tokenizer.eos_token_id`` (error if the tokenizer has none).

    Returns:
      Token ids, a ``list[int]`` of length ``len(text) + add_bos + add_eos`` for a
      char-level tokenizer.

    Raises:
      ValueError: a character not in the vocabulary (the message names the
        character, its code point and its position), an unknown-token id in the
        output, or ``add_bos``/``add_eos`` on a tokenizer without that token.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    char_vocab = _char_vocab(tokenizer)
    if char_vocab is not None:
        ids = []
        for i, ch in enumerate(text):
            tok_id = char_vocab.get(ch)
            if tok_id is None:
                raise ValueError(
                    f"character {_describe_char(ch)} at position {i} of text {text!r} is not in the "
                    f"tokenizer vocabulary (symbols: {''.join(sorted(char_vocab, key=char_vocab.get))!r})"
                )
            ids.append(tok_id)
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        unk = tokenizer.unk_token_id
        if unk is not None and unk in ids:
            pos = ids.index(unk)
            raise ValueError(f"text {text!r} encodes to the unknown token {tokenizer.unk_token!r} at token {pos}")
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token")
        ids.insert(0, tokenizer.bos_token_id)
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token")
        ids.append(tokenizer.eos_token_id)
    return ids


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Loads a Hugging Face tokenizer from a LOCAL directory (never the Hub).

    Args:
      path: a directory holding ``tokenizer.json`` and/or ``tokenizer_config.json``
        (e.g. one written by :func:`build_char_tokenizer`,
        :func:`pdm_jax.models.build_qwen3_tokenizer.build_qwen3_tokenizer`, or a
        downloaded checkpoint directory).

    Returns:
      ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``.

    Raises:
      FileNotFoundError: ``path`` does not exist, is not a directory, or holds no
        tokenizer file; the message names the path.
      ValueError: transformers failed to load the directory (wraps its error and
        names the path).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist")
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} is not a directory")
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} holds none of {', '.join(_TOKENIZER_FILES)}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path named
        raise ValueError(f"could not load a tokenizer from {str(p)!r}: {type(e).__name__}: {e}") from e


#: Files whose presence in a Hugging Face checkpoint directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def checkpoint_tokenizer_file(hf_path: str) -> str | None:
    """The first of `TOKENIZER_FILES` in the local checkpoint directory `hf_path`, or None (no such file, no
    directory, or ``hf_path`` empty)."""
    if not hf_path or not os.path.isdir(hf_path):
        return None
    return next((f for f in TOKENIZER_FILES if os.path.exists(os.path.join(hf_path, f))), None)
