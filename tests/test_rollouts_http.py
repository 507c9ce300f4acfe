"""`pdm_jax.rollouts.http.exchange`: one HTTP exchange of either sampler client, on a mock transport with the
sleeps recorded: what is retried and counted by cause, the waits (doubling backoff, Retry-After capped, an HTTP
date ignored), a 4xx returned at once, a redirect and an oversized body refused without a retry. (The clients'
own use of it: tests/test_rollouts_client.py, tests/test_rollouts_vllm_client.py.)"""

import httpx
import pytest

from pdm_jax.rollouts import http


def _exchange(answers, retries=4, max_response_bytes=1024):
    """``exchange`` of GET /health against ``answers`` (responses, or exceptions to raise); returns its result, the
    retry counts and the recorded sleeps."""
    answers, counts, slept = iter(answers), {}, []

    def handler(request):
        a = next(answers)
        if isinstance(a, Exception):
            raise type(a)(str(a), request=request)
        return a

    with httpx.Client(base_url="http://sampler", transport=httpx.MockTransport(handler)) as client:
        how = http.Exchanges(retries=retries, backoff_s=0.5, deadline_s=5.0, decode=lambda r, body: body.decode(),
                             error_text=str, counts=counts, sleep=slept.append, base_url="http://sampler")
        out = http.exchange(client, "GET", "/health", how, max_response_bytes=max_response_bytes)
    return out, counts, slept


def test_retries_are_counted_by_cause_and_wait_as_told():
    out, counts, slept = _exchange([
        httpx.Response(503, text="busy"),
        httpx.ConnectError("refused"),
        httpx.Response(429, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, text="slow down"),
        httpx.Response(429, headers={"retry-after": "3600"}, text="slow down"),
        httpx.Response(404, text="no such route"),
    ])
    assert out == (404, "no such route")  # a 4xx is the caller's to name: returned, not retried
    assert counts == {"5xx": 1, "transport": 1, "429": 2}
    # backoff 0.5 s doubling per attempt; a Retry-After date is not read (the backoff); seconds capped at 30
    assert slept == [0.5, 1.0, 2.0, http.MAX_RETRY_AFTER_S] and http.MAX_RETRY_AFTER_S == 30.0


def test_the_last_failure_is_named_once_the_retries_are_spent():
    with pytest.raises(http.SamplerError, match=r"^GET http://sampler/health failed after 2 attempt\(s\): "
                                                 r"HTTP 500: busy$"):
        _exchange([httpx.Response(500, text="busy")] * 2, retries=1)


def test_a_redirect_and_an_oversized_body_are_refused_without_a_retry():
    redirect = httpx.Response(302, headers={"location": "http://elsewhere/health"})
    with pytest.raises(http.SamplerRedirect, match="HTTP 302 redirect to 'http://elsewhere/health'"):
        _exchange([redirect, httpx.Response(200, text="ok")])
    with pytest.raises(http.SamplerError, match=r"larger than 1024 bytes \(decoded\); refused"):
        _exchange([httpx.Response(200, text="x" * 2048), httpx.Response(200, text="ok")])
    out, counts, slept = _exchange([httpx.Response(200, text="x" * 1024)])
    assert out == (200, "x" * 1024) and counts == {} and slept == []  # exactly the cap is allowed
