"""The sampler server under hostile and malformed requests: every bad body is a 4xx naming what is wrong.

The server's real handlers, middleware and wire decoding run over a fake engine
(the real request validation, no model), through FastAPI's TestClient, and once
through a real uvicorn server on a loopback port to check that the keep-alive
connection survives a bad request.  A hypothesis fuzz test throws random JSON
and msgpack bodies (nesting, key types, packed-array headers, sizes) at both
endpoints and asserts that no answer is a 5xx.
"""
import contextlib
import json
import socket
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdm_jax.rollout import GenerateParams, RolloutBatch
from pdm_jax.sampler import wire, wire_codec, wire_request, wire_response
from pdm_jax.sampler.server import create_app

TOKEN = "hostile-token"
VOCAB = 32


class FakeEngine:
    """The engine interface the server uses, with the real `wire_request.validate_request`; one token per completion."""

    def __init__(self):
        self.version, self.loads = 0, []

    def health(self):
        return wire_response.health_body(wire_response.EngineHealth(
            model="fake", quantization="none", version=self.version, compute_dtype="float32", vocab_size=VOCAB,
            max_prompt_length=16, max_new_tokens=16, weights_path=None))

    def validate(self, prompts, params=None, **kw):
        return wire_request.validate_request(prompts, GenerateParams.of(params, **kw), vocab_size=VOCAB,
                                             max_prompt_length=16, max_new_tokens_limit=16, max_stop_tokens=4,
                                             max_sequences=64)

    def generate(self, prompts, params=None, **kw):
        params = GenerateParams.of(params, **kw)
        prompts = self.validate(prompts, params)
        n, top_k_logprobs = params.n, params.top_k_logprobs
        rows, p, k = len(prompts) * n, max(len(x) for x in prompts), top_k_logprobs
        return RolloutBatch(
            prompt_ids=np.ones((rows, p), np.int32), prompt_mask=np.ones((rows, p), bool),
            completion_ids=np.full((rows, 1), 3, np.int32), completion_mask=np.ones((rows, 1), bool),
            behavior_logprobs=np.full((rows, 1), -0.5, np.float32), topk_ids=np.zeros((rows, 1, k), np.int32),
            topk_logprobs=np.full((rows, 1, k), -1.0, np.float32), weights_version=np.zeros(rows, np.int32),
            group_ids=np.repeat(np.arange(len(prompts)), n).astype(np.int32),
            finish_reason=np.array(["length"] * rows, dtype=object))

    def load_weights(self, path, version, root=None):
        self.loads.append((path, version))
        raise AssertionError("the fake engine loads nothing; hostile paths must be refused before")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(FakeEngine(), checkpoint_root=str(tmp_path_factory.mktemp("root")), token=TOKEN,
                     max_body_bytes=1 << 20)
    with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def post(client, path, content, ctype):
    return client.post(path, content=content, headers={"content-type": ctype})


def error_of(r):
    body = msgpack.unpackb(r.content) if wire_codec.is_msgpack(r.headers["content-type"]) else r.json()
    return body["error"]


def nd(**fields):
    base = {"__nd__": 1, "dtype": "int32", "shape": [2], "data": np.arange(2, dtype="<i4").tobytes()}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not _MISSING}


_MISSING = object()
MP, JS = "application/msgpack", "application/json"


def _deep_json(depth):
    return ("[" * depth + "]" * depth).encode()


def _deep_msgpack(depth):
    return msgpack.packb({"prompt": [[1, 2]], "model": None}, use_bin_type=True)[:-1] + b"\x91" * depth + b"\x01"


# (name, endpoint, body bytes, content type, status, field, words in the message)
CASES = [
    ("json nested 100,000 deep", "/v1/generate", _deep_json(100_000), JS, 400, None, "nested deeper"),
    ("json prompt nested 40 deep", "/v1/generate", b'{"prompt":' + _deep_json(40) + b"}", JS, 400, "prompt",
     "nested deeper than 32"),
    ("msgpack nested 1,000 deep", "/v1/generate", _deep_msgpack(1000), MP, 400, "model", "nested deeper"),
    ("msgpack nested 5,000 deep", "/v1/generate", b"\x91" * 5000 + b"\x01", MP, 400, None, "nested deeper"),
    ("msgpack bytes key", "/v1/generate", msgpack.packb({b"prompt": [[1, 2]]}, use_bin_type=True), MP, 400, None,
     "map key b'prompt' (bytes) is not a string"),
    ("msgpack mixed str/bytes keys", "/v1/generate",
     msgpack.packb({"prompt": [[1, 2]], b"n": 1}, use_bin_type=True), MP, 400, None, "(bytes) is not a string"),
    ("nested bytes key", "/v1/generate", msgpack.packb({"prompt": [{b"x": 1}]}, use_bin_type=True), MP, 400,
     "prompt", "$.prompt[0]: map key"),
    ("__nd__ without data", "/v1/generate", msgpack.packb({"prompt": nd(data=_MISSING)}, use_bin_type=True), MP,
     400, "prompt", "$.prompt.data: missing"),
    ("__nd__ shape an int", "/v1/generate", msgpack.packb({"prompt": nd(shape=2)}, use_bin_type=True), MP, 400,
     "prompt", "$.prompt.shape: must be a list"),
    ("__nd__ data a string", "/v1/generate", msgpack.packb({"prompt": nd(data="ab")}, use_bin_type=True), MP, 400,
     "prompt", "$.prompt.data: must be bytes"),
    ("__nd__ size mismatch", "/v1/generate", msgpack.packb({"prompt": nd(shape=[3])}, use_bin_type=True), MP, 400,
     "prompt", "needs 12"),
    ("__nd__ negative dim", "/v1/generate", msgpack.packb({"prompt": nd(shape=[-1, -2])}, use_bin_type=True), MP,
     400, "prompt", "integers >= 0"),
    ("__nd__ unknown dtype", "/v1/generate", msgpack.packb({"prompt": nd(dtype="object")}, use_bin_type=True), MP,
     400, "prompt", "$.prompt.dtype"),
    ("__nd__ header not 1", "/v1/generate", msgpack.packb({"prompt": nd(__nd__=True)}, use_bin_type=True), MP, 400,
     "prompt", "must be the integer 1"),
    ("__nd__ empty memory bomb", "/v1/generate",
     msgpack.packb({"prompt": nd(shape=[10**9, 0], data=b"")}, use_bin_type=True), MP, 400, "prompt",
     "more than 65536 rows"),
    ("msgpack ext type", "/v1/generate", msgpack.packb({"prompt": msgpack.ExtType(5, b"x")}, use_bin_type=True), MP,
     400, "prompt", "extension"),
    ("msgpack timestamp", "/v1/generate", b"\x81\xa6prompt\xd6\xff\x00\x00\x00\x01", MP, 400, "prompt", "extension"),
    ("json 5000-digit int", "/v1/generate", b'{"prompt": [[' + b"1" * 5000 + b"]]}", JS, 400, None, "digits"),
    ("json NaN constant", "/v1/generate", b'{"prompt": [[1]], "temperature": NaN}', JS, 400, None, "NaN"),
    ("json lone surrogate key", "/v1/generate", b'{"prompt": [[1]], "\\ud800": 1}', JS, 400, None, "surrogate"),
    ("float token id", "/v1/generate", json.dumps({"prompt": [1, 2.5, 3]}).encode(), JS, 422, "prompt",
     "prompt[0][1] is 2.5 (float); token ids must be integers"),
    ("bool token id", "/v1/generate", json.dumps({"prompt": [[1, True]]}).encode(), JS, 422, "prompt",
     "prompt[0][1] is True (bool)"),
    ("flat bool prompt", "/v1/generate", json.dumps({"prompt": [True, 1]}).encode(), JS, 422, "prompt",
     "prompt[0][0] is True (bool)"),
    ("packed 0-d prompt item", "/v1/generate",
     msgpack.packb({"prompt": [nd(shape=[], data=np.int32(4).tobytes())]}, use_bin_type=True), MP, 200, None, ""),
    ("top_p true", "/v1/generate", json.dumps({"prompt": [[1]], "top_p": True}).encode(), JS, 422, "top_p",
     "True (bool)"),
    ("top_p string", "/v1/generate", json.dumps({"prompt": [[1]], "top_p": "0.5"}).encode(), JS, 422, "top_p",
     "(str)"),
    ("temperature 10**400", "/v1/generate", b'{"prompt": [[1]], "temperature": 1' + b"0" * 400 + b"}", JS, 422,
     "temperature", "finite number"),
    ("top_k beyond int32", "/v1/generate", json.dumps({"prompt": [[1]], "top_k": 2**40}).encode(), JS, 422, "top_k",
     "2**31"),
    ("top_k -1.0", "/v1/generate", json.dumps({"prompt": [[1]], "top_k": -1.0}).encode(), JS, 422, "top_k", "-1.0"),
    ("logprobs false", "/v1/generate", json.dumps({"prompt": [[1]], "logprobs": False}).encode(), JS, 422,
     "logprobs", "False (bool)"),
    ("stream a string", "/v1/generate", json.dumps({"prompt": [[1]], "stream": "no"}).encode(), JS, 422, "stream",
     "false or null"),
    ("model a list", "/v1/generate", json.dumps({"prompt": [[1]], "model": [1]}).encode(), JS, 422, "model",
     "string"),
    ("stop ids a map", "/v1/generate", json.dumps({"prompt": [[1]], "stop_token_ids": {"a": 1}}).encode(), JS, 422,
     "stop_token_ids", "list"),
    ("long unknown field", "/v1/generate", json.dumps({"prompt": [[1]], "x" * 5000: 1}).encode(), JS, 422,
     "x" * 5000, "unknown field"),
    ("weights path with NUL", "/v1/weights", json.dumps({"path": "weights/a\x00b", "version": 1}).encode(), JS, 422,
     "path", "NUL"),
    ("weights version beyond int32", "/v1/weights", json.dumps({"path": "weights/1", "version": 2**40}).encode(),
     JS, 422, "version", "2**31"),
    ("weights version a bool", "/v1/weights", json.dumps({"path": "weights/1", "version": True}).encode(), JS, 422,
     "version", "(bool)"),
    ("weights unknown field", "/v1/weights", json.dumps({"path": "w", "version": 1, "x": 1}).encode(), JS, 422, "x",
     "unknown"),
    ("weights bytes path", "/v1/weights", msgpack.packb({"path": b"w", "version": 1}, use_bin_type=True), MP, 422,
     "path", "(bytes)"),
]


@pytest.mark.parametrize("name,endpoint,body,ctype,status,field,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_4xx_naming_the_problem(client, name, endpoint, body, ctype, status, field, words):
    r = post(client, endpoint, body, ctype)
    assert r.status_code == status, (r.status_code, r.content[:300])
    if status == 200:
        return
    err = error_of(r)
    assert words in err["message"], err["message"][:300]
    assert err["field"] == field
    if field is not None:
        assert err["message"].startswith(field[:97])
    assert len(err["message"]) < 3000  # a hostile value is never echoed whole
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("header,status", [
    (f"Bearer {TOKEN}", 200), (f"bearer {TOKEN}", 200), (f"BEARER {TOKEN}", 200), (f"  Bearer   {TOKEN} ", 200),
    (f"Basic {TOKEN}", 401), (f"Bearer {TOKEN}x", 401), ("Bearer", 401), (TOKEN, 401), ("", 401),
])
def test_bearer_scheme_is_case_insensitive(client, header, status):
    r = client.get("/health", headers={"authorization": header})
    assert r.status_code == status
    if status == 401:
        assert error_of(r)["type"] == "unauthorized"


def test_a_failing_engine_is_a_500_with_its_message_not_a_reset(tmp_path):
    class Broken(FakeEngine):
        def generate(self, *a, **k):
            raise KeyError("internal bug")

    app = create_app(Broken(), checkpoint_root=str(tmp_path))
    with TestClient(app) as c:
        r = c.post("/v1/generate", json={"prompt": [[1]]})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "internal_error" and "KeyError" in err["message"] and "internal bug" in err["message"]


@pytest.fixture(scope="module")
def live_url(tmp_path_factory):
    """A real uvicorn server (the fake engine) on a free loopback port, in a thread."""
    app = create_app(FakeEngine(), checkpoint_root=str(tmp_path_factory.mktemp("live")), max_body_bytes=1 << 20)
    with _serving(app) as url:
        yield url


@contextlib.contextmanager
def _serving(app):
    """`app` served by uvicorn on a free loopback port in a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def test_keep_alive_connection_survives_every_bad_request(live_url):
    """The issue's cases on one keep-alive connection, each followed by a good request on the same connection."""
    good = json.dumps({"prompt": [[1, 2]], "max_tokens": 1, "logprobs": 2}).encode()
    with httpx.Client(base_url=live_url, timeout=30) as c:
        for name, endpoint, body, ctype, status, _, _ in CASES:
            r = c.post(endpoint, content=body, headers={"content-type": ctype})
            assert r.status_code == status, name
            r = c.post("/v1/generate", content=good, headers={"content-type": JS})
            assert r.status_code == 200, name
            assert r.json()["choices"][0]["token_ids"] == [3]


# ----------------------------------------------------------------------------- fuzz
_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**64, max_value=2**64),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8))
_nd_maps = st.fixed_dictionaries({}, optional={
    "__nd__": st.one_of(st.just(1), _scalars), "dtype": st.one_of(st.sampled_from(sorted(wire_codec._DTYPES)),
                                                                  _scalars),
    "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=4), _scalars),
    "data": st.one_of(st.binary(max_size=64), _scalars)})
_keys = st.one_of(st.sampled_from(sorted(wire.GENERATE_FIELDS | {"path", "version"})), st.text(max_size=6),
                  st.binary(max_size=4))
_values = st.recursive(st.one_of(_scalars, _nd_maps),
                       lambda inner: st.one_of(st.lists(inner, max_size=4),
                                               st.dictionaries(_keys, inner, max_size=4)), max_leaves=12)
_fields = st.dictionaries(st.sampled_from(sorted(wire.GENERATE_FIELDS | {"path", "version"})), _values, max_size=5)


def _encode(obj, use_msgpack):
    """`obj` as a body; JSON cannot hold bytes (or bytes keys), so those become strings there."""
    if use_msgpack:
        return msgpack.packb(obj, use_bin_type=True)

    def plain(x):
        if isinstance(x, dict):
            return {(k.decode("latin-1") if isinstance(k, bytes) else k): plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x.decode("latin-1") if isinstance(x, bytes) else x
    return json.dumps(plain(obj)).encode()


def _deep_body(depth, use_msgpack):
    """A valid request whose ignored ``model`` field is a list nested `depth` deep (raw bytes: encoders recurse)."""
    if use_msgpack:
        return b"\x82\xa6prompt\x91\x91\x01\xa5model" + b"\x91" * depth + b"\x01"
    return b'{"prompt": [[1]], "model": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=st.one_of(_fields, _values, st.binary(max_size=64), st.tuples(st.just("depth"), st.integers(0, 100_000))),
       use_msgpack=st.booleans(), endpoint=st.sampled_from(["/v1/generate", "/v1/weights"]))
def test_fuzzed_bodies_never_get_a_5xx(client, body, use_msgpack, endpoint):
    # ("depth", d): a valid request nested d deep (`_deep_body`); a bare int is one of `_values` (any size: a
    # JSON number as the whole body)
    depth = body[1] if isinstance(body, tuple) else None
    if depth is not None:
        content = _deep_body(depth, use_msgpack)
    elif isinstance(body, bytes):
        content = body
    else:
        try:
            content = _encode(body, use_msgpack)
        except (ValueError, OverflowError, RecursionError, TypeError):  # not representable in that codec
            return
    r = post(client, endpoint, content, MP if use_msgpack else JS)
    assert r.status_code < 500, (r.status_code, r.content[:500])
    if r.status_code >= 400:
        err = error_of(r)
        assert isinstance(err["message"], str) and err["message"]
        assert err["field"] is None or isinstance(err["field"], str)
    if depth is not None and endpoint == "/v1/generate":  # depth 0: model 1 (not a string) -> 422
        assert r.status_code == (400 if depth >= wire_codec.MAX_DEPTH else 422)


def test_health_answers_while_bodies_are_decoded(live_url, monkeypatch):
    """Request bodies are parsed off the event loop: while 4 requests' bodies take 1 s each to decode,
    /health still answers at once (on the loop it waited for all of them: 4 s, past a stall probe's budget)."""
    from pdm_jax.sampler import server as server_mod

    real = wire_codec.decode_body

    def slow_decode(body, content_type):
        time.sleep(1.0)  # an 8 MB body's parse, without holding the GIL the loop needs
        return real(body, content_type)

    monkeypatch.setattr(server_mod.wire_codec, "decode_body", slow_decode)
    body = json.dumps({"prompt": [[1, 2]], "max_tokens": 1, "logprobs": 2}).encode()
    answers = []

    def post():
        with httpx.Client(base_url=live_url, timeout=30) as c:
            answers.append(c.post("/v1/generate", content=body,
                                  headers={"content-type": "application/json"}).status_code)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the four bodies are being decoded now
    with httpx.Client(base_url=live_url, timeout=30) as c:
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200
        waited = time.monotonic() - t0
    for t in threads:
        t.join()
    assert answers == [200] * 4 and waited < 0.5, waited


# ----------------------------------------------------------------------------- memory and deadlines
def test_concurrent_bodies_are_admitted_by_bytes_and_slow_ones_get_408(tmp_path, monkeypatch):
    """A real server with a budget of two full bodies: 6 concurrent 48 kB bodies all get their answer, but at most
    two are held (read or decoded) at once, and the bytes held never pass the budget; a body that does not arrive
    whole within body_timeout_s gets 408 and its connection is closed, while other requests are served; a request
    that cannot be admitted within the bound gets 503 with Retry-After."""
    from pdm_jax.sampler import server as server_mod

    limit, timeout = 2 * (64 << 10), 1.0
    app = create_app(FakeEngine(), checkpoint_root=str(tmp_path), max_body_bytes=64 << 10,
                     max_inflight_body_bytes=limit, body_timeout_s=timeout)
    budget = app.state.service.body_budget
    real, lock, now, most, held = wire_codec.decode_body, threading.Lock(), [0], [0], []

    def slow_decode(body, content_type):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            held.append(budget.held)
        time.sleep(0.15)
        with lock:
            now[0] -= 1
        return real(body, content_type)

    monkeypatch.setattr(server_mod.wire_codec, "decode_body", slow_decode)
    pad = "x" * (48 << 10)  # the model name, a field the server ignores: a 48 kB body
    body = json.dumps({"prompt": [[1, 2]], "max_tokens": 1, "logprobs": 2, "model": pad}).encode()
    with _serving(app) as url:
        answers = []

        def post():
            with httpx.Client(base_url=url, timeout=30) as c:
                answers.append(c.post("/v1/generate", content=body, headers={"content-type": JS}).status_code)

        threads = [threading.Thread(target=post) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [200] * 6
        assert most[0] == 2 and max(held) <= limit and budget.peak <= limit and budget.waited >= 1
        assert budget.held == 0
        port = int(url.rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt": [[1')  # then nothing more
        t0 = time.monotonic()
        with httpx.Client(base_url=url, timeout=30) as c:  # served meanwhile
            assert c.post("/v1/generate", content=body, headers={"content-type": JS}).status_code == 200
        slow.settimeout(10)
        answer = b""
        while chunk := slow.recv(65536):  # b"": the server closed the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower(), answer[:300]
        assert b"request body not received whole within 1 s (14 bytes arrived)" in answer
        assert timeout <= time.monotonic() - t0 < timeout + 5
        slow.close()
        monkeypatch.setattr(server_mod.wire_codec, "decode_body", lambda b, c: (time.sleep(2.5), real(b, c))[1])
        firsts = [threading.Thread(target=post) for _ in range(2)]  # 2 x 48 kB held while they decode (2.5 s)
        for t in firsts:
            t.start()
        time.sleep(0.5)
        big = json.dumps({"prompt": [[1, 2]], "max_tokens": 1, "model": "x" * ((64 << 10) - 100)}).encode()
        with httpx.Client(base_url=url, timeout=30) as c:  # 96 + 64 kB > 128 kB: waits 1 s, then 503
            r = c.post("/v1/generate", content=big, headers={"content-type": JS})
        for t in firsts:
            t.join()
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.content[:300]
        assert error_of(r)["type"] == "busy" and budget.refused == 1 and budget.held == 0
        assert answers[-2:] == [200, 200]
