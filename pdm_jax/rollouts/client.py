"""`SamplerClient`: what the trainer uses to talk to the sampler service.

Speaks msgpack (top-K tables travel as raw f32/int32 arrays; schema in
``pdm_jax.sampler.wire``), with a per-request timeout and retries with
exponential backoff on connection errors, timeouts and 5xx answers.  A
generation request always carries a seed (drawn here when the caller gives
none), so a retried request returns the same tokens.  4xx answers are not
retried: they raise `SamplerRequestError` with the server's message.
"""

from __future__ import annotations

import secrets
import time
from typing import Optional, Sequence

import httpx

from pdm_jax.rollout import RolloutBatch
from pdm_jax.sampler import wire
from pdm_jax.sampler.wire import response_to_batch  # re-exported: callers import it from here

__all__ = ["SamplerClient", "SamplerError", "SamplerRequestError", "response_to_batch"]


class SamplerError(RuntimeError):
    """The sampler could not be reached or kept failing (after all retries)."""


class SamplerRequestError(ValueError):
    """The sampler rejected a request (HTTP 4xx); ``status``, ``field`` and ``message`` say why."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.field = status, message, field


class SamplerClient:
    """HTTP client of ``python -m pdm_jax.sampler.server``.

    Args:
      base_url: e.g. ``"http://127.0.0.1:8000"``.
      timeout_s: per-request timeout in seconds (generation included).
      retries: extra attempts after the first on connection errors, timeouts, 5xx.
      backoff_s: first backoff; doubles per retry.
      token: shared bearer token when the server was started with ``--token``.
      transport: optional ``httpx`` transport (tests: ``httpx.MockTransport``).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5,
                 token: Optional[str] = None, transport=None):
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"SamplerClient: need retries >= 0, timeout_s > 0, backoff_s >= 0; got "
                             f"retries={retries}, timeout_s={timeout_s}, backoff_s={backoff_s}")
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s, self.timeout_s = int(retries), float(backoff_s), float(timeout_s)
        headers = {"accept": wire.MSGPACK}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport)

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, payload=None, *, retries: Optional[int] = None) -> dict:
        """Sends `payload` (a dict, msgpack-encoded) and returns the decoded answer, retrying transient failures.

        Raises:
          SamplerRequestError: a 4xx answer (not retried).
          SamplerError: connection errors, timeouts or 5xx answers on every attempt.
        """
        retries = self.retries if retries is None else retries
        content = None if payload is None else wire.dumps(payload, msgpack=True)
        headers = {} if payload is None else {"content-type": wire.MSGPACK}
        last = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self._http.request(method, path, content=content, headers=headers)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            body = self._decode(r)
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}: {wire.error_detail(body)}"
                continue
            if r.status_code >= 400:
                message, field = wire.decode_error(body)
                raise SamplerRequestError(r.status_code, message, field)
            return body
        raise SamplerError(f"{method} {self.base_url}{path} failed after {retries + 1} attempt(s): {last}")

    @staticmethod
    def _decode(r):
        try:
            return wire.loads(r.content, msgpack=wire.is_msgpack(r.headers.get("content-type")))
        except ValueError:
            return r.text

    def health(self, *, retries: Optional[int] = None) -> dict:
        """``GET /health``: {"status", "model", "quantization", "version", ...}."""
        return self._request("GET", "/health", retries=retries)

    def load_weights(self, path: str, version: int) -> dict:
        """``POST /v1/weights``; raises SamplerRequestError (403 outside root, 404 missing, 409 stale)."""
        return self._request("POST", "/v1/weights", wire.LoadWeightsRequest(str(path), int(version)).to_wire())

    def probe(self, timeout_s: float) -> bool:
        """One ``GET /health`` with its own timeout and no retry: True iff it answered HTTP 200 in time.

        The stall probe of `SamplerSupervisor`: safe to call from another thread
        while a long request (a generation) is in flight on this client.
        """
        try:
            return self._http.get("/health", timeout=timeout_s).status_code == 200
        except Exception:  # noqa: BLE001 - transport errors, timeouts, a closed client: all "no answer"
            return False

    @property
    def version(self) -> int:
        """The server's current weights version (one /health call)."""
        return int(self.health()[wire.VERSION])

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, temperature: float = 1.0,
                 max_new_tokens: Optional[int] = None, top_k_logprobs: int = 20,
                 stop_token_ids: Sequence[int] = (), seed: Optional[int] = None, top_p: float = 1.0,
                 top_k: int = 0, first_prompt_index: int = 0, return_routing: bool = False) -> RolloutBatch:
        """``POST /v1/generate``; same arguments and result as `SamplingEngine.generate`.

        Raises:
          SamplerRequestError: the server rejected the request (names the field).
          SamplerError: unreachable / 5xx after all retries.
        """
        prompts = [[int(t) for t in p] for p in prompts]
        fields = dict(n=int(n), temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                      top_k_logprobs=int(top_k_logprobs), stop_token_ids=[int(s) for s in stop_token_ids or ()],
                      seed=int(seed) if seed is not None else secrets.randbelow(wire.MAX_SEED + 1),
                      first_prompt_index=int(first_prompt_index))
        if max_new_tokens is None:
            max_new_tokens = self.health().get(wire.MAX_NEW_TOKENS, wire.DEFAULT_MAX_TOKENS)
        # "columns": one packed array per field, not ~4 per row (wire.GenerateResponse.to_wire; the same batch)
        request = wire.GenerateRequest(prompts=prompts, max_new_tokens=int(max_new_tokens),
                                       return_routing=bool(return_routing), response_format="columns", **fields)
        body = self._request("POST", "/v1/generate", request.to_wire())
        return wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=int(top_k_logprobs)).batch
