"""SamplerClient retry/backoff/error behaviour against a mock transport (no server, no JAX)."""
import time

import httpx
import msgpack
import numpy as np
import pytest

from pdm_jax.sampler import wire_codec, wire_response
from pdm_jax.rollouts.client import SamplerClient, SamplerError, SamplerRequestError, SamplerResponseError


def _mp(obj, status=200):
    return httpx.Response(status, content=wire_codec.dumps(obj, msgpack=True),
                          headers={"content-type": wire_codec.MSGPACK})


def _choice(i, toks, k):
    t = len(toks)
    return {"index": i, "prompt_index": i // 2, "token_ids": np.array(toks, np.int32),
            "logprobs": np.full(t, -0.5, np.float32),
            "top_logprobs": {"ids": np.tile(np.arange(k, dtype=np.int32), (t, 1)),
                             "logprobs": np.full((t, k), -1.0, np.float32)},
            "finish_reason": "stop" if t == 2 else "length", "weights_version": 4}


def test_retries_5xx_then_succeeds_and_resends_the_same_seed():
    seen = []

    def handler(request):
        body = msgpack.unpackb(request.content)
        seen.append(body)
        if len(seen) < 3:
            return httpx.Response(503, text="busy")
        choices = [_choice(i, [5, 6, 7][: 2 + i % 2], 3) for i in range(4)]
        return _mp({"object": "text_completion", "weights_version": 4, "choices": choices})

    c = SamplerClient("http://sampler", retries=3, backoff_s=0.01, transport=httpx.MockTransport(handler))
    t0 = time.perf_counter()
    b = c.generate([[1, 2], [3]], n=2, max_new_tokens=3, top_k_logprobs=3, temperature=0.7)
    assert time.perf_counter() - t0 >= 0.01 + 0.02  # exponential backoff: 0.01, 0.02
    assert len(seen) == 3 and len({s["seed"] for s in seen}) == 1 and seen[0]["seed"] is not None
    assert seen[0]["prompt"] == [[1, 2], [3]] and seen[0]["logprobs"] == 3 and seen[0]["max_tokens"] == 3
    assert b.num_sequences == 4 and b.top_k == 3
    np.testing.assert_array_equal(b.completion_mask.sum(1), [2, 3, 2, 3])
    np.testing.assert_array_equal(b.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(b.prompt_ids[2], [0, 3])
    assert list(b.finish_reason) == ["stop", "length", "stop", "length"] and set(b.weights_version) == {4}
    np.testing.assert_array_equal(b.behavior_logprobs[0], [-0.5, -0.5, 0.0])


def test_4xx_is_not_retried_and_names_the_field():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(422, json={"error": {"message": "n: must be >= 1", "field": "n"}})

    c = SamplerClient("http://sampler", retries=3, backoff_s=0.01, transport=httpx.MockTransport(handler))
    with pytest.raises(SamplerRequestError) as e:
        c.load_weights("weights/1", 1)
    assert len(calls) == 1 and e.value.status == 422 and e.value.field == "n" and "n:" in str(e.value)


def test_connection_errors_exhaust_retries():
    calls = []

    def handler(request):
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    c = SamplerClient("http://sampler", retries=2, backoff_s=0.0, transport=httpx.MockTransport(handler))
    with pytest.raises(SamplerError, match="3 attempt"):
        c.health()
    assert len(calls) == 3
    with pytest.raises(ValueError, match="retries"):
        SamplerClient("http://x", retries=-1)


# ---- what a client trusts of a server: bounded bodies, a deadline, no redirects, 429 retried -------------------

def _valid_columns_answer():
    """A real answer for prompts [[1, 2], [3]], n = 2, K = 3 (the columns form, as our server sends)."""
    from pdm_jax.rollout import build_batch

    rb = build_batch([[1, 2], [3]], group_ids=[0, 0, 1, 1], lengths=[2, 3, 2, 3],
                     completion_ids=np.full((4, 3), 5), behavior_logprobs=np.full((4, 3), -0.5),
                     topk_ids=np.tile(np.arange(3), (4, 3, 1)), topk_logprobs=np.full((4, 3, 3), -1.5),
                     weights_version=4, finish_reason=["stop", "length"] * 2)
    return wire_response.GenerateResponse(rb, model="m", prompt_tokens=3).to_wire("columns")


def test_a_gzip_bomb_is_refused_by_its_decoded_size():
    import gzip

    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros: ~64 KB on the wire
    assert len(bomb) < 100_000

    def handler(request):
        return httpx.Response(200, content=bomb, headers={"content-type": wire_codec.MSGPACK,
                                                          "content-encoding": "gzip"})

    c = SamplerClient("http://sampler", retries=2, backoff_s=0.0, transport=httpx.MockTransport(handler))
    with pytest.raises(SamplerError, match=r"larger than \d+ bytes \(decoded\); refused"):
        c.generate([[1, 2], [3]], n=2, max_new_tokens=3, top_k_logprobs=3, seed=0)
    assert c.retry_counts == {}  # not retried: the next answer would be as large


@pytest.mark.parametrize("mutate,words", [
    (lambda cs: cs[0].update(prompt_index=-1), r"choices\[0\]\.prompt_index: must be an integer in \[0, 2\)"),
    (lambda cs: cs[1].update(logprobs=np.full(1, -0.5, np.float32)), r"choices\[1\]\.logprobs: must have shape \[3\]"),
    # a negative version would make the logged staleness (trainer version - row version) wrong
    (lambda cs: cs[2].update(weights_version=-1), r"choices\[\*\]\.weights_version: must be integers in \[0, "
                                                  r"2147483647\] \(weights versions\), got -1"),
])
def test_a_hostile_choices_body_is_refused_by_the_client_naming_the_field(mutate, words):
    """What `SamplerClient.generate` decodes from a server (or a proxy) that answers in the ``choices`` form with a
    row of a prompt the request does not have, or one log-prob for three tokens. (What a well-formed answer must
    match in the request, rows x n in order, lengths, ids, log mu, top-K mass, is checked for every backend by the
    supervisor the trainer calls: `rollout.check_answers`, tests/test_rollouts_supervisor.py.)"""
    def handler(request):
        choices = [_choice(i, [5, 6, 7][: 2 + i % 2], 3) for i in range(4)]
        mutate(choices)
        return _mp({"object": "text_completion", "weights_version": 4, "choices": choices})

    c = SamplerClient("http://sampler", retries=0, transport=httpx.MockTransport(handler))
    with pytest.raises(SamplerResponseError, match="POST /v1/generate: the answer does not have the documented "
                                                   "shape: ValueError: .*" + words):
        c.generate([[1, 2], [3]], n=2, max_new_tokens=3, top_k_logprobs=3, seed=0)


def test_a_trickled_body_is_cut_at_the_deadline_and_retried():
    def slow():
        yield b"\x81"
        for _ in range(20):
            time.sleep(0.2)
            yield b" "

    def handler(request):
        return httpx.Response(200, content=slow(), headers={"content-type": wire_codec.MSGPACK})

    c = SamplerClient("http://sampler", retries=1, backoff_s=0.0, timeout_s=0.5, transport=httpx.MockTransport(handler))
    t0 = time.monotonic()
    with pytest.raises(SamplerError, match="deadline"):
        c.health()
    assert time.monotonic() - t0 < 2.5 and c.retry_counts == {"transport": 2}  # 2 x ~0.6 s, not 2 x 4 s


def test_a_200_error_body_a_non_map_and_a_redirect_are_named_not_decoded():
    from pdm_jax.rollouts.client import SamplerProtocolError

    answers = iter([_mp({"error": {"message": "overloaded"}}), _mp([1, 2, 3]),
                    httpx.Response(307, headers={"location": "http://elsewhere/v1/generate"})])
    c = SamplerClient("http://sampler", retries=0, transport=httpx.MockTransport(lambda r: next(answers)))
    gen = dict(n=2, max_new_tokens=3, top_k_logprobs=3, seed=0)
    with pytest.raises(SamplerProtocolError, match="HTTP 200 with an error body: overloaded"):
        c.generate([[1, 2], [3]], **gen)
    with pytest.raises(SamplerProtocolError, match="HTTP 200 with a list, not a map"):
        c.generate([[1, 2], [3]], **gen)
    with pytest.raises(SamplerProtocolError, match="HTTP 307 redirect to 'http://elsewhere/v1/generate'"):
        c.generate([[1, 2], [3]], **gen)


def test_429_is_retried_after_its_retry_after_and_counted(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    answers = iter([httpx.Response(429, headers={"retry-after": "2"}, text="slow down"),
                    httpx.Response(429, headers={"retry-after": "3600"}, text="slow down"),
                    _mp(_valid_columns_answer())])
    c = SamplerClient("http://sampler", retries=3, backoff_s=0.01,
                      transport=httpx.MockTransport(lambda r: next(answers)))
    b = c.generate([[1, 2], [3]], n=2, max_new_tokens=3, top_k_logprobs=3, seed=0)
    assert b.num_sequences == 4 and c.retry_counts == {"429": 2}
    assert slept == [2.0, 30.0]  # Retry-After honoured, capped at MAX_RETRY_AFTER_S
