"""OpenAI-compatible endpoints of the sampler service: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Mounted by `pdm_jax.sampler.server` next to the native API when it is started with ``--tokenizer=DIR``, so
that tools which speak the OpenAI API (lm-evaluation-harness's ``local-completions`` /
``local-chat-completions``, the official ``openai`` client) can sample from the weights the server holds.
The request and response shapes follow OpenAI's API reference (Completions, Chat Completions, Models);
no code or text is taken from it.

Requests (JSON or msgpack, read with the native API's size limit and decoder, `SamplerService.read_body`):

* ``/v1/completions``: ``prompt`` (a string, a list of strings, a list of token ids or a list of token-id
  lists), ``max_tokens`` (default 16), ``temperature`` (default 1; 0 = greedy), ``top_p``, ``n``, ``stop``
  (a string or a list of up to `MAX_STOP_STRINGS` non-empty strings), ``seed``, ``logprobs`` (0..`MAX_LOGPROBS`:
  the top-``logprobs`` per generated token), ``model``; choice ``i * n + j`` is sample j of prompt i.
* ``/v1/chat/completions``: ``messages`` (``role`` system / user / assistant / tool / developer, ``content`` a
  string or a list of ``{"type": "text", "text"}`` parts) rendered with the tokenizer's own chat template
  (transformers ``apply_chat_template`` with the generation prompt), ``max_tokens`` or ``max_completion_tokens``
  (default: the server's ``--max_new_tokens``), ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
  ``logprobs`` (bool) and ``top_logprobs`` (0..`MAX_LOGPROBS`, needs ``logprobs: true``).
* ``echo: true`` (completions) puts the prompt before the text and, with ``logprobs``, the prompt's own
  log-probabilities before the completion's (teacher-forced on the same weights, `prompt_logprobs`; the first
  prompt token's entry is null); with ``max_tokens: 0`` nothing is generated (lm-evaluation-harness's
  log-likelihood requests: ``echo``, ``max_tokens: 1``, ``logprobs: 1``).
* ``top_k`` (vLLM's extension) is served; ``stream``, ``best_of`` > n, penalties, ``logit_bias``,
  ``suffix``, tools and non-text response formats are refused with 400 naming the parameter when set to anything
  but their neutral value; any other unknown field is refused the same way. Nothing is ignored silently except
  ``user`` (an end-user label) and ``stream_options`` / ``parallel_tool_calls`` left null.

Semantics: completions stop on the tokenizer's eos id (and the ids ``generation_config.json`` beside it names);
that token is not part of the text, but is one of the tokens of ``logprobs`` and ``usage`` (as vLLM counts it).
Stop strings are applied after generation: the text is cut before the first occurrence of any of them
(``finish_reason`` ``"stop"``), the tokens whose text starts at or after the cut are dropped from ``logprobs`` and
from ``usage.completion_tokens``.  Log-probabilities are those of the distribution
the tokens were drawn from (temperature and ``top_p`` / ``top_k`` applied; temperature 0: the model's own, tau 1),
as the native API returns them; a token that filtering removed is left out of ``top_logprobs``.  ``seed`` fixes
the draws (the engine's per-prompt, per-sample keys: the same request with the same seed gives the same text);
without one the engine draws a fresh seed.  ``system_fingerprint`` is ``pdm_jax-v<weights version>``.

Errors: OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with 400 (a malformed or refused
request, naming ``param``), 401 (the bearer token, ``--token`` as the API key), 404 (an unknown ``model``, or a
server started without ``--tokenizer``), 413 (a body over ``--max_body_bytes``), 415 (content type).

Layout: `OpenAIService` holds the tokenizer and one handler per route; the pure functions `completion_choice`,
`chat_choice` and `cut_at_stop` build the answer from an engine `RolloutBatch` (tested without a server).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Optional, Sequence

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pdm_jax.sampler import vllm_api, wire

# ----------------------------------------------------------------------------- routes and names
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MODELS = "/v1/models"
ROUTES = (COMPLETIONS, CHAT_COMPLETIONS, MODELS)

MESSAGES = "messages"
STOP = "stop"
MAX_COMPLETION_TOKENS = "max_completion_tokens"
TOP_LOGPROBS = wire.TOP_LOGPROBS
ROLE = "role"
CONTENT = "content"
ROLES = ("system", "user", "assistant", "tool", "developer")
#: Fields accepted only at their neutral value (OpenAI's parameters the engine does not implement).
NEUTRAL = {"stream": (None, False), "presence_penalty": (None, 0, 0.0),
           "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "suffix": (None, ""),
           "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
           "stream_options": (None,), "parallel_tool_calls": (None, False, True),
           "response_format": (None, {"type": "text"})}
COMMON_FIELDS = frozenset({wire.MODEL, wire.N, wire.TEMPERATURE, wire.TOP_P, wire.TOP_K, wire.MAX_TOKENS, STOP,
                           wire.SEED, wire.LOGPROBS, "user", *NEUTRAL})
COMPLETION_FIELDS = COMMON_FIELDS | {wire.PROMPT, "best_of", vllm_api.ECHO}
CHAT_FIELDS = COMMON_FIELDS | {MESSAGES, MAX_COMPLETION_TOKENS, TOP_LOGPROBS}
MAX_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs; also completions' logprobs here
MAX_STOP_STRINGS = 16  # OpenAI allows 4; lm-evaluation-harness may send a task's stops plus the eos string
MAX_STOP_CHARS = 1000
DEFAULT_COMPLETION_TOKENS = wire.DEFAULT_MAX_TOKENS  # OpenAI's default max_tokens for /v1/completions
FINGERPRINT = "pdm_jax-v{}"


class OpenAIError(Exception):
    """A refused request: HTTP status, message, the offending parameter (OpenAI's ``param``) and error type.

    The message is prefixed with ``"<param>: "`` unless it names the parameter already.
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None):
        if param and param not in message:  # the message names the parameter, as the native API's do
            message = f"{param}: {message}"
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 415: "invalid_request_error"}.get(status, "server_error")


def error_body(message: str, param: Optional[str], kind: str, code: Any = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {wire.ERROR: {wire.MESSAGE: message, wire.TYPE: kind, "param": param, "code": code}}


def is_openai_path(path: str) -> bool:
    """True for the routes this module serves (their errors take OpenAI's shape, also the middleware's 401/413)."""
    return path.rstrip("/") in ROUTES


def error_response(e: OpenAIError) -> Response:
    """`e` as a JSON response in OpenAI's error shape (`error_body`) with its HTTP status (``code``: the status,
    None for 400)."""
    return JSONResponse(error_body(e.message, e.param, e.kind, e.status if e.status != 400 else None),
                        status_code=e.status)


# ----------------------------------------------------------------------------- validation helpers
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _show(v, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_fields(body: dict, allowed: frozenset) -> None:
    """400 naming the first unknown field, or the first field of `NEUTRAL` set to a value the engine cannot serve."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise OpenAIError(400, f"{name}={_show(value)} is not supported by this server (only "
                                   f"{' / '.join(_show(v) for v in neutral)})", name)


def parse_stop(value) -> list:
    """``stop`` (None, a string or a list of strings) as a list of non-empty strings; 400 naming ``stop``."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError(400, f"must be a non-empty string or a list of them, got {_show(value)}", STOP)
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise OpenAIError(400, f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters",
                          STOP)
    return stops


def _logprobs_k(value, param: str) -> int:
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(400, f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {_show(value)}", param)
    return int(value)


# ----------------------------------------------------------------------------- text of completions
def token_offsets(tokenizer, ids: Sequence[int]) -> tuple:
    """``(text, offsets)``: the decoded text of `ids` (special tokens dropped) and, for each id, where its text
    starts in it (the length of the text of the ids before it; a token that adds no text starts where the next does).

    Decoded prefix by prefix, so a character spread over several byte-level tokens is placed at the token that
    completes it; O(T^2) characters, T at most the server's ``--max_new_tokens``.
    """
    offsets, prev = [], ""
    for t in range(len(ids)):
        offsets.append(len(prev))
        prev = tokenizer.decode(list(ids[:t + 1]), skip_special_tokens=True)
    text = prev if ids else ""
    # a prefix whose last bytes are an incomplete character decodes to a replacement character that the next
    # token rewrites: keep offsets non-decreasing and within the final text
    out, hi = [], len(text)
    for o in reversed(offsets):
        hi = min(hi, o)
        out.append(hi)
    return text, out[::-1]


def cut_at_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    """The index in `text` of the earliest occurrence of any of `stops` (the text is cut there), or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _finite(v: float) -> Optional[float]:
    v = float(v)
    return v if np.isfinite(v) else None


def _row(tokenizer, batch, r: int, stop_ids, stops, k: int) -> dict:
    """One row of a RolloutBatch as text: ``{"text", "finish_reason", "ids", "offsets", "logprobs", "top"}``.

    The text leaves out the engine's final stop token (eos); ``ids`` keep it (as vLLM's logprobs do: a scorer
    asking for one token after its prompt always gets one), at offset ``len(text)``. Everything is cut at the first
    stop string: the tokens whose text starts at or after the cut are dropped. ``top`` holds, per kept id, the
    top-k (id, log mu) pairs with finite log mu.
    """
    t_r = int(batch.completion_mask[r].sum())
    ids = [int(x) for x in batch.completion_ids[r, :t_r]]
    reason = str(batch.finish_reason[r])
    ends_on_stop = reason == "stop" and bool(ids) and ids[-1] in stop_ids
    text, offsets = token_offsets(tokenizer, ids[:-1] if ends_on_stop else ids)
    if ends_on_stop:
        offsets.append(len(text))
    cut = cut_at_stop(text, stops)
    keep = len(ids)
    if cut is not None:
        text, reason = text[:cut], "stop"
        keep = sum(1 for o in offsets if o < cut)
    top = [[(int(i), float(v)) for i, v in zip(batch.topk_ids[r, t, :k], batch.topk_logprobs[r, t, :k])
            if np.isfinite(v)] for t in range(keep)]
    return dict(text=text, finish_reason=reason, ids=ids[:keep], offsets=offsets[:keep],
                logprobs=[float(v) for v in batch.behavior_logprobs[r, :keep]], top=top)


def _token_text(tokenizer, i: int) -> str:
    """One token's own text, special tokens included (the keys of ``top_logprobs``)."""
    return tokenizer.decode([int(i)], skip_special_tokens=False)


def completion_choice(tokenizer, batch, r: int, *, index: int, stop_ids, stops, k: Optional[int]) -> dict:
    """Choice `index` of a ``/v1/completions`` answer from row `r` of `batch` (a `RolloutBatch`).

    Args:
      tokenizer: the server's Hugging Face tokenizer.
      batch: the engine's answer; ``behavior_logprobs`` [N, T] f32, ``topk_*`` [N, T, K].
      stop_ids: the engine's stop ids (a final one is left out of the text, kept in ``logprobs``).
      stops: stop strings (`cut_at_stop`).
      k: the request's ``logprobs`` (None: no ``logprobs`` object).
    Returns:
      ``(choice, tokens)``: the choice ``{"index", "text", "logprobs", "finish_reason"}`` (``logprobs`` holds
      ``tokens``, each token's own text, ``token_logprobs``, ``top_logprobs``, ``{token text: log mu}`` of the top
      k, and ``text_offset``, from the start of the completion's text) and its token count (``usage``).
    """
    row = _row(tokenizer, batch, r, stop_ids, stops, k or 0)
    logprobs = None
    if k is not None:
        tops = []
        for pairs in row["top"]:
            entry = {}
            for i, v in pairs:  # two ids with the same text: the likelier one (pairs are in rank order)
                entry.setdefault(_token_text(tokenizer, i), v)
            tops.append(entry)
        logprobs = {vllm_api.TOKENS: [_token_text(tokenizer, i) for i in row["ids"]],
                    vllm_api.TOKEN_LOGPROBS: [_finite(v) for v in row["logprobs"]],
                    wire.TOP_LOGPROBS: tops, vllm_api.TEXT_OFFSET: row["offsets"]}
    return {wire.INDEX: index, vllm_api.TEXT: row["text"], wire.LOGPROBS: logprobs,
            wire.FINISH_REASON: row["finish_reason"]}, len(row["ids"])


def _logprob_entry(tokenizer, i: int, v: float) -> dict:
    text = _token_text(tokenizer, i)
    return {"token": text, "logprob": _finite(v), "bytes": list(text.encode("utf-8"))}


def chat_choice(tokenizer, batch, r: int, *, index: int, stop_ids, stops, logprobs: bool, k: int) -> tuple:
    """Choice `index` of a ``/v1/chat/completions`` answer from row `r` of `batch` (see `completion_choice`).

    Returns ``({"index", "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}, tokens)``;
    ``logprobs`` is ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [k entries]}]}`` when asked.
    """
    row = _row(tokenizer, batch, r, stop_ids, stops, k)
    lp = None
    if logprobs:
        lp = {CONTENT: [{**_logprob_entry(tokenizer, i, v),
                         TOP_LOGPROBS: [_logprob_entry(tokenizer, j, w) for j, w in top]}
                        for i, v, top in zip(row["ids"], row["logprobs"], row["top"])]}
    return {wire.INDEX: index, "message": {ROLE: "assistant", CONTENT: row["text"]}, wire.LOGPROBS: lp,
            wire.FINISH_REASON: row["finish_reason"]}, len(row["ids"])


def prompt_logprobs(engine, prompts: Sequence[Sequence[int]], *, k: int, temperature: float = 1.0) -> list:
    """Each prompt's own log-probabilities under the engine's current weights (``echo``), teacher-forced.

    One forward of the sampler's model (its quantized copy, compute dtype; logits f32 / `temperature`) over the
    prompts right-padded to a power-of-two length (at least 8) and row count, so few programs compile.

    Args:
      engine: a `SamplingEngine` on one device.
      prompts: token-id lists (already validated by the engine).
      k: top entries per position (0..`MAX_LOGPROBS`).
      temperature: tau > 0 (1 for greedy requests).
    Returns:
      per prompt of P ids: ``(logprobs [P-1] f32, top_ids [P-1, k] i32, top_logprobs [P-1, k] f32)``, position j
      scoring id j + 1 given ids 0..j (the first id has no log-probability).
    """
    import jax  # the engine's process has JAX loaded already
    import jax.numpy as jnp
    from flax import nnx

    from pdm_jax.sampler.engine import next_pow2

    width = next_pow2(max(8, max(len(p) for p in prompts)))
    rows = next_pow2(len(prompts))
    ids = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), bool)
    for r, p in enumerate(prompts):
        ids[r, :len(p)], mask[r, :len(p)] = p, True
    graphdef, state = nnx.split(engine.model())
    lp, top_ids, top_lp = jax.device_get(_score_program()(graphdef, state, jnp.asarray(ids), jnp.asarray(mask),
                                                          jnp.float32(temperature), k=max(int(k), 1)))
    return [(lp[r, :len(p) - 1], top_ids[r, :len(p) - 1, :k], top_lp[r, :len(p) - 1, :k])
            for r, p in enumerate(prompts)]


_SCORE = []


def _score_program():
    """The jitted teacher-forced scorer of `prompt_logprobs` (built once, on first use: JAX is imported then)."""
    if not _SCORE:
        import functools

        import jax
        import jax.numpy as jnp
        from flax import nnx

        @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("k",))
        def score(graphdef, state, ids, mask, tau, *, k):
            logits = nnx.merge(graphdef, state)(ids, attention_mask=mask).astype(jnp.float32) / tau
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            tok = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            top_lp, top_ids = jax.lax.top_k(logp, k)
            return tok, top_ids.astype(jnp.int32), top_lp

        _SCORE.append(score)
    return _SCORE[0]


def echo_prompt(tokenizer, prompt: Sequence[int], choice: dict, scores=None) -> dict:
    """`choice` (a `completion_choice`) with the prompt echoed before its text and, with `scores` (one entry of
    `prompt_logprobs`), before its logprobs: the prompt's first token has ``null`` log-probability and top entries
    (nothing predicts it), ``text_offset`` counts from the start of the prompt's text."""
    text, offsets = token_offsets(tokenizer, list(prompt))
    out = dict(choice, **{vllm_api.TEXT: text + choice[vllm_api.TEXT]})
    lp = choice.get(wire.LOGPROBS)
    if lp is not None and scores is not None:
        own, top_ids, top_lps = scores
        tops = [None]
        for ids_j, lps_j in zip(top_ids, top_lps):
            entry = {}
            for i, v in zip(ids_j, lps_j):
                if np.isfinite(v):
                    entry.setdefault(_token_text(tokenizer, int(i)), float(v))
            tops.append(entry)
        out[wire.LOGPROBS] = {
            vllm_api.TOKENS: [_token_text(tokenizer, i) for i in prompt] + lp[vllm_api.TOKENS],
            vllm_api.TOKEN_LOGPROBS: [None] + [_finite(v) for v in own] + lp[vllm_api.TOKEN_LOGPROBS],
            wire.TOP_LOGPROBS: tops + lp[wire.TOP_LOGPROBS],
            vllm_api.TEXT_OFFSET: offsets + [len(text) + o for o in lp[vllm_api.TEXT_OFFSET]]}
    return out


def stop_token_ids(tokenizer, tokenizer_dir: Optional[str]) -> tuple:
    """The ids a completion stops on: the tokenizer's eos id, then ``generation_config.json``'s ``eos_token_id``
    (an int or a list) when `tokenizer_dir` holds one (Qwen3 instruct: <|im_end|> and <|endoftext|>).

    Raises:
      ValueError: the tokenizer has no eos token and the directory names none.
    """
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if tokenizer_dir:
        from transformers import GenerationConfig  # deferred: only a server with --tokenizer loads transformers

        try:
            eos = GenerationConfig.from_pretrained(tokenizer_dir, local_files_only=True).eos_token_id
        except (OSError, ValueError):  # no generation_config.json
            eos = None
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise ValueError(f"the tokenizer in {tokenizer_dir!r} has no eos token: completions could never stop")
    return tuple(dict.fromkeys(int(i) for i in ids))


# ----------------------------------------------------------------------------- the service
class OpenAIService:
    """The OpenAI-compatible handlers over a `SamplerService` (its engine, body reader and counters).

    Args:
      service: the server's `pdm_jax.sampler.server.SamplerService`.
      tokenizer: a Hugging Face tokenizer (``--tokenizer``), or None: every route then answers 404 saying so.
      tokenizer_dir: its directory (``generation_config.json`` stop ids; shown nowhere).
      model_name: the served model's id (``--served_model_name``); a request naming another model gets 404.
    Raises:
      ValueError: the tokenizer has no eos token (`stop_token_ids`).
    """

    def __init__(self, service, tokenizer=None, *, tokenizer_dir: Optional[str] = None, model_name: str = "pdm_jax"):
        self.service, self.tokenizer, self.model_name = service, tokenizer, model_name
        self.stop_ids = () if tokenizer is None else stop_token_ids(tokenizer, tokenizer_dir)
        self.created = int(time.time())

    # -------------------------------------------------------------- requests -> engine
    def _check_common(self, body: dict) -> None:
        if self.tokenizer is None:
            raise OpenAIError(404, "this sampler was started without --tokenizer: the OpenAI-compatible endpoints "
                                   "need one to turn text into token ids and back")
        model = body.get(wire.MODEL)
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model {_show(model)} does not exist: this server serves "
                                   f"{self.model_name!r} (GET {MODELS})", wire.MODEL, kind="not_found_error")

    def _encode(self, text: str, param: str) -> list:
        from pdm_jax.models.tokenizer import encode_strict  # deferred: transformers, loaded with --tokenizer

        try:
            return encode_strict(self.tokenizer, text)
        except ValueError as e:
            raise OpenAIError(400, f"cannot be tokenized: {e}", param) from e

    def _completion_prompts(self, prompt) -> list:
        """``prompt`` in any of its four forms -> a list of token-id lists (ids checked by the engine)."""
        if isinstance(prompt, str):
            return [self._encode(prompt, wire.PROMPT)]
        if isinstance(prompt, np.ndarray):  # msgpack packed arrays
            prompt = prompt.tolist()
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self._encode(p, wire.PROMPT) for p in prompt]
            if all(_is_int(t) for t in prompt):
                return [[int(t) for t in prompt]]
            if all(isinstance(p, (list, np.ndarray)) for p in prompt):
                return [p.tolist() if isinstance(p, np.ndarray) else p for p in prompt]
        raise OpenAIError(400, f"must be a string, a list of strings, a list of token ids or a list of token-id "
                               f"lists, got {_show(prompt)}", wire.PROMPT)

    def _chat_prompt(self, messages) -> list:
        """``messages`` rendered by the tokenizer's chat template (generation prompt added) -> token ids."""
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(400, f"must be a non-empty list of messages, got {_show(messages)}", MESSAGES)
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get(ROLE) not in ROLES:
                raise OpenAIError(400, f"messages[{i}] must be an object with a role in {ROLES}, got {_show(m)}",
                                  MESSAGES)
            content = m.get(CONTENT)
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise OpenAIError(400, f"messages[{i}].content: only text parts are served", MESSAGES)
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise OpenAIError(400, f"messages[{i}].content must be a string or a list of text parts, got "
                                       f"{_show(content)}", MESSAGES)
            extra = sorted(set(m) - {ROLE, CONTENT, "name"})
            if extra:
                raise OpenAIError(400, f"messages[{i}]: field {extra[0]!r} is not supported", MESSAGES)
            plain.append({ROLE: m[ROLE], CONTENT: content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "the served tokenizer has no chat template: use /v1/completions", MESSAGES)
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that raises (jinja's raise_exception) on these messages
            raise OpenAIError(400, f"the chat template refused the messages: {type(e).__name__}: {e}",
                              MESSAGES) from e
        return [self._encode(text, MESSAGES)]

    def _generate(self, prompts: list, body: dict, *, k: int, max_tokens, param_names: dict, run: bool = True):
        """engine.validate + generate (only validate when not `run`: None); a RequestError becomes 400 naming the
        OpenAI parameter."""
        def opt(name, default):  # null = the default, as OpenAI reads it
            value = body.get(name)
            return default if value is None else value

        kwargs = dict(n=opt(wire.N, 1), temperature=opt(wire.TEMPERATURE, 1.0), max_new_tokens=max_tokens,
                      top_k_logprobs=k, stop_token_ids=list(self.stop_ids), seed=body.get(wire.SEED),
                      top_p=opt(wire.TOP_P, 1.0), top_k=opt(wire.TOP_K, 0))
        if _is_int(kwargs["top_k"]) and kwargs["top_k"] == -1:  # vLLM's "off"
            kwargs["top_k"] = 0
        engine = self.service.engine
        try:
            engine.validate(prompts, **kwargs)
            return engine.generate(prompts, **kwargs) if run else None
        except wire.RequestError as e:
            param = param_names.get(e.field, e.field)
            raise OpenAIError(400, str(e).replace(f"{e.field}:", f"{param}:", 1), param) from e

    def _answer(self, kind: str, choices: list, prompt_tokens: int, completion_tokens: int, version: int) -> dict:
        self.service.requests += 1
        self.service.generated_tokens += completion_tokens
        prefix, obj = ("cmpl", wire.TEXT_COMPLETION) if kind == "text" else ("chatcmpl", "chat.completion")
        return {vllm_api.ID: f"{prefix}-{secrets.token_hex(12)}", wire.OBJECT: obj, "created": int(time.time()),
                wire.MODEL: self.model_name, "system_fingerprint": FINGERPRINT.format(version), wire.CHOICES: choices,
                wire.USAGE: {wire.PROMPT_TOKENS: prompt_tokens, wire.COMPLETION_TOKENS: completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}}

    def completions_body(self, body: dict) -> dict:
        """The ``/v1/completions`` answer to a decoded body (runs the engine; `OpenAIError` when refused)."""
        self._check_common(body)
        check_fields(body, COMPLETION_FIELDS)
        if wire.PROMPT not in body:
            raise OpenAIError(400, "missing required parameter 'prompt'", wire.PROMPT)
        n = body.get(wire.N)
        best_of = body.get("best_of")
        if best_of is not None and best_of not in (1, n if n is not None else 1):
            raise OpenAIError(400, f"best_of={_show(best_of)} is not supported (only null or equal to n)", "best_of")
        stops = parse_stop(body.get(STOP))
        k = body.get(wire.LOGPROBS)
        k = None if k is None else _logprobs_k(k, wire.LOGPROBS)
        echo = body.get(vllm_api.ECHO)
        if echo is not None and not isinstance(echo, bool):
            raise OpenAIError(400, f"echo must be true or false, got {_show(echo)}", vllm_api.ECHO)
        if echo and self.service.engine.mesh is not None:
            raise OpenAIError(400, "echo (the prompt's own log-probabilities) is not served by a sharded sampler",
                              vllm_api.ECHO)
        prompts = self._completion_prompts(body[wire.PROMPT])
        max_tokens = body.get(wire.MAX_TOKENS)
        max_tokens = DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens
        score_only = bool(echo) and _is_int(max_tokens) and max_tokens == 0  # OpenAI: echo with 0 new tokens
        batch = self._generate(prompts, body, k=k or 0, max_tokens=1 if score_only else max_tokens,
                               param_names={wire.LOGPROBS: wire.LOGPROBS}, run=not score_only)
        n = 1 if body.get(wire.N) is None else int(body[wire.N])
        scores = None
        if echo and k is not None:
            t = body.get(wire.TEMPERATURE)
            scores = prompt_logprobs(self.service.engine, prompts, k=k, temperature=1.0 if not t else float(t))
        choices, used = [], 0
        for r in range(len(prompts) * n):
            i = r // n
            if score_only:
                choice, tokens = {wire.INDEX: r, vllm_api.TEXT: "", wire.LOGPROBS: None if k is None else {
                    vllm_api.TOKENS: [], vllm_api.TOKEN_LOGPROBS: [], wire.TOP_LOGPROBS: [], vllm_api.TEXT_OFFSET: []},
                    wire.FINISH_REASON: "length"}, 0
            else:
                choice, tokens = completion_choice(self.tokenizer, batch, r, index=r, stop_ids=self.stop_ids,
                                                   stops=stops, k=k)
            if echo:
                choice = echo_prompt(self.tokenizer, prompts[i], choice, None if scores is None else scores[i])
            choices.append(choice)
            used += tokens
        version = self.service.engine.version if batch is None else int(batch.weights_version[0])
        return self._answer("text", choices, sum(len(p) for p in prompts), used, version)

    def chat_body(self, body: dict) -> dict:
        """The ``/v1/chat/completions`` answer to a decoded body (runs the engine; `OpenAIError` when refused)."""
        self._check_common(body)
        check_fields(body, CHAT_FIELDS)
        if MESSAGES not in body:
            raise OpenAIError(400, "missing required parameter 'messages'", MESSAGES)
        want = body.get(wire.LOGPROBS)
        if want is not None and not isinstance(want, bool):
            raise OpenAIError(400, f"logprobs must be true or false, got {_show(want)}", wire.LOGPROBS)
        k = _logprobs_k(body.get(TOP_LOGPROBS), TOP_LOGPROBS)
        if body.get(TOP_LOGPROBS) is not None and not want:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", TOP_LOGPROBS)
        stops = parse_stop(body.get(STOP))
        a, b = body.get(wire.MAX_TOKENS), body.get(MAX_COMPLETION_TOKENS)
        if a is not None and b is not None and a != b:
            raise OpenAIError(400, f"max_completion_tokens={_show(b)} and its older name differ ({_show(a)})",
                              MAX_COMPLETION_TOKENS)
        max_tokens = b if b is not None else a
        prompts = self._chat_prompt(body[MESSAGES])
        batch = self._generate(prompts, body, k=k, max_tokens=max_tokens,
                               param_names={wire.LOGPROBS: TOP_LOGPROBS,
                                            wire.MAX_TOKENS: wire.MAX_TOKENS if a is not None and b is None
                                            else MAX_COMPLETION_TOKENS, wire.PROMPT: MESSAGES})
        choices, used = [], 0
        for r in range(batch.num_sequences):
            choice, tokens = chat_choice(self.tokenizer, batch, r, index=r, stop_ids=self.stop_ids, stops=stops,
                                         logprobs=bool(want), k=k)
            choices.append(choice)
            used += tokens
        return self._answer("chat", choices, len(prompts[0]), used, int(batch.weights_version[0]))

    def models_body(self) -> dict:
        """``GET /v1/models``: the one served model."""
        if self.tokenizer is None:
            raise OpenAIError(404, "this sampler was started without --tokenizer: the OpenAI-compatible endpoints "
                                   "need one")
        return {wire.OBJECT: "list", vllm_api.DATA: [
            {vllm_api.ID: self.model_name, wire.OBJECT: "model", "created": self.created, "owned_by": "pdm_jax"}]}

    # -------------------------------------------------------------- HTTP
    def route(self, handler, *, reads_body: bool = True):
        """An endpoint running `handler` (a ``*_body`` method) off the event loop; every failure is answered
        in OpenAI's error shape (500 ``server_error`` for a bug, logged)."""
        import logging

        async def endpoint(request: Request) -> Response:
            try:
                args = ()
                if reads_body:
                    try:
                        args = (await self.service.read_body(request),)
                    except Exception as e:  # the native reader's HTTPError: 400 / 413 / 415
                        status = getattr(e, "status", None)
                        if status is None:
                            raise
                        raise OpenAIError(status, getattr(e, "message", str(e)), getattr(e, "field", None)) from e
                return JSONResponse(await run_in_threadpool(handler, *args))
            except OpenAIError as e:
                return error_response(e)
            except Exception as e:  # noqa: BLE001 - an answer instead of a reset connection
                logging.getLogger("pdm_jax.sampler.openai_api").exception("unexpected failure in %s", request.url.path)
                return error_response(OpenAIError(500, f"internal error: {type(e).__name__}: {e}"[:2000]))
        return endpoint


def mount(app, service, tokenizer=None, *, tokenizer_dir: Optional[str] = None,
          model_name: str = "pdm_jax") -> OpenAIService:
    """Adds the OpenAI-compatible routes to the server's FastAPI `app` (auth and size limits: the app's middleware).

    Returns the `OpenAIService` (also ``app.state.openai``).
    """
    oai = OpenAIService(service, tokenizer, tokenizer_dir=tokenizer_dir, model_name=model_name)
    app.post(COMPLETIONS)(oai.route(oai.completions_body))
    app.post(CHAT_COMPLETIONS)(oai.route(oai.chat_body))
    app.get(MODELS)(oai.route(oai.models_body, reads_body=False))
    app.state.openai = oai
    return oai
