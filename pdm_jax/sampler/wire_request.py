"""The sampler's requests: ``POST /v1/generate`` (`GenerateRequest`, `validate_request`) and ``POST /v1/weights``
(`LoadWeightsRequest`), decoded from wire bodies and checked by type and range; errors name the wire field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from pdm_jax.rollout import GenerateParams
from pdm_jax.sampler.limits import MAX_INT32, MAX_PATH_LENGTH, MAX_SEED, MIN_TEMPERATURE
from pdm_jax.sampler.wire import (CHOICES, DEFAULT_MAX_TOKENS, FIRST_PROMPT_INDEX, GENERATE_FIELDS, LOGPROBS,
                                  MAX_TOKENS, MODEL, N, PATH, PROMPT, RequestError, RESPONSE_FORMAT,
                                  RESPONSE_FORMATS, RETURN_ROUTING, SEED, STOP_TOKEN_IDS, STREAM, TEMPERATURE, TOP_K,
                                  TOP_P, VERSION)
from pdm_jax.sampler.wire_codec import _kind, _show


# ============================================================================= generation request
@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A ``POST /v1/generate`` request, with the Python (SamplingEngine) field names.

    Attributes:
      prompts: token-id lists (wire ``prompt``; a single flat list is one prompt).
      n: samples per prompt.
      temperature, top_p, top_k: sampling parameters (top_k 0 = off; -1 on the wire is 0).
      max_new_tokens: wire ``max_tokens`` (default `DEFAULT_MAX_TOKENS`).
      top_k_logprobs: K, wire ``logprobs`` (null/absent = 0).
      stop_token_ids: ids that end a sequence.
      seed: int or None.
      return_routing: also return each choice's routed experts (MoE routing replay).
      first_prompt_index: the index of the request's first prompt in a larger batch (keys the
        samples' random draws; 0 = the request is the whole batch).
      response_format: ``"choices"`` (default) or ``"columns"`` (`GenerateResponse.to_wire`).

    Values are carried as given: types and ranges are checked by `validate_request`
    (the engine), only the body's structure by `from_wire`.
    """

    prompts: list
    n: Any = 1
    temperature: Any = 1.0
    max_new_tokens: Any = DEFAULT_MAX_TOKENS
    top_k_logprobs: Any = 0
    stop_token_ids: list = dataclasses.field(default_factory=list)
    seed: Any = None
    top_p: Any = 1.0
    top_k: Any = 0
    return_routing: Any = False
    first_prompt_index: Any = 0
    response_format: Any = CHOICES

    @classmethod
    def from_wire(cls, body: Mapping) -> "GenerateRequest":
        """Decodes a request body (a dict, numpy arrays allowed where msgpack packed them).

        Raises:
          RequestError: an unknown field (named), ``stream`` not false/null/absent,
            ``model`` not a string, no ``prompt``, a ``stop_token_ids`` that is
            not a list, or a ``response_format`` other than "choices" / "columns".
        """
        unknown = sorted(set(body) - GENERATE_FIELDS)
        if unknown:
            raise RequestError(unknown[0], f"unknown field(s) {_show(unknown)}")
        stream = body.get(STREAM)
        if stream is True:
            raise RequestError(STREAM, "streaming is not supported")
        if stream is not None and stream is not False:
            raise RequestError(STREAM, f"must be false or null, got {_kind(stream)}")
        if body.get(MODEL) is not None and not isinstance(body[MODEL], str):
            raise RequestError(MODEL, f"must be a string (it is ignored), got {_kind(body[MODEL])}")
        if PROMPT not in body:
            raise RequestError(PROMPT, f"missing required field {PROMPT!r}")
        stops = body.get(STOP_TOKEN_IDS)
        if isinstance(stops, np.ndarray) and stops.ndim == 1:
            stops = stops.tolist()
        if stops is None:
            stops = []
        if not isinstance(stops, list):
            raise RequestError(STOP_TOKEN_IDS, f"must be a list of token ids, got {_kind(stops)}")
        top_k, logprobs = body.get(TOP_K, 0), body.get(LOGPROBS)
        layout = body.get(RESPONSE_FORMAT, RESPONSE_FORMATS[0])
        if not isinstance(layout, str) or layout not in RESPONSE_FORMATS:
            raise RequestError(RESPONSE_FORMAT, f"must be one of {RESPONSE_FORMATS}, got {_kind(layout)}")
        return cls(prompts=_normalise_prompts(body[PROMPT]), n=body.get(N, 1),
                   temperature=body.get(TEMPERATURE, 1.0), max_new_tokens=body.get(MAX_TOKENS, DEFAULT_MAX_TOKENS),
                   top_k_logprobs=0 if logprobs is None else logprobs, stop_token_ids=stops, seed=body.get(SEED),
                   top_p=body.get(TOP_P, 1.0), top_k=0 if _is_int(top_k) and top_k == -1 else top_k,
                   return_routing=body.get(RETURN_ROUTING, False),
                   first_prompt_index=body.get(FIRST_PROMPT_INDEX, 0), response_format=layout)

    def to_wire(self) -> dict:
        """The request body (a dict for `dumps`); prompts and stop ids as lists; ``first_prompt_index``
        only when it is not 0 (the body of a whole-batch request is unchanged)."""
        body = {PROMPT: [list(p) for p in self.prompts], N: self.n, TEMPERATURE: self.temperature,
                TOP_P: self.top_p, TOP_K: self.top_k, LOGPROBS: self.top_k_logprobs,
                STOP_TOKEN_IDS: list(self.stop_token_ids), SEED: self.seed, MAX_TOKENS: self.max_new_tokens}
        if self.return_routing is not False:  # only when asked: other requests' bodies are unchanged
            body[RETURN_ROUTING] = self.return_routing
        if self.first_prompt_index != 0:
            body[FIRST_PROMPT_INDEX] = self.first_prompt_index
        if self.response_format != RESPONSE_FORMATS[0]:
            body[RESPONSE_FORMAT] = self.response_format
        return body

    @classmethod
    def of(cls, prompts: list, params: GenerateParams, response_format: str = CHOICES) -> "GenerateRequest":
        """The wire request of ``prompts`` and `GenerateParams` (``max_new_tokens`` set)."""
        return cls(prompts=prompts, response_format=response_format, **dataclasses.asdict(params))

    def params(self) -> GenerateParams:
        """The request as `SamplingEngine.generate` / ``.validate`` take it (everything but the prompts and the
        response layout)."""
        return GenerateParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GenerateParams)})

    @property
    def prompt_tokens(self) -> int:
        """Tokens over all prompts, each prompt counted once (the response's ``usage.prompt_tokens``)."""
        return sum(len(p) for p in self.prompts)


def _normalise_prompts(prompts):
    """Packed arrays -> lists; a flat list of scalars -> one prompt (as vLLM accepts a single prompt).

    A list none of whose items is a list (or array) is one prompt, whatever the
    items are, so that a float or bool among the ids is reported as such by
    `validate_request` (not as "prompt[0] must be a list").
    """
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, list):
        prompts = [p.tolist() if isinstance(p, np.ndarray) else p for p in prompts]
        if prompts and not any(isinstance(p, (list, tuple)) for p in prompts):
            prompts = [prompts]
    return prompts


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _real(x) -> Optional[float]:
    """`x` as a float when it is a real number (int or float, not bool), else None (also for ints beyond float)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def _validate_prompts(prompts, *, vocab_size: int, max_prompt_length: int) -> list:
    """The prompts as a list of int lists; RequestError("prompt", ...) otherwise."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray):
        raise RequestError(PROMPT, f"must be a list of token-id lists, got {_kind(prompts)}")
    if len(prompts) == 0:
        raise RequestError(PROMPT, "is empty; need at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise RequestError(PROMPT, f"prompt[{i}] must be a list of token ids, got {_kind(p)}")
        p = list(p)
        if len(p) == 0:
            raise RequestError(PROMPT, f"prompt[{i}] is empty")
        if len(p) > max_prompt_length:
            raise RequestError(PROMPT, f"prompt[{i}] has {len(p)} tokens, longer than the context limit "
                               f"max_prompt_length={max_prompt_length}")
        for j, t in enumerate(p):
            if not _is_int(t):
                raise RequestError(PROMPT, f"prompt[{i}][{j}] is {_kind(t)}; token ids must be integers")
            if not 0 <= int(t) < vocab_size:
                raise RequestError(PROMPT,
                                   f"prompt[{i}] holds token id {int(t)} outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def validate_request(prompts, params: GenerateParams, *, vocab_size: int, max_prompt_length: int,
                     max_new_tokens_limit: int, max_stop_tokens: int, max_sequences: int = 4096) -> list:
    """Checks a generation request (``prompts`` and `GenerateParams`, whose ``max_new_tokens`` must be set: the engine
    resolves None to its limit); returns the prompts as a list of int lists.

    Raises:
      RequestError: naming the field by its wire name, for an empty prompt list or
        prompt, a prompt longer than `max_prompt_length`, a token id that is not
        an integer (a float or bool is named as such) or outside [0, vocab_size)
        (``prompt``), n <= 0, len(prompts) * n > max_sequences (``n``), temperature
        not a number (bools are not numbers here), < 0, non-finite or in
        (0, MIN_TEMPERATURE) (``temperature``), top_p not a number or outside
        (0, 1] (``top_p``), top_k outside [0, 2**31) (``top_k``),
        max_new_tokens outside [1, max_new_tokens_limit] (``max_tokens``),
        top_k_logprobs outside [0, vocab_size] (``logprobs``), more than
        `max_stop_tokens` stop ids or ids outside the vocabulary
        (``stop_token_ids``), a seed outside [0, 2**63) (``seed``), return_routing not a
        bool (``return_routing``), a first prompt index
        that is not an integer >= 0 or puts the last prompt's index at 2**32 or more
        (``first_prompt_index``: the engine keys draws by a uint32 prompt index).
    """
    out = _validate_prompts(prompts, vocab_size=vocab_size, max_prompt_length=max_prompt_length)
    n, temperature, max_new_tokens, top_k_logprobs = (params.n, params.temperature, params.max_new_tokens,
                                                      params.top_k_logprobs)
    stop_token_ids, seed, top_p, top_k = params.stop_token_ids, params.seed, params.top_p, params.top_k
    first_prompt_index, return_routing = params.first_prompt_index, params.return_routing
    if not isinstance(return_routing, (bool, np.bool_)):
        raise RequestError(RETURN_ROUTING, f"must be true or false, got {_kind(return_routing)}")
    if not _is_int(n) or n <= 0:
        raise RequestError(N, f"must be an integer >= 1, got {_kind(n)}")
    if len(out) * int(n) > max_sequences:
        raise RequestError(N, f"{len(out)} prompts x n={_show(n, 24)} sequences exceeds the limit "
                           f"of {max_sequences} per request")
    tau = _real(temperature)
    if tau is None or not math.isfinite(tau) or tau < 0:
        raise RequestError(TEMPERATURE, f"must be a finite number >= 0, got {_kind(temperature)}")
    if 0 < tau < MIN_TEMPERATURE:
        raise RequestError(TEMPERATURE, f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (logits / temperature "
                                        f"overflows float32 below that), got {temperature!r}")
    p = _real(top_p)
    if p is None:
        raise RequestError(TOP_P, f"must be a number in (0, 1], got {_kind(top_p)}")
    if not 0.0 < p <= 1.0:
        raise RequestError(TOP_P, f"must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or not 0 <= top_k <= MAX_INT32:
        raise RequestError(TOP_K, f"must be an integer in [0, 2**31) (0 = off), got {_kind(top_k)}")
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens <= max_new_tokens_limit:
        raise RequestError(MAX_TOKENS,
                           f"must be an integer in [1, {max_new_tokens_limit}], got {_kind(max_new_tokens)}")
    if not _is_int(top_k_logprobs) or not 0 <= top_k_logprobs <= vocab_size:
        raise RequestError(LOGPROBS, f"K must be an integer in [0, vocab_size={vocab_size}], "
                                     f"got {_kind(top_k_logprobs)}")
    stops = list(stop_token_ids or ())
    if len(stops) > max_stop_tokens:
        raise RequestError(STOP_TOKEN_IDS, f"at most {max_stop_tokens} stop ids, got {len(stops)}")
    for s in stops:
        if not _is_int(s) or not 0 <= int(s) < vocab_size:
            raise RequestError(STOP_TOKEN_IDS, f"id {_kind(s)} is not a token id in [0, {vocab_size})")
    if seed is not None and (not _is_int(seed) or not 0 <= int(seed) <= MAX_SEED):
        raise RequestError(SEED, f"must be an integer in [0, 2**63), got {_kind(seed)}")
    if not _is_int(first_prompt_index) or not 0 <= first_prompt_index <= 2 ** 32 - len(out):
        raise RequestError(FIRST_PROMPT_INDEX, f"must be an integer in [0, 2**32 - {len(out)} prompts], "
                                               f"got {_kind(first_prompt_index)}")
    return out


# ============================================================================= weights and health
@dataclasses.dataclass(frozen=True)
class LoadWeightsRequest:
    """A ``POST /v1/weights`` request: load the `save_weights` directory `path` as `version`."""

    path: Any
    version: Any

    @classmethod
    def from_wire(cls, body: Mapping) -> "LoadWeightsRequest":
        """Decodes and checks a request body.

        Raises:
          RequestError: an unknown field, ``path`` not a non-empty string of at most
            `MAX_PATH_LENGTH` characters without NUL, or ``version`` not an integer
            in [0, 2**31).
        """
        unknown = sorted(set(body) - {PATH, VERSION})
        if unknown:
            raise RequestError(unknown[0], f"unknown field(s) {_show(unknown)}")
        path, version = body.get(PATH), body.get(VERSION)
        if not isinstance(path, str) or not path:
            raise RequestError(PATH, f"must be a non-empty string, got {_kind(path)}")
        if len(path) > MAX_PATH_LENGTH or "\x00" in path:
            raise RequestError(PATH, f"must be at most {MAX_PATH_LENGTH} characters without NUL bytes, "
                                     f"got {_show(path)}")
        if not _is_int(version) or not 0 <= version <= MAX_INT32:
            raise RequestError(VERSION, f"must be an integer in [0, 2**31), got {_kind(version)}")
        return cls(path=path, version=version)

    def to_wire(self) -> dict:
        """The request body."""
        return {PATH: self.path, VERSION: self.version}
