"""`TextCodec`: prompts to token ids and completions back to text, for one tokenizer and prompt source.

The trainer, the evaluator and the supervised warm start all tokenize through it, so a chat source gets its chat
template everywhere and completions are decoded the same way for rewards and for evaluation.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Optional

import numpy as np

from pdm_jax import workdir as wd
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.rollout import left_pad, right_pad_rows, round_up

log = logging.getLogger(__name__)

#: The warm start's prompt width is the batch's longest prompt rounded up to a multiple of this (tokens).
SFT_PROMPT_MULTIPLE = 8


#: The `DataSpec` fields that decide the training prompts' text, so a BPE trained on them.
CORPUS_FIELDS = ("kind", "task", "task_config", "prompt_format", "path", "num_eval", "seed", "train_size",
                 "instruction")
#: The columns a ``data.kind = "file"`` corpus is read from (part of its recipe; the other kinds' recipes lack them).
FILE_CORPUS_FIELDS = ("prompt_field", "answer_field")


def run_tokenizer(tokenizer_config, workdir: str, source, *, data=None, upload: bool = True):
    """The run's tokenizer (`_run_tokenizer`), checked against the data source (`check_chat_template`).

    Raises:
      ValueError: as `_run_tokenizer` or `check_chat_template`, naming ``data.chat_template``."""
    tokenizer = _run_tokenizer(tokenizer_config, workdir, source, data=data, upload=upload)
    check_chat_template(tokenizer, source, tokenizer_config, data)
    return tokenizer


def check_chat_template(tokenizer, source, tokenizer_config, data=None) -> None:
    """Refuses a tokenizer without a chat template for a source whose prompts go through one (``source.chat``).

    Raises:
      ValueError: naming ``data.chat_template`` and ``data.kind`` with their values, the tokenizer, and the two ways
        on (raw prompt text, or a tokenizer with a chat template)."""
    if not getattr(source, "chat", False) or getattr(tokenizer, "chat_template", None):
        return
    tc = tokenizer_config
    named = f"tokenizer.kind = {tc.kind!r}" + (f", tokenizer.path = {tc.path!r}" if tc.kind == "path" else "")
    value = getattr(data, "chat_template", "auto")
    kind = f"data.kind = {getattr(data, 'kind', '?')!r}"
    raise ValueError(f"data.chat_template = {value!r}: {kind} formats each prompt with the tokenizer's chat "
                     f"template, and the tokenizer ({named}) has none: set data.chat_template=off (the raw prompt "
                     "text, as for a Base model) or use a tokenizer with a chat template (tokenizer.kind=path, e.g. "
                     "the checkpoint's own directory)")


def _run_tokenizer(tokenizer_config, workdir: str, source, *, data=None, upload: bool = True):
    """The run's tokenizer, per ``tokenizer.kind``: ``"char"`` (`build_char_tokenizer` over ``tokenizer.symbols``),
    ``"bpe"`` (`build_bpe_tokenizer` trained to ``tokenizer.vocab_size`` on the prompts and reference answers of the
    first ``tokenizer.corpus_prompts`` training examples) or ``"path"`` (the Hugging Face directory
    ``tokenizer.path``).

    A built tokenizer is written once into ``WORKDIR/tokenizer`` with its recipe and loaded from there on a resume
    (`shared_tokenizer`: a different recipe is refused); a bucket workdir's is built locally and uploaded by the
    process with ``upload``.

    Args:
      tokenizer_config: ``config.tokenizer``.
      workdir: the run directory (local or a bucket URL).
      source: the run's `PromptSource` (bpe: its corpus).
      data: the run's `DataSpec`; its `CORPUS_FIELDS` are part of a bpe tokenizer's recipe.
      upload: bucket workdir: upload a newly built tokenizer.

    Raises:
      ValueError: ``tokenizer.kind = "bpe"`` with a chat source (naming ``data.chat_template``); a workdir tokenizer
        built from another config (naming the fields); what the builder raises, naming the field."""
    # Deferred: models.tokenizer imports transformers and tokenizers (seconds), which TextCodec's users (evaluation, the
    # tests) do not need until a tokenizer is built or loaded.
    from pdm_jax.models.tokenizer import (RECIPE_FILE, build_bpe_tokenizer, build_char_tokenizer, load_tokenizer,
                                          shared_tokenizer)

    tc = tokenizer_config
    if tc.kind == "path":
        return load_tokenizer(tc.path)
    if tc.kind == "char":
        recipe = dict(kind="char", symbols=tc.symbols)

        def build(d):
            build_char_tokenizer(tc.symbols, d)
    else:
        if source.chat:
            raise ValueError("tokenizer.kind = 'bpe' trains a tokenizer without a chat template, and this data source "
                             "applies one: set data.chat_template=off or use tokenizer.kind=path")
        fields = CORPUS_FIELDS + (FILE_CORPUS_FIELDS if data is not None and data.kind == "file" else ())
        corpus = None if data is None else {f: getattr(data, f) for f in fields}
        recipe = dict(kind="bpe", vocab_size=int(tc.vocab_size), corpus_prompts=int(tc.corpus_prompts), data=corpus)

        def build(d):
            examples = source.train_batch(0, int(tc.corpus_prompts))
            texts = [e.prompt for e in examples] + [source.sft_target(e) for e in examples]
            tok = build_bpe_tokenizer(texts, d, vocab_size=int(tc.vocab_size))
            level = logging.WARNING if len(tok) < tc.vocab_size else logging.INFO
            log.log(level, "trained a BPE tokenizer of %d tokens (tokenizer.vocab_size %d) on %d texts (%d "
                    "training examples, tokenizer.corpus_prompts)", len(tok), tc.vocab_size, len(texts),
                    tc.corpus_prompts)
    if not wd.is_remote(workdir):
        return shared_tokenizer(os.path.join(workdir, "tokenizer"), build, recipe)
    # A bucket workdir: a local copy, from the bucket when an earlier start uploaded one, removed once the tokenizer is
    # loaded (it is held in memory) and uploaded.
    staging = tempfile.mkdtemp(prefix="pdm_jax_tokenizer_")
    try:
        local = os.path.join(staging, "tokenizer")
        remote = wd.join(workdir, "tokenizer")
        uploaded = wd.exists(wd.join(remote, RECIPE_FILE))
        if uploaded:
            os.makedirs(local)
            saved = json.loads(wd.read_bytes(wd.join(remote, RECIPE_FILE)))
            files = saved.get("files") if isinstance(saved, dict) else None
            names = list(files) if isinstance(files, list) else None
            bad = [n for n in names or [] if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\\" in n]
            if names is None or bad:
                raise ValueError(f"{wd.join(remote, RECIPE_FILE)}: its 'files' must be plain file names, got "
                                 f"{bad[0] if bad else saved!r}")
            for name in names + [RECIPE_FILE]:
                with open(os.path.join(local, name), "wb") as f:
                    f.write(wd.read_bytes(wd.join(remote, name)))
        try:
            tokenizer = shared_tokenizer(local, build, recipe)
        except ValueError as e:  # the local copy is gone once this returns: name the bucket's
            raise ValueError(f"the tokenizer of {remote} (downloaded to a local copy): {e}") from e
        if upload and not uploaded:  # the recipe last: its presence marks a complete upload
            names = sorted(n for n in os.listdir(local) if n != RECIPE_FILE) + [RECIPE_FILE]
            for name in names:
                wd.upload_file(os.path.join(local, name), wd.join(remote, name))
        return tokenizer
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_tokenizer_fits_model(tokenizer, model_vocab_size: int, tokenizer_config, hf_path: str = "") -> None:
    """Refuses a tokenizer whose ids the model cannot embed, or one other than the checkpoint's own.

    Every id (``len(tokenizer)``, added tokens included) must be below the model's ``vocab_size`` (Qwen3: 151,936
    rows for 151,669 tokens; over twice as many rows logs a warning). With ``model.hf_path`` shipping a tokenizer and
    ``tokenizer.path`` another directory, both must map tokens to the same ids.

    Args:
      tokenizer: the run's Hugging Face tokenizer.
      model_vocab_size: the embedding's rows.
      tokenizer_config: ``config.tokenizer`` (named in the error).
      hf_path: ``model.hf_path`` ("" = a random-init model).

    Raises:
      ValueError: naming the model and the tokenizer with both sizes, or the first token the vocabularies map
        differently."""
    from pdm_jax.models.tokenizer import checkpoint_tokenizer_file  # deferred, as run_tokenizer's imports

    tc = tokenizer_config
    named = f"tokenizer.kind = {tc.kind!r}" + (f", tokenizer.path = {tc.path!r}" if tc.kind == "path" else "")
    model = f"model.hf_path = {hf_path!r}" if hf_path else "the model (model.preset / model.vocab_size)"
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    if size > model_vocab_size:
        raise ValueError(f"{named}: its {size} token ids do not fit {model} with vocab_size {model_vocab_size} (ids "
                         f">= {model_vocab_size} have no embedding): use the tokenizer the model was trained with"
                         + (f" (tokenizer.path={hf_path})" if checkpoint_tokenizer_file(hf_path) else ""))
    if hf_path and 2 * size < model_vocab_size:  # fits, but most rows unused: likely another model's tokenizer
        log.warning("%s: its %d token ids use under half of the %d embedding rows of %s: is it the tokenizer the "
                    "checkpoint was trained with?", named, size, model_vocab_size, model)
    if not (hf_path and tc.kind == "path" and checkpoint_tokenizer_file(hf_path)
            and os.path.realpath(tc.path) != os.path.realpath(hf_path)):
        return
    from pdm_jax.models.tokenizer import load_tokenizer  # deferred, as run_tokenizer's

    own = load_tokenizer(hf_path).get_vocab()
    if own != vocab:
        token = next((t for t in sorted(own.keys() | vocab.keys()) if own.get(t) != vocab.get(t)), None)
        raise ValueError(f"{named}: its vocabulary ({len(vocab)} tokens) is not the one {model} ships ({len(own)} "
                         f"tokens; {token!r} is id {vocab.get(token)} in tokenizer.path and {own.get(token)} in the "
                         f"checkpoint): set tokenizer.path={hf_path}")


def checkpoint_stop_ids(tokenizer, hf_path: str) -> tuple:
    """The ids a checkpoint's own files say end a completion (for an empty ``sampler.stop_token_ids``):
    ``generation_config.json``'s ``eos_token_id`` (Qwen3 instruct: 151645 and 151643), then the tokenizer's pad id
    where it is a special token (Qwen3 Base: 151643); () without ``hf_path`` or when neither names one. Read locally."""
    if not hf_path:
        return ()
    from transformers import GenerationConfig  # deferred, as run_tokenizer's imports

    ids = []
    try:
        eos = GenerationConfig.from_pretrained(hf_path, local_files_only=True).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        eos = None
    ids += [eos] if isinstance(eos, int) else list(eos or [])
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and getattr(tokenizer, "pad_token", None) in getattr(tokenizer, "all_special_tokens", ()):
        ids.append(pad)
    return tuple(dict.fromkeys(int(i) for i in ids))


def sft_warmstart_batch(source, codec: "TextCodec", step: int, batch_size: int, completion_len: int) -> StepBatch:
    """Warm-start step ``step``'s batch: training examples ``step * batch_size ...`` with their reference answers,
    through :meth:`TextCodec.sft_batch` (prompt width: the longest prompt rounded up to :data:`SFT_PROMPT_MULTIPLE`;
    targets cut to ``completion_len`` tokens, ``rl.max_new_tokens``)."""
    exs = source.train_batch(step * batch_size, batch_size)
    return codec.sft_batch([e.prompt for e in exs], [source.sft_target(e) for e in exs],
                           completion_len=completion_len)


class TextCodec:
    """Token ids of prompts and reference answers; text of completions.

    Args:
      tokenizer: a Hugging Face tokenizer with an ``eos_token``.
      chat: apply the tokenizer's chat template to prompts.
      stop_token_ids: further ids that end a completion (``sampler.stop_token_ids``).
      enable_thinking: passed to the chat template (``data.enable_thinking``); None passes nothing.

    Attributes:
      eos_id: the tokenizer's eos id, appended to supervised targets.
      stop_ids: tuple of ints, the eos id first, then ``stop_token_ids`` (no repeats): every sample stops on them,
        and they are dropped when a completion is decoded.

    Raises:
      ValueError: the tokenizer has no eos token."""

    def __init__(self, tokenizer, *, chat: bool, stop_token_ids=(), enable_thinking=None):
        self.tokenizer = tokenizer
        self.chat = bool(chat)
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos_token")
        self.stop_ids = tuple(dict.fromkeys([int(self.eos_id)] + [int(i) for i in stop_token_ids]))

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt: text (one user turn) or a list of chat messages ``{role, content}`` (``data.kind =
        "file"``), with the chat template and generation prompt for a chat source. ``apply_chat_template``'s list, or
        ``BatchEncoding`` (transformers 5), is read as one sequence of ids.

        Raises:
          TypeError: the template gave something other than integer ids (naming it); chat messages without the chat
            template.
          ValueError: it gave more than one sequence for the one prompt."""
        if self.chat:
            messages = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages,
                                                     add_generation_prompt=True, tokenize=True,
                                                     **self.template_kwargs)
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
        elif isinstance(prompt, (list, tuple)):
            raise TypeError("a prompt of chat messages needs the chat template (data.chat_template 'auto' or 'on')")
        else:
            ids = self._encode(prompt, "prompt")
        if hasattr(ids, "tolist"):  # numpy / jax arrays (return_tensors="np")
            ids = ids.tolist()
        ids = ids if isinstance(ids, list) else list(ids) if isinstance(ids, tuple) else [ids]
        if ids and all(hasattr(i, "tolist") or isinstance(i, (list, tuple)) for i in ids):  # a batch
            if len(ids) != 1:
                raise ValueError(f"tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r}: one prompt gave "
                                 f"{len(ids)} sequences of ids")
            ids = ids[0].tolist() if hasattr(ids[0], "tolist") else list(ids[0])
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r}: prompt ids must be "
                            f"integers, got {bad!r} ({type(bad).__name__})")
        return [int(i) for i in ids]

    def _encode(self, text: str, what: str) -> list:
        """The ids of plain `text` (no special tokens).

        Raises:
          ValueError: the tokenizer cannot encode it, naming `what`, the text, the characters its vocabulary lacks
            and the ``tokenizer.`` settings."""
        try:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception; named below
            vocab = self.tokenizer.get_vocab()
            missing = "".join(sorted({ch for ch in text if ch not in vocab}))
            hint = (f": its vocabulary lacks the characters {missing[:40]!r}. A character tokenizer "
                    "(tokenizer.kind=char) encodes tokenizer.symbols only: add them there, or for text prompts use "
                    "tokenizer.kind=bpe (trained on the prompts) or tokenizer.kind=path (a checkpoint's own)"
                    if missing else "")
            raise ValueError(f"tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r} cannot encode the {what} "
                             f"{text[:80]!r} ({type(e).__name__}: {e}){hint}") from None

    def decode_completion(self, ids: np.ndarray, mask: np.ndarray) -> str:
        """Text of a completion's valid tokens (``ids``, ``mask`` ``[T]``), without the stop and special tokens."""
        toks = [int(t) for t, m in zip(ids, mask) if m and int(t) not in self.stop_ids]
        return self.tokenizer.decode(toks, skip_special_tokens=True)

    def sft_batch(self, prompts, targets, *, completion_len: int, prompt_len: Optional[int] = None) -> StepBatch:
        """A supervised batch: each prompt's ids, whole and left-padded, and its target's ids + eos (right-padded, cut
        to ``completion_len``); the RL fields are None. The prompt width is ``prompt_len``, or the longest prompt
        rounded up to :data:`SFT_PROMPT_MULTIPLE` (one compiled step per width); a prompt is never cut.

        Raises:
          ValueError: a prompt longer than ``prompt_len`` (naming both lengths and the row)."""
        ids = [self.encode_prompt(prompt) for prompt in prompts]
        longest = max((len(x) for x in ids), default=0)
        if prompt_len is None:
            prompt_len = round_up(max(longest, 1), SFT_PROMPT_MULTIPLE)
        elif longest > prompt_len:
            row = next(i for i, x in enumerate(ids) if len(x) == longest)
            raise ValueError(f"SFT prompt of row {row} has {longest} tokens, more than the batch's prompt width "
                             f"{prompt_len} (prompts are never cut)")
        p_ids, p_mask = left_pad(ids, prompt_len)
        c = [(list(self._encode(target, "reference answer")) + [self.eos_id])[:completion_len] for target in targets]
        c_ids = right_pad_rows(c, completion_len, dtype=np.int32)
        c_mask = np.arange(completion_len)[None, :] < np.array([len(x) for x in c])[:, None]
        return StepBatch(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask)
