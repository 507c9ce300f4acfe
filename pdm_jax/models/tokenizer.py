"""Tokenizers in Hugging Face format: character-level and task-trained BPE tokenizers for tiny tasks, local loading.

Built with the `tokenizers` library and saved as ordinary Hugging Face tokenizer directories (``tokenizer.json`` +
``tokenizer_config.json``) that ``AutoTokenizer.from_pretrained(dir)`` loads offline; :func:`encode_strict` refuses
what a tokenizer cannot represent (never a silent unknown token). The real Qwen3 tokenizer is built by
:mod:`pdm_jax.models.build_qwen3_tokenizer`."""

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

__all__ = ["TOKENIZER_FILES", "build_bpe_tokenizer", "build_char_tokenizer", "checkpoint_tokenizer_file",
           "encode_strict", "load_tokenizer", "shared_tokenizer"]

# Files whose presence marks a directory as a Hugging Face tokenizer directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# Never in a char vocabulary, so the WordLevel model raises on an unrepresentable character instead of an unknown id.
_ABSENT_UNK = "<unk-not-in-vocab>"


def _describe_char(ch: str) -> str:
    name = unicodedata.name(ch, "unnamed")
    return f"{ch!r} (U+{ord(ch):04X} {name})"


CHAR_SPECIAL_TOKENS = 2  # <pad> = 0, <eos> = 1 (build_char_tokenizer's defaults, no bos)


def char_vocab_size(symbols: str) -> int:
    """The vocabulary size ``build_char_tokenizer(symbols, ...)`` gives with its default special tokens; ValueError
    (field ``tokenizer.symbols``) for ``symbols`` empty, not a string, or with a repeated character."""
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

    Ids: ``pad_token`` 0, ``eos_token`` 1, ``bos_token`` 2 when given, then ``symbols[i]`` -> ``num_special + i``.
    Each symbol (spaces and newlines included) is one token of a ``WordLevel`` model behind a per-character
    ``Split``, decoded by ``Fuse``, so ``decode(encode(x)) == x`` over ``symbols``. No special token is added
    automatically (append ``eos`` with :func:`encode_strict` ``(add_eos=True)``); no chat template.

    Args:
      symbols: the characters of the vocabulary, each once, e.g. ``"0123456789+-= "``.
      out_dir: directory to write (created if missing; tokenizer files overwritten).
      pad_token, eos_token: special tokens with ids 0 and 1 (multi-character strings never collide with a symbol).
      bos_token: optional special token with id 2.

    Returns:
      The tokenizer as reloaded from ``out_dir``.

    Raises:
      ValueError: ``symbols`` empty or with a repeated character; a special token empty, repeated, or equal to a
        symbol."""
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
    """The tokenizer in ``out_dir``, built there by ``build`` first when absent; safe for processes sharing it.

    A process that finds ``out_dir`` missing builds into a private sibling and renames it onto ``out_dir`` (atomic: a
    reader sees no directory or a complete one); the first rename wins, so ``build`` must be deterministic.
    ``recipe`` (JSON-able, e.g. ``{"kind": "bpe", "vocab_size": 1024, ...}``) is saved beside it as ``RECIPE_FILE``;
    a directory built from another recipe is refused (a run's tokenizer cannot change under its checkpoints), one
    without the file is checked for its kind only.

    Args:
      out_dir: a local directory, e.g. ``WORKDIR/tokenizer``; its parent is created if missing.
      build: writes a tokenizer into the directory it is given, e.g. ``lambda d: build_char_tokenizer(symbols, d)``.
      recipe: what ``build`` builds from; None checks nothing.

    Returns:
      The tokenizer loaded from ``out_dir`` (:func:`load_tokenizer`).

    Raises:
      ValueError: what ``build`` raises; ``out_dir`` built from another recipe (naming each differing field, both
        values and the directory); ``out_dir`` not empty and without ``tokenizer.json``."""
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

    As GPT-2's and Qwen's, it works on UTF-8 bytes (``ByteLevel``), so ``decode(encode(x)) == x`` for any ``x`` and
    there is no unknown token; unlike theirs no regex pre-splits words (``use_regex=False``) and texts stay apart
    from each other. ``BpeTrainer`` learns merges of pairs seen at least twice. Ids: ``<pad>`` 0, ``<eos>`` 1, the
    256 bytes, then the merges in order. Deterministic: the same texts give the same files. No chat template.

    Args:
      texts: the corpus (strings), e.g. a task's prompts and reference answers.
      out_dir: directory to write (created if missing).
      vocab_size: the most entries, specials and bytes included (field ``tokenizer.vocab_size``), at most
        ``MAX_BPE_VOCAB_SIZE``.

    Returns:
      The tokenizer as reloaded from ``out_dir``; ``len(tokenizer)`` may be below ``vocab_size`` for a small corpus.

    Raises:
      ValueError: ``vocab_size`` not an int in (258, ``MAX_BPE_VOCAB_SIZE``]; ``texts`` empty or holding a
        non-string."""
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
    """transformers 5 writes its internal class name "TokenizersBackend"; the public alias also loads in transformers 4
    and in other consumers of the HF layout."""
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

    Char-level tokenizer: every character must be a symbol (special-token strings in ``text`` are plain characters).
    Any other tokenizer: encoded without automatic special tokens (a special-token string in the text is that token,
    as in Hugging Face) and an output holding the unknown-token id is refused.

    Args:
      tokenizer: a Hugging Face tokenizer.
      text: the string to encode.
      add_bos / add_eos: prepend ``bos_token_id`` / append ``eos_token_id``.

    Returns:
      ``list[int]`` token ids (``len(text) + add_bos + add_eos`` of them for a char-level tokenizer).

    Raises:
      ValueError: a character not in the vocabulary (naming it, its code point and position), an unknown-token id in
        the output, or ``add_bos``/``add_eos`` on a tokenizer without that token."""
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
    """``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``: a tokenizer from a LOCAL directory.

    Raises:
      FileNotFoundError: ``path`` missing, not a directory, or without a tokenizer file (naming the path).
      ValueError: transformers failed to load it (wrapping its error, naming the path)."""
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
    """The first of `TOKENIZER_FILES` in the local checkpoint directory `hf_path`, or None (no such file, no directory,
    or ``hf_path`` empty)."""
    if not hf_path or not os.path.isdir(hf_path):
        return None
    return next((f for f in TOKENIZER_FILES if os.path.exists(os.path.join(hf_path, f))), None)
