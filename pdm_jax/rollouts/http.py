"""One HTTP exchange with a sampler, for both clients (`client.SamplerClient`, `vllm_client.VLLMSampler`): retries, a
deadline per attempt, a cap on what a body may grow to.

A response is read as a stream and refused once its decoded bytes pass ``max_response_bytes`` or its attempt passes
``deadline_s``; a redirect is refused; 429 (honouring a ``Retry-After`` up to `MAX_RETRY_AFTER_S`), connection
errors, timeouts and 5xx are retried with backoff, each retry counted by cause in ``counts``."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import httpx

#: The longest ``Retry-After`` honoured (seconds); longer asks wait this long.
MAX_RETRY_AFTER_S = 30.0
#: What a body of a call with no larger need (health, weights, control routes) may hold (bytes).
SMALL_RESPONSE_BYTES = 1 << 20


class SamplerError(RuntimeError):
    """The sampler could not be reached or kept failing (after all retries). Re-exported by `pdm_jax.rollouts.client`,
    where callers import it from."""


class ResponseTooLarge(Exception):
    """A response body grew past the client's cap (`exchange`)."""


class SamplerRedirect(ValueError):
    """A sampler answered a redirect (3xx): a proxy or a wrong address; refused, never followed."""


def _retry_after(r: httpx.Response) -> Optional[float]:
    raw = r.headers.get("retry-after")
    try:
        return min(max(float(raw), 0.0), MAX_RETRY_AFTER_S) if raw is not None else None
    except ValueError:  # an HTTP date or garbage: the client's own backoff
        return None


def _read(r: httpx.Response, *, max_bytes: int, deadline: float) -> bytes:
    """The decoded body, chunk by chunk, within `max_bytes` and before `deadline` (time.monotonic)."""
    chunks, total = [], 0
    for chunk in r.iter_bytes():
        total += len(chunk)
        if total > max_bytes:
            raise ResponseTooLarge(f"response body larger than {max_bytes} bytes (decoded); refused")
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("response not complete within the request deadline")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclasses.dataclass(frozen=True)
class Exchanges:
    """How a client exchanges requests (`exchange`): ``retries`` extra attempts after the first; ``backoff_s`` the
    first wait, doubling per retry; ``deadline_s`` the most one attempt may take, from sending to the body's last byte
    (seconds); ``decode``: ``(response, body bytes) -> body`` (a map, a string, ...); ``error_text``: a decoded error
    body -> its message; ``counts``: a dict whose ``"429"``, ``"5xx"`` and ``"transport"`` entries count the retries
    by cause; ``sleep`` (tests record it); ``base_url``: named in the messages."""

    retries: int
    backoff_s: float
    deadline_s: float
    decode: Callable[[httpx.Response, bytes], object]
    error_text: Callable[[object], str]
    counts: Optional[dict] = None
    sleep: Callable[[float], None] = time.sleep
    base_url: str = ""


def exchange(http: httpx.Client, method: str, path: str, how: Exchanges, *, max_response_bytes: int,
             **request_kw) -> tuple:
    """Sends one request, retrying transient failures as ``how`` says (`Exchanges`); returns ``(status, decoded
    body)`` of a 2xx or 4xx. ``http``: the client's connection pool; ``method``, ``path``, ``request_kw``: as
    ``httpx.Client.stream``; ``max_response_bytes``: the most a decoded body may hold.

    Raises:
      SamplerError: connection errors, timeouts, an attempt past its deadline,
        5xx or 429 answers on every attempt, or a body past ``max_response_bytes`` (not retried: it would be as large
        again).
      SamplerRedirect: a 3xx answer.
    """
    retries, backoff_s, deadline_s, base_url = how.retries, how.backoff_s, how.deadline_s, how.base_url
    counts = how.counts if how.counts is not None else {}
    last, wait = None, None
    for attempt in range(retries + 1):
        if attempt:
            how.sleep(wait if wait is not None else backoff_s * 2 ** (attempt - 1))
        wait = None
        deadline = time.monotonic() + deadline_s
        try:
            with http.stream(method, path, **request_kw) as r:
                content = _read(r, max_bytes=max_response_bytes, deadline=deadline)
        except ResponseTooLarge as e:
            raise SamplerError(f"{method} {base_url}{path}: {e}") from None
        except (httpx.TransportError, httpx.TimeoutException) as e:
            counts["transport"] = counts.get("transport", 0) + 1
            last = f"{type(e).__name__}: {e}"
            continue
        body = how.decode(r, content)
        if 300 <= r.status_code < 400:
            raise SamplerRedirect(f"{method} {base_url}{path}: HTTP {r.status_code} redirect to "
                                  f"{str(r.headers.get('location', '?'))[:200]!r}; a sampler is never reached "
                                  "through a redirect (check sampler.address)")
        if r.status_code == 429 or r.status_code >= 500:
            key = "429" if r.status_code == 429 else "5xx"
            counts[key] = counts.get(key, 0) + 1
            wait = _retry_after(r) if r.status_code == 429 else None
            last = f"HTTP {r.status_code}: {how.error_text(body)}"
            continue
        return r.status_code, body
    raise SamplerError(f"{method} {base_url}{path} failed after {retries + 1} attempt(s): {last}")
