"""`VLLMSampler`: rollouts from a vLLM / vLLM-TPU OpenAI-compatible server (``sampler.backend = "vllm"``).

The trainer's `SamplerSupervisor` uses it like `SamplerClient`: ``generate(...)`` returns a `RolloutBatch` meaning
what `SamplingEngine.generate`'s does, ``load_weights(path, version)`` makes the server sample from that version
(docs/sampler.md, "vLLM backend", has the server's flags).

Generation: one ``POST /v1/completions`` per prompt, sent concurrently, each with its own seed (`prompt_seed`), the
token-id prompt, ``stop_token_ids`` with ``ignore_eos: true``, ``logprobs: K``, ``return_tokens_as_token_ids: true``
(``"token_id:<id>"`` strings) and the penalties at their neutral values (`vllm_api.VLLM_NEUTRAL_SAMPLING`). Choice
``index = i * n + j`` is sample j of prompt i; each ``top_logprobs[t]`` holds the sampled token plus the K most
likely (its K largest, descending, are the top-K table); -inf comes as -9999.0 (`vllm_api.VLLM_MIN_LOGPROB`). The
server must run with ``--logprobs-mode processed_logprobs`` (log mu after temperature and top-k/top-p, as our
engine's): the default raw mode is the temperature-1 distribution (`VLLMSampler.check_logprobs_mode` refuses it).

Weights travel as files: `load_weights` writes a Hugging Face safetensors directory (``weights_dir/vNNNNNN``, renamed
into place) that the server must see under the same path, then ``POST /pause``, ``/collective_rpc`` (the workers'
``reload_weights``), ``/reset_prefix_cache`` and ``/resume`` (dev-mode routes, ``VLLM_SERVER_DEV_MODE=1``). Rows are
tagged with the version this client last loaded; `generate` and `load_weights` share one lock.

Errors: HTTP 4xx -> `SamplerRequestError` (not retried); connection errors, timeouts and 5xx are retried with
exponential backoff, then `SamplerError`; a 200 answer of another shape -> `VLLMResponseError` naming the field
(``choices[3].logprobs.token_logprobs[5]``) and the value. Tested against `pdm_jax.sampler.vllm_fake` (vLLM's
response shapes over our engine) and a recorded response, not a real vLLM."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional, Sequence

import httpx
import jax
import numpy as np
from flax import nnx

from pdm_jax import workdir as wd
from pdm_jax.models import hf_io
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rollout import GenerateParams, RolloutBatch, build_batch, right_pad_rows
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler import vllm_api, wire, wire_codec, wire_response
from pdm_jax.rollouts import http as sampler_http
from pdm_jax.rollouts.client import (SamplerError, SamplerProtocolError, SamplerRequestError, SamplerResponseError,
                                     generate_response_bytes)

log = logging.getLogger("pdm_jax.sampler")

__all__ = ["VLLMSampler", "VLLMResponseError", "completions_request", "parse_completions", "export_hf_weights",
           "parse_token_id", "prompt_seed"]


_MISSING = object()  # `VLLMSampler._request`'s answer for a 404 when the route is optional


class VLLMResponseError(SamplerResponseError):
    """A vLLM answer (HTTP 200) without the documented shape; ``field`` locates it (``choices[2].finish_reason``).

    A `pdm_jax.rollouts.client.SamplerResponseError` (a ValueError): the supervisor raises it as it is, unretried."""

    def __init__(self, field: str, message: str):
        super().__init__(f"vLLM response {field}: {message}")
        self.field = field


class VLLMLogprobsModeError(ValueError):
    """The vLLM server returns raw log-probabilities (``--logprobs-mode raw_logprobs``, vLLM's default)."""


class StaleVLLMWeightsError(ValueError):
    """A weights version older than the one the server already holds."""


# ============================================================================= request / response
def prompt_seed(seed: int, index: int, n: int) -> int:
    """The vLLM request seed for prompt `index` of a generation with seed `seed` and `n` samples per prompt.

    vLLM seeds sample j of a request with ``seed + j`` and every prompt of a request alike, so each prompt gets its
    own request seeded by a blake2b hash of ``(seed, index)`` in [0, 2**63 - n) (``seed + j`` stays an int64);
    deterministic."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63 - int(n))


def completions_request(prompts: Sequence[Sequence[int]], params: GenerateParams, *, model: str = "") -> dict:
    """The ``POST /v1/completions`` body (a JSON-serialisable dict) for a rollout request: ``prompts`` (token-id
    lists) and `GenerateParams` (``max_new_tokens`` and ``seed`` set; ``max_tokens``, ``logprobs`` = K; top_k 0 is
    sent as -1, vLLM's "off"); ``model``: the served model name ("" = omitted)."""
    top_k = int(params.top_k)
    body = {wire.PROMPT: [[int(t) for t in p] for p in prompts], wire.N: int(params.n),
            wire.TEMPERATURE: float(params.temperature), wire.TOP_P: float(params.top_p),
            wire.TOP_K: top_k if top_k > 0 else -1, wire.MAX_TOKENS: int(params.max_new_tokens),
            wire.STOP_TOKEN_IDS: [int(s) for s in params.stop_token_ids], vllm_api.IGNORE_EOS: True,
            wire.LOGPROBS: int(params.top_k_logprobs), vllm_api.RETURN_TOKENS_AS_TOKEN_IDS: True,
            wire.SEED: int(params.seed), vllm_api.ECHO: False, wire.STREAM: False, **vllm_api.VLLM_NEUTRAL_SAMPLING}
    if model:
        body[wire.MODEL] = model
    return body


#: The largest token id a `RolloutBatch` holds (its ids are int32).
MAX_TOKEN_ID = 2**31 - 1


def parse_token_id(token: Any, field: str) -> int:
    """The id of a ``"token_id:<id>"`` string (`vllm_api.TOKEN_ID_PREFIX`); VLLMResponseError otherwise."""
    if not isinstance(token, str) or not token.startswith(vllm_api.TOKEN_ID_PREFIX):
        raise VLLMResponseError(field,
                                f"is {wire_codec._show(token)}, not a 'token_id:<id>' string: the server ignored "
                                       f"{vllm_api.RETURN_TOKENS_AS_TOKEN_IDS}=true (or is not vLLM)")
    digits = token[len(vllm_api.TOKEN_ID_PREFIX):]
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 10:
        raise VLLMResponseError(field,
                                f"is {wire_codec._show(token)}: the id after 'token_id:' is not a non-negative integer")
    if int(digits) > MAX_TOKEN_ID:
        raise VLLMResponseError(field,
                                f"is {wire_codec._show(token)}: token id {int(digits)} is beyond {MAX_TOKEN_ID}, "
                                       f"the largest id a batch holds (int32)")
    return int(digits)


def _logprob(value: Any, field: str, *, allow_min: bool) -> float:
    """A log-probability from JSON: a finite number <= 0 (1e-4 rounding allowed); -9999 -> -inf if `allow_min`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise VLLMResponseError(field, f"is {wire_codec._kind(value)}, not a number")
    v = float(value)
    if not math.isfinite(v):
        raise VLLMResponseError(field, f"is {v}, not a finite log-probability")
    if v > 1e-4:
        raise VLLMResponseError(field, f"is {v} > 0, not a log-probability")
    if v <= vllm_api.VLLM_MIN_LOGPROB:
        if not allow_min:
            raise VLLMResponseError(field, f"is {v}: vLLM's -inf, but a sampled token must have a finite "
                                           f"log-probability (is the server's --logprobs-mode processed_logprobs?)")
        return -math.inf
    return min(v, 0.0)


def _get(obj: Any, key: str, field: str, kind: type, what: str):
    if not isinstance(obj, Mapping):
        raise VLLMResponseError(field.rsplit(".", 1)[0] or "$", f"is {wire_codec._kind(obj)}, not an object")
    if key not in obj or obj[key] is None:
        raise VLLMResponseError(field, f"is missing ({what})")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise VLLMResponseError(field, f"is {wire_codec._kind(value)}, not {what}")
    return value


def _parse_choice(c: Any, at: str, *, k: int, max_new_tokens: int, stops: set) -> tuple:
    """``(ids, sampled log-probs [T], top-K ids [T, K], top-K log-probs [T, K], finish reason)`` of one choice
    (`parse_completions`; `at` is its location, ``choices[r]``)."""
    lp = _get(c, wire.LOGPROBS, f"{at}.logprobs", Mapping, "an object (the request asked for logprobs)")
    tokens = _get(lp, vllm_api.TOKENS, f"{at}.logprobs.tokens", list, "a list")
    token_lp = _get(lp, vllm_api.TOKEN_LOGPROBS, f"{at}.logprobs.token_logprobs", list, "a list")
    top = _get(lp, wire.TOP_LOGPROBS, f"{at}.logprobs.top_logprobs", list, "a list")
    t_r = len(tokens)
    if not 1 <= t_r <= max_new_tokens:
        raise VLLMResponseError(f"{at}.logprobs.tokens", f"has {t_r} tokens; 1..max_tokens={max_new_tokens} "
                                                         f"expected")
    for name, lst in ((vllm_api.TOKEN_LOGPROBS, token_lp), (wire.TOP_LOGPROBS, top)):
        if len(lst) != t_r:
            raise VLLMResponseError(f"{at}.logprobs.{name}", f"has {len(lst)} entries for {t_r} tokens")
    ids = [parse_token_id(tok, f"{at}.logprobs.tokens[{t}]") for t, tok in enumerate(tokens)]
    if c.get(wire.TOKEN_IDS) is not None and list(c[wire.TOKEN_IDS]) != ids:
        raise VLLMResponseError(f"{at}.token_ids", f"{wire_codec._show(c[wire.TOKEN_IDS])} disagrees with "
                                                   f"logprobs.tokens {wire_codec._show(ids)}")
    sampled = np.array([_logprob(v, f"{at}.logprobs.token_logprobs[{t}]", allow_min=False)
                        for t, v in enumerate(token_lp)], np.float32)
    tk_ids = np.zeros((t_r, k), np.int32)
    tk_lp = np.zeros((t_r, k), np.float32)
    for t, entry in enumerate(top):
        where = f"{at}.logprobs.top_logprobs[{t}]"
        if not isinstance(entry, Mapping):
            raise VLLMResponseError(where, f"is {wire_codec._kind(entry)}, not an object")
        table = {}
        for key, v in entry.items():
            tid = parse_token_id(key, f"{where} key {key!r}")
            if tid in table:  # "token_id:7" and "token_id:07": one token, two values
                raise VLLMResponseError(where, f"names token {tid} twice (key {key!r}); each token once expected")
            table[tid] = _logprob(v, f"{where}[{key!r}]", allow_min=True)
        if ids[t] not in table:
            raise VLLMResponseError(where, f"lacks the sampled token {ids[t]} (vLLM always includes it)")
        if abs(table[ids[t]] - float(sampled[t])) > 1e-5:
            raise VLLMResponseError(where, f"gives the sampled token {ids[t]} log-probability {table[ids[t]]}, "
                                           f"token_logprobs[{t}] says {float(sampled[t])}")
        if len(table) < k:
            raise VLLMResponseError(where, f"has {len(table)} entries; K = logprobs = {k} requested (is the "
                                           f"server's --max-logprobs smaller?)")
        best = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        tk_ids[t] = [i for i, _ in best]
        tk_lp[t] = [v for _, v in best]
    reason = c.get(wire.FINISH_REASON)
    if reason not in ("stop", "length"):
        raise VLLMResponseError(f"{at}.finish_reason", f"is {wire_codec._show(reason)}, not 'stop' or 'length'")
    early = [t for t in range(t_r - 1) if ids[t] in stops]
    if early:
        raise VLLMResponseError(f"{at}.logprobs.tokens[{early[0]}]", f"is stop id {ids[early[0]]} before the "
                                                                      f"end of the completion")
    if reason == "stop" and ids[-1] not in stops:
        raise VLLMResponseError(f"{at}.finish_reason", f"is 'stop' but the last token {ids[-1]} is not one of the "
                                                       f"stop ids {sorted(stops)} (a stop string, or the server "
                                                       f"dropped the stop token?)")
    return ids, sampled, tk_ids, tk_lp, reason


def parse_completions(body: Any, prompts: Sequence[Sequence[int]], *, n: int, top_k_logprobs: int,
                      max_new_tokens: int, stop_token_ids: Sequence[int], version: int) -> RolloutBatch:
    """The `RolloutBatch` of a ``/v1/completions`` answer to `completions_request`.

    Args:
      body: the decoded JSON body.
      prompts, n, top_k_logprobs (K), max_new_tokens, stop_token_ids: those of the request.
      version: the weights version the server held (every row's ``weights_version``).
    Returns:
      N = len(prompts) * n rows, prompt-major (``group_ids`` = i); prompts left-padded; completions [N, T]
      right-padded to T = max(1, longest) (id 0, mask False, log-prob 0); behavior_logprobs = token_logprobs;
      topk_ids / topk_logprobs [N, T, K] the K largest of ``top_logprobs[t]``, descending (ties: smaller id first),
      -9999.0 as -inf.
    Raises:
      VLLMResponseError: naming the field: a body that is not an object or carries ``error``; ``choices`` not N
        objects with indices 0..N-1; missing or inconsistent ``logprobs`` lists (empty, of different lengths, over
        max_new_tokens); a token not ``"token_id:<id>"``; ``token_ids`` disagreeing with ``tokens``; a
        log-probability not finite and <= 0; a top-K entry without the sampled token, disagreeing with it, or with
        fewer than K entries; ``finish_reason`` not "stop"/"length"; "stop" not ending on a stop id, or a stop id
        before the last token."""
    n_prompts, n, k = len(prompts), int(n), int(top_k_logprobs)
    stops = {int(s) for s in stop_token_ids}
    if not isinstance(body, Mapping):
        raise VLLMResponseError("$", f"is {wire_codec._kind(body)}, not a JSON object")
    if body.get(wire.ERROR) is not None:
        raise VLLMResponseError(wire.ERROR, f"the server answered an error: {wire_codec._show(body[wire.ERROR], 500)}")
    obj = body.get(wire.OBJECT)
    if obj is not None and obj != wire.TEXT_COMPLETION:
        raise VLLMResponseError(wire.OBJECT, f"is {wire_codec._show(obj)}, not {wire.TEXT_COMPLETION!r}")
    choices = _get(body, wire.CHOICES, wire.CHOICES, list, "a list")
    n_rows = n_prompts * n
    if len(choices) != n_rows:
        raise VLLMResponseError(wire.CHOICES, f"has {len(choices)} entries; {n_prompts} prompts x n={n} = {n_rows} "
                                              f"expected")
    by_index: dict = {}
    for pos, c in enumerate(choices):
        idx = _get(c, wire.INDEX, f"choices[{pos}].index", int, "an integer")
        if not 0 <= idx < n_rows or idx in by_index:
            raise VLLMResponseError(f"choices[{pos}].index", f"is {idx}: indices must be 0..{n_rows - 1}, each once")
        by_index[idx] = c
    rows = [_parse_choice(by_index[r], f"choices[{r}]", k=k, max_new_tokens=max_new_tokens, stops=stops)
            for r in range(n_rows)]
    t_in = max(1, max(len(row[0]) for row in rows))
    return build_batch(
        prompts, group_ids=np.arange(n_rows) // n, lengths=[len(row[0]) for row in rows],
        completion_ids=right_pad_rows([row[0] for row in rows], t_in, dtype=np.int32),
        behavior_logprobs=right_pad_rows([row[1] for row in rows], t_in),
        topk_ids=right_pad_rows([row[2] for row in rows], t_in, dtype=np.int32),
        topk_logprobs=right_pad_rows([row[3] for row in rows], t_in),
        weights_version=int(version), finish_reason=np.array([row[4] for row in rows], dtype=object))


# ============================================================================= weights
def export_hf_weights(params: Mapping, model_config, path: str, *, template=None) -> str:
    """Writes pure-dict `params` of a ``Qwen3Config`` model as a Hugging Face directory at `path` (``config.json`` +
    ``model.safetensors``, `hf_io.save_pretrained`, bit-exact), under ``path + ".tmp"`` renamed into place; an
    existing `path` is replaced. `template`: an abstract model (``nnx.eval_shape`` of ``Qwen3ForCausalLM``) reused
    across calls.

    Raises:
      ValueError: `params` do not fit the model's structure.
      pdm_jax.workdir.RunWriteError: a file cannot be written (ENOSPC...), naming `path`; no temporary is left."""
    abstract = template if template is not None else nnx.eval_shape(
        lambda: Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(0)))
    params_state = nnx.state(abstract, nnx.Param)
    want = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params_state))[0]
    try:
        got = jax.tree_util.tree_flatten_with_path(dict(params))[0]
        if [p for p, _ in got] != [p for p, _ in want]:
            raise ValueError(f"parameter names differ: {len(got)} given, {len(want)} in the model")
        bad = [(jax.tree_util.keystr(p), np.shape(g), tuple(w.shape)) for (p, g), (_, w) in zip(got, want)
               if tuple(np.shape(g)) != tuple(w.shape)]
        if bad:
            raise ValueError(f"{bad[0][0]} has shape {bad[0][1]}, the model's is {bad[0][2]}")
        nnx.replace_by_pure_dict(params_state, dict(params))
    except Exception as e:  # noqa: BLE001 - any mismatch of names, nesting or shapes
        raise ValueError(f"weights do not match the model structure: {type(e).__name__}: {e}") from e
    nnx.update(abstract, params_state)
    path = os.path.normpath(path)  # "v1/" is "v1": its temporary is beside it, never inside it
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with wd.naming_write_errors(path):  # a full disk (safetensors' own error too): RunWriteError naming the directory
        try:
            hf_io.save_pretrained(abstract, tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # no temporary left, whatever failed
            raise
    return path


# ============================================================================= the client
class VLLMSampler:
    """Rollouts and weight pushes through a vLLM OpenAI-compatible server.

    Args:
      base_url: the server, e.g. ``"http://10.0.0.5:8000"``.
      model_config: the ``Qwen3Config`` of the trained model (weights export).
      weights_dir: directory for the weight versions (``vNNNNNN``), seen by the server under the same path.
      model: served model name ("" = the first id of ``GET /v1/models``).
      timeout_s: per-request timeout (s); retries: extra attempts on connection errors, timeouts and 5xx; backoff_s:
        first backoff (s), doubling.
      token: bearer token (``vllm serve --api-key``), or None.
      transport: optional ``httpx`` transport (tests).
      max_concurrent_requests: most requests in flight at once (one per prompt).

    Raises:
      ValueError: retries < 0, timeout_s <= 0 or backoff_s < 0."""

    def __init__(self, base_url: str, *, model_config, weights_dir: str, model: str = "", timeout_s: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, token: Optional[str] = None, transport=None,
                 max_concurrent_requests: int = 64):
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"VLLMSampler: need retries >= 0, timeout_s > 0, backoff_s >= 0; got retries={retries}, "
                             f"timeout_s={timeout_s}, backoff_s={backoff_s}")
        self.base_url = base_url.rstrip("/")
        self.model_config = model_config
        self.weights_dir = os.path.abspath(weights_dir)
        self.model = model
        self.retries, self.backoff_s, self.timeout_s = int(retries), float(backoff_s), float(timeout_s)
        self.retry_counts: dict = {}  # retries by cause ("429", "5xx", "transport"), `sampler_http.exchange`
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport)
        self._lock = threading.RLock()
        self._version: Optional[int] = None
        self._template = self._abstract = None
        self.max_concurrent_requests = int(max_concurrent_requests)
        self.last_load_seconds = {"export": 0.0, "reload": 0.0}

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, *, json_body=None, params=None, retries: Optional[int] = None,
                 missing_ok: bool = False, max_response_bytes: int = sampler_http.SMALL_RESPONSE_BYTES):
        """One JSON request with retries (`sampler_http.exchange`); the decoded body (None for an empty one).

        Raises:
          SamplerRequestError: a 4xx answer (vLLM's message and ``param``), not retried; a 404 returns `_MISSING`
            instead when `missing_ok`.
          SamplerProtocolError: a redirect, or a 2xx carrying an ``error`` object.
          SamplerError: connection errors, timeouts, 429 or 5xx on every attempt; a body over `max_response_bytes`."""
        try:
            how = sampler_http.Exchanges(
                retries=self.retries if retries is None else retries, backoff_s=self.backoff_s,
                deadline_s=self.timeout_s, decode=self._decode, error_text=lambda b: self._message(b)[0],
                counts=self.retry_counts, sleep=time.sleep, base_url=self.base_url)
            status, body = sampler_http.exchange(self._http, method, path, how, max_response_bytes=max_response_bytes,
                                                 json=json_body, params=params)
        except sampler_http.SamplerRedirect as e:
            raise SamplerProtocolError(str(e)) from None
        if status == 404 and missing_ok:
            return _MISSING
        if status >= 400:
            message, field = self._message(body)
            raise SamplerRequestError(status, f"{method} {path}: {message}", field)
        if isinstance(body, Mapping) and body.get(wire.ERROR) is not None:
            raise SamplerProtocolError(f"{method} {self.base_url}{path}: HTTP {status} with an error body: "
                                       f"{self._message(body)[0][:500]}")
        return body

    @staticmethod
    def _decode(r, content: bytes):
        """JSON with the wire codec's depth and size limits (a body nested 100,000 deep is text, not a RecursionError);
        empty -> None; not JSON -> its text (2,000 characters at most). A 2xx body in which an object repeats a key
        (which JSON parsers resolve silently to the last value) -> VLLMResponseError."""
        if not content:
            return None
        try:
            return wire_codec.loads(content, msgpack=False, unique_keys=r.is_success)
        except wire_codec.DuplicateKeyError as e:  # json would keep the last value silently (a top_logprobs entry...)
            raise VLLMResponseError("$", f"{e}; every JSON object's keys must be distinct") from None
        except ValueError:
            return content.decode("utf-8", "replace")[:2000]

    @staticmethod
    def _message(body) -> tuple:
        """``(message, field)`` of a vLLM / FastAPI error body (``{"error": {...}}``, ``{"message"}``,
        ``{"detail"}``)."""
        if isinstance(body, Mapping):
            err = body.get(wire.ERROR) if isinstance(body.get(wire.ERROR), Mapping) else body
            message = err.get(wire.MESSAGE) or err.get("detail") or body.get(wire.ERROR) or body
            return str(message)[:2000], err.get("param")
        return str(body)[:2000], None

    # ------------------------------------------------------------------ the sampler interface
    def health(self, *, retries: Optional[int] = None) -> dict:
        """``GET /health`` and ``GET /v1/models``: ``{"status": "ok", "model", "version", "models"}``; SamplerError /
        SamplerRequestError when the server does not answer or lists no model."""
        self._request("GET", vllm_api.VLLM_HEALTH, retries=retries)
        listed = self._request("GET", vllm_api.VLLM_MODELS, retries=retries)
        if not isinstance(listed, Mapping) or not isinstance(listed.get(vllm_api.DATA, []), list):
            raise SamplerProtocolError(f"GET {self.base_url}{vllm_api.VLLM_MODELS}: not a model list: "
                                       f"{wire_codec._show(listed, 300)}")
        ids = [m.get(vllm_api.ID) for m in listed.get(vllm_api.DATA, []) if isinstance(m, Mapping)]
        if not self.model:
            if not ids:
                raise SamplerError(f"GET {self.base_url}{vllm_api.VLLM_MODELS} lists no model: "
                                   f"{wire_codec._show(listed, 300)}")
            self.model = str(ids[0])
        return {wire.STATUS: wire.OK, wire.MODEL: self.model, wire.VERSION: self._version, "models": ids}

    def probe(self, timeout_s: float) -> bool:
        """One ``GET /health`` with its own timeout and no retry: True iff HTTP 200 (the supervisor's stall probe)."""
        try:
            return self._http.get(vllm_api.VLLM_HEALTH, timeout=timeout_s).status_code == 200
        except Exception:  # noqa: BLE001 - transport errors, timeouts, a closed client: all "no answer"
            return False

    @property
    def version(self) -> Optional[int]:
        """The weights version this client last had the server load (None before the first)."""
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[GenerateParams] = None,
                 **fields) -> RolloutBatch:
        """Rollouts for `prompts`; same arguments and result as `SamplingEngine.generate`.

        One request per prompt (seeded by `prompt_seed` of ``first_prompt_index + i``: per-host rollouts draw what
        the whole batch would), concatenated in prompt order.

        Raises:
          SamplerRequestError: the server refused the request (4xx).
          SamplerError: unreachable / 5xx after all retries.
          VLLMResponseError: the answer does not have the documented shape (naming the field).
          ValueError: no weights version loaded yet, or ``return_routing`` (vLLM returns no routing)."""
        params = GenerateParams.of(params, **fields)
        if params.return_routing:
            raise ValueError("VLLMSampler.generate: return_routing=True: vLLM returns no expert routing")
        n, top_k_logprobs = int(params.n), int(params.top_k_logprobs)
        max_new = wire.DEFAULT_MAX_TOKENS if params.max_new_tokens is None else int(params.max_new_tokens)
        seed = secrets.randbelow(wire.MAX_SEED + 1) if params.seed is None else int(params.seed)
        prompts = [[int(t) for t in p] for p in prompts]
        stops = [int(s) for s in params.stop_token_ids or ()]
        base = dataclasses.replace(params, max_new_tokens=max_new, stop_token_ids=stops)
        bodies = [completions_request([p], dataclasses.replace(
                      base, seed=prompt_seed(seed, int(params.first_prompt_index) + i, n)), model=self.model)
                  for i, p in enumerate(prompts)]
        cap = generate_response_bytes(int(n), max_new, int(top_k_logprobs), max((len(p) for p in prompts), default=0),
                                      per_value=64)  # JSON text: "token_id:123": -1.234..., per entry
        post = functools.partial(self._request, "POST", vllm_api.VLLM_COMPLETIONS, max_response_bytes=cap)
        with self._lock:
            if self._version is None:
                raise ValueError("VLLMSampler.generate: no weights version loaded yet (load_weights first)")
            version = self._version
            with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), self.max_concurrent_requests))) as pool:
                answers = list(pool.map(lambda body: post(json_body=body), bodies))
        batches = []
        for i, (p, answer) in enumerate(zip(prompts, answers)):
            try:
                batches.append(parse_completions(answer, [p], n=n, top_k_logprobs=top_k_logprobs,
                                                 max_new_tokens=max_new, stop_token_ids=stops, version=version))
            except VLLMResponseError as e:
                raise VLLMResponseError(e.field, f"{str(e).split(': ', 1)[1]} (the request for prompt {i})") from e
        return RolloutBatch.concatenate(batches)

    def hf_path(self, version: int) -> str:
        """The Hugging Face directory of weights version `version` (``weights_dir/vNNNNNN``)."""
        return os.path.join(self.weights_dir, f"v{int(version):06d}")

    def load_weights(self, path: str, version: int) -> dict:
        """Has the server reload weights version `version` (our `save_weights` directory `path`): export
        (`export_hf_weights`), pause, reload, reset the prefix cache, resume; keeps this and the previous version's
        directories. Returns ``{"version", "path", "seconds", "reloaded"}``; `last_load_seconds` holds ``{"export",
        "reload"}``.

        Raises:
          StaleVLLMWeightsError: `version` is older than the loaded one.
          WeightsError: `path` is missing, damaged or holds another version.
          SamplerRequestError: the server refused a route (404 for ``/collective_rpc``: start it with
            ``VLLM_SERVER_DEV_MODE=1``) or the reload (4xx).
          SamplerError: unreachable / 5xx after all retries."""
        with self._lock:
            if self._version is not None and int(version) < self._version:
                raise StaleVLLMWeightsError(f"stale weights version {version}: the vLLM server holds version "
                                            f"{self._version}")
            t0 = time.perf_counter()
            if self._template is None:  # built once: the abstract parameter tree and a model to fill
                self._template = nnx.eval_shape(lambda: Qwen3ForCausalLM(self.model_config, rngs=nnx.Rngs(0)))
                self._abstract = wts.abstract_params(self.model_config)
            pure = wts.load_weights(path, abstract=self._abstract, version=int(version))
            target = export_hf_weights(pure, self.model_config, self.hf_path(version), template=self._template)
            t1 = time.perf_counter()
            pause = {"mode": "wait", "wait_for_inflight_requests": "true", "clear_cache": "true"}
            paused = self._request("POST", vllm_api.VLLM_PAUSE, params=pause, missing_ok=True)
            try:
                self._request("POST", vllm_api.VLLM_COLLECTIVE_RPC, json_body={
                    "method": vllm_api.VLLM_RELOAD_METHOD, "kwargs": {vllm_api.VLLM_WEIGHTS_PATH: target}})
                self._request("POST", vllm_api.VLLM_RESET_PREFIX_CACHE)
            finally:
                if paused is not _MISSING:
                    self._request("POST", vllm_api.VLLM_RESUME)
            previous, self._version = self._version, int(version)
            self.last_load_seconds = {"export": t1 - t0, "reload": time.perf_counter() - t1}
            keep = {os.path.basename(self.hf_path(v)) for v in (version, previous) if v is not None}
            for name in os.listdir(self.weights_dir):
                if name.startswith("v") and name not in keep:
                    shutil.rmtree(os.path.join(self.weights_dir, name), ignore_errors=True)
            if previous is None:  # the first version on this server: is it returning what the ratios need?
                self.check_logprobs_mode()
            return wire_response.weights_loaded(version=int(version), path=target, seconds=time.perf_counter() - t0,
                                       reloaded=previous == int(version))

    def check_logprobs_mode(self, prompt: Sequence[int] = (0,)) -> None:
        """Refuses a server started without ``--logprobs-mode processed_logprobs``: one token of `prompt` at
        temperatures 0.5 and 1.0 has different processed top-1 log-probabilities but equal raw ones. Skipped with a
        warning when the token is near-certain (log-probability above -1e-3).

        Raises:
          VLLMLogprobsModeError: the server returns raw log-probabilities."""
        top = []
        for tau in (0.5, 1.0):
            body = completions_request([list(prompt)], GenerateParams(n=1, temperature=tau, max_new_tokens=1,
                                                                      top_k_logprobs=1, seed=0), model=self.model)
            answer = self._request("POST", vllm_api.VLLM_COMPLETIONS, json_body=body)
            try:
                entry = answer[wire.CHOICES][0][wire.LOGPROBS][wire.TOP_LOGPROBS][0]
                top.append(max(float(v) for v in entry.values()))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                raise VLLMResponseError(wire.CHOICES, f"the logprobs-mode probe got no top-1 log-probability "
                                                      f"({type(e).__name__}: {e})") from None
        if top[1] > -1e-3:
            log.warning("cannot tell vLLM's --logprobs-mode from the probe (the top-1 token is near-certain: "
                        "log-probability %.2g); make sure the server runs with --logprobs-mode processed_logprobs",
                        top[1])
        elif abs(top[0] - top[1]) < 1e-6:
            raise VLLMLogprobsModeError(
                f"the vLLM server at {self.base_url} returns raw log-probabilities (the same top-1 log-probability "
                f"{top[1]:.6f} at temperatures 0.5 and 1.0): restart it with --logprobs-mode processed_logprobs; "
                "with raw ones the trust-region ratios compare the policy at the sampling temperature with the "
                "distribution at temperature 1 (docs/sampler.md, vLLM backend)")


def main(argv=None) -> None:
    """``python -m pdm_jax.rollouts.vllm_client --model_config CONFIG_JSON --out DIR [--weights WEIGHTS_DIR]``.

    Writes a Hugging Face directory for a vLLM server to start from: the `save_weights` directory ``--weights``, or a
    random initialisation (seed 0), which the trainer replaces with version 0 before the first rollout."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m pdm_jax.rollouts.vllm_client", description=main.__doc__.split("\n")[0])
    p.add_argument("--model_config", required=True,
                   help="the model's Hugging Face config.json (WORKDIR/model/config.json)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--weights", default=None, help="a save_weights directory; omit for a random init")
    args = p.parse_args(argv)
    with open(args.model_config) as f:
        config = Qwen3Config.from_hf_dict(json.load(f))
    if args.weights:
        params = wts.load_weights(args.weights, config)
    else:
        params = wts.to_pure_dict(nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)), nnx.Param))
    print(export_hf_weights(params, config, os.path.abspath(args.out)))


if __name__ == "__main__":
    main()
