"""`SamplerClient`: what the trainer uses to talk to the sampler service.

msgpack bodies (top-K tables as raw f32/int32 arrays; schema in ``pdm_jax.sampler.wire``), a deadline per attempt and
retries with exponential backoff on connection errors, timeouts, 429 and 5xx (`pdm_jax.rollouts.http.exchange`, which
caps the body size). A generation request always carries a seed, so a retry returns the same tokens. 4xx raises
`SamplerRequestError` (not retried); a 200 whose body is not a map, or is an error, raises `SamplerProtocolError`."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Optional, Sequence

import httpx

from pdm_jax.rollout import GenerateParams, RolloutBatch
from pdm_jax.rollouts import http as sampler_http
from pdm_jax.rollouts.http import SamplerError
from pdm_jax.sampler import wire, wire_codec, wire_request, wire_response
from pdm_jax.sampler.wire_response import response_to_batch  # re-exported: callers import it from here

__all__ = ["SamplerClient", "SamplerError", "SamplerRequestError", "SamplerResponseError", "response_to_batch"]


class SamplerResponseError(ValueError):
    """The sampler answered, but its rollouts do not answer the request (`pdm_jax.rollout.check_answers`), or its answer
    does not have the documented shape (`pdm_jax.rollouts.vllm_client.VLLMResponseError`)."""


class SamplerProtocolError(ValueError):
    """The sampler answered HTTP 2xx with a body that is no answer: not a map, or an error body."""


class SamplerRequestError(ValueError):
    """The sampler rejected a request (HTTP 4xx); ``status``, ``field`` and ``message`` say why."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.field = status, message, field


def generate_response_bytes(rows: int, max_new_tokens: int, k: int, prompt_len: int, *, routing: bool = False,
                            per_value: int = 16) -> int:
    """The most a generation answer for this request can need (bytes), with room to spare: ``per_value`` bytes (msgpack
    columns: 4-9; JSON: up to ~40) per generated id, log mu and top-K entry, 8 KiB per token of routed experts when
    ``routing``, plus 1 MiB of framing. The clients refuse a larger body (`pdm_jax.rollouts.http.exchange`): 0.5 MB of
    gzip on the wire can inflate to gigabytes."""
    per_token = (2 + 2 * k) * per_value + (8192 if routing else 0)  # routing: L x k entries (94 x 8 as JSON fits)
    tokens = rows * (max_new_tokens + (prompt_len if routing else 0))
    return (1 << 20) + tokens * per_token


class SamplerClient:
    """HTTP client of ``python -m pdm_jax.sampler.server``.

    Args:
      base_url: e.g. ``"http://127.0.0.1:8000"``.
      timeout_s: per-attempt deadline in seconds, from sending to the body's last byte.
      retries: extra attempts on connection errors, timeouts, 429 and 5xx; backoff_s: first backoff, doubling.
      token: shared bearer token (server ``--token``).
      transport: optional ``httpx`` transport (tests)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5,
                 token: Optional[str] = None, transport=None):
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"SamplerClient: need retries >= 0, timeout_s > 0, backoff_s >= 0; got "
                             f"retries={retries}, timeout_s={timeout_s}, backoff_s={backoff_s}")
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s, self.timeout_s = int(retries), float(backoff_s), float(timeout_s)
        headers = {"accept": wire_codec.MSGPACK}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport)
        self.retry_counts: dict = {}  # retries by cause ("429", "5xx", "transport"), `sampler_http.exchange`

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, payload=None, *, retries: Optional[int] = None,
                 max_response_bytes: int = sampler_http.SMALL_RESPONSE_BYTES) -> dict:
        """Sends `payload` (msgpack) and returns the decoded answer, retrying transient failures.

        Raises:
          SamplerRequestError: a 4xx answer (not retried).
          SamplerProtocolError: a 2xx whose body is not a map or is an error body; a redirect.
          SamplerError: connection errors, timeouts, 429 or 5xx on every attempt; a body over `max_response_bytes`."""
        content = None if payload is None else wire_codec.dumps(payload, msgpack=True)
        headers = {} if payload is None else {"content-type": wire_codec.MSGPACK}
        try:
            how = sampler_http.Exchanges(
                retries=self.retries if retries is None else retries, backoff_s=self.backoff_s,
                deadline_s=self.timeout_s, decode=self._decode, error_text=wire.error_detail,
                counts=self.retry_counts, sleep=time.sleep, base_url=self.base_url)
            status, body = sampler_http.exchange(self._http, method, path, how, max_response_bytes=max_response_bytes,
                                                 content=content, headers=headers)
        except sampler_http.SamplerRedirect as e:
            raise SamplerProtocolError(str(e)) from None
        if status >= 400:
            message, field = wire.decode_error(body)
            raise SamplerRequestError(status, message, field)
        if not isinstance(body, dict) or body.get(wire.ERROR) is not None:
            what = "an error body" if isinstance(body, dict) else f"a {type(body).__name__}, not a map"
            raise SamplerProtocolError(f"{method} {self.base_url}{path}: HTTP {status} with {what}: "
                                       f"{wire.decode_error(body)[0][:500]}")
        return body

    @staticmethod
    def _decode(r, content: bytes):
        try:
            return wire_codec.loads(content, msgpack=wire_codec.is_msgpack(r.headers.get("content-type")))
        except ValueError:
            return content.decode("utf-8", "replace")[:2000]

    def health(self, *, retries: Optional[int] = None) -> dict:
        """``GET /health``: {"status", "model", "quantization", "version", ...}."""
        return self._request("GET", "/health", retries=retries)

    def load_weights(self, path: str, version: int) -> dict:
        """``POST /v1/weights``; raises SamplerRequestError (403 outside root, 404 missing, 409 stale)."""
        return self._request("POST", "/v1/weights", wire_request.LoadWeightsRequest(str(path), int(version)).to_wire())

    def probe(self, timeout_s: float) -> bool:
        """One ``GET /health`` with its own timeout and no retry: True iff it answered HTTP 200 in time.

        The stall probe of `SamplerSupervisor`: safe to call from another thread while a long request (a generation) is
        in flight on this client.
        """
        try:
            return self._http.get("/health", timeout=timeout_s).status_code == 200
        except Exception:  # noqa: BLE001 - transport errors, timeouts, a closed client: all "no answer"
            return False

    @property
    def version(self) -> int:
        """The server's current weights version (one /health call)."""
        return int(self.health()[wire.VERSION])

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[GenerateParams] = None,
                 **fields) -> RolloutBatch:
        """``POST /v1/generate``; same arguments and result as `SamplingEngine.generate`.

        Raises:
          SamplerRequestError: the server rejected the request (names the field).
          SamplerResponseError: the answer does not have the documented shape
            (`wire_response.GenerateResponse.from_wire`: names the field, e.g. a negative per-row ``weights_version``).
          SamplerError: unreachable / 5xx after all retries.
        """
        p = GenerateParams.of(params, **fields)
        prompts = [[int(t) for t in q] for q in prompts]
        n, k, routing = int(p.n), int(p.top_k_logprobs), bool(p.return_routing)
        max_new_tokens = p.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = self.health().get(wire.MAX_NEW_TOKENS, wire.DEFAULT_MAX_TOKENS)
        p = dataclasses.replace(
            p, n=n, temperature=float(p.temperature), top_p=float(p.top_p), top_k=int(p.top_k), top_k_logprobs=k,
            stop_token_ids=[int(s) for s in p.stop_token_ids or ()], max_new_tokens=int(max_new_tokens),
            seed=int(p.seed) if p.seed is not None else secrets.randbelow(wire.MAX_SEED + 1),
            first_prompt_index=int(p.first_prompt_index), return_routing=routing)
        # "columns": one packed array per field, not ~4 per row (wire_response.GenerateResponse.to_wire; the same batch)
        request = wire_request.GenerateRequest.of(prompts, p, response_format="columns")
        body = self._request("POST", "/v1/generate", request.to_wire(),
                             max_response_bytes=generate_response_bytes(
                                 len(prompts) * n, p.max_new_tokens, k,
                                 max(len(q) for q in prompts) if prompts else 0, routing=routing))
        try:
            return wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=k, rows=len(prompts) * n,
                                                            max_new_tokens=p.max_new_tokens).batch
        except (KeyError, ValueError) as e:  # a missing field, a bad column or value (a negative weights version...)
            raise SamplerResponseError(f"POST /v1/generate: the answer does not have the documented shape: "
                                       f"{type(e).__name__}: {e}") from e
