"""The sampler service: ``python -m pdm_jax.sampler.server ...`` (FastAPI + uvicorn).

Endpoints (bodies JSON or msgpack by Content-Type; the response follows
Accept, else the request's type; schema in ``pdm_jax.sampler.wire``):

* ``POST /v1/generate`` -- vLLM-completions-shaped generation with token ids,
  behaviour log-probabilities and top-K (``logprobs: K``).
* ``POST /v1/weights`` -- ``{"path", "version"}``: load a `save_weights`
  directory under ``--checkpoint_root`` and re-quantize (the answer carries the
  process's XLA compile counts, ``compile_stats``).  Accepted when version
  > current, or version == current with the same path (idempotent).  Errors:
  403 path outside the root or containing ``..``, 404 missing/incomplete
  directory, 409 stale version or a directory holding another version, 422
  weights that fail their integrity check, hold non-finite values or do not fit
  the model (the server keeps serving its current version).
* ``GET /health`` -- model, quantization, weight noise, version, limits.
* With ``--tokenizer=DIR``: ``POST /v1/completions``, ``POST /v1/chat/completions`` and
  ``GET /v1/models`` in the OpenAI schema (text in and out, the tokenizer's chat template;
  `pdm_jax.sampler.openai_api`), under the same token, body limit and engine limits; their
  errors take OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Security: binds 127.0.0.1 by default; any other host requires ``--token``
(a shared bearer token, checked with ``hmac.compare_digest`` on every request,
401 otherwise; the ``Bearer`` scheme is matched case-insensitively, RFC 7235). A token no
client could send (a space, a control or non-ASCII character: `wire.token_problem`) is
refused at start-up.
Bodies over ``--max_body_bytes`` get 413.  The bodies of the requests in flight reserve at most
``--max_inflight_body_bytes`` together (admission by bytes, `pdm_jax.sampler.admission`: a request waits
for its share, at most ``--body_timeout_s``, then gets 503 with ``Retry-After``), which bounds the memory
concurrent decoding holds; a body that has not arrived whole ``--body_timeout_s`` after its admission
gets 408 and its connection is closed.  Invalid requests get 4xx with
``{"error": {"message", "field", "type"}}`` naming the field (malformed bodies
-- nesting deeper than ``wire_codec.MAX_DEPTH``, non-string map keys, bad packed
arrays -- are 400, see `wire_codec.loads`); unexpected failures are 500 with the
exception in the message (the client retries those; each one is a bug).
Generation requests are serialised by the engine's lock (one jitted batch at a
time), so concurrent requests are answered correctly, each as if alone; they
run off the event loop, so ``/health`` answers during a generation.

Layout: `SamplerService` holds one small handler per endpoint; each decodes
the body with ``wire`` (`wire_request.GenerateRequest`, `wire_request.LoadWeightsRequest`),
calls the engine and encodes the answer with ``wire`` (`wire_response.GenerateResponse`,
`wire.error_body`); `create_app` only wires them into a FastAPI app.

With ``--port=0`` the OS picks a free port; it is printed
(``SAMPLER_LISTENING port=P``) and written to ``--port_file`` when given.
"""


import argparse
import asyncio
import dataclasses
import functools
import gc
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from pdm_jax.sampler import openai_api, wire, wire_codec, wire_request, wire_response
from pdm_jax.sampler.admission import BodyBudget, BudgetTimeout
from pdm_jax.sampler.spec import EngineSpec

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_INFLIGHT_BODY_BYTES = 32 << 20  # four full-size (8 MB) bodies decoding at once
DEFAULT_BODY_TIMEOUT_S = 60.0  # 8 MB at 140 kB/s
log = logging.getLogger("pdm_jax.sampler.server")


def is_loopback(host: str) -> bool:
    """True for localhost / 127.0.0.0/8 / ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (see module docstring); validates host/token before any heavy import."""
    p = argparse.ArgumentParser(prog="python -m pdm_jax.sampler.server", description=__doc__.split("\n")[0])
    p.add_argument("--model_config", required=True, help="HF config.json, or a directory containing it")
    p.add_argument("--weights", default=None, help="save_weights directory; omit for a random init (benchmarks)")
    p.add_argument("--version", type=int, default=None,
                   help="weights version of --weights, checked against the one the directory records "
                        "(default: that recorded version; 0 for a random init)")
    p.add_argument("--compile_cache_dir", default="",
                   help="JAX persistent compilation cache directory ('' = none); see pdm_jax.profiling")
    p.add_argument("--compile_cache_min_compile_time_s", type=float, default=0.0,
                   help="programs compiling faster than this are not written to the cache (s)")
    p.add_argument("--reuse_freed_host_memory", action="store_true",
                   help="glibc keeps freed large blocks mapped for reuse (pdm_jax.host_memory)")
    EngineSpec.add_flags(p, defaults_=dict(quantization="fp8"))  # the engine's settings: one flag per field
    p.add_argument("--checkpoint_root", required=True, help="/v1/weights only loads from under this directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    p.add_argument("--port_file", default=None, help="write the bound port here (atomically)")
    p.add_argument("--token", default=os.environ.get("PDM_SAMPLER_TOKEN"),
                   help="shared bearer token (required for a non-loopback host); env PDM_SAMPLER_TOKEN")
    p.add_argument("--max_body_bytes", type=int, default=8 << 20)
    p.add_argument("--max_inflight_body_bytes", type=int, default=DEFAULT_INFLIGHT_BODY_BYTES,
                   help="the bodies of the requests in flight reserve at most this many bytes together (their "
                        "Content-Length, else --max_body_bytes); others wait, then 503 (pdm_jax.sampler.admission). "
                        "At least --max_body_bytes")
    p.add_argument("--body_timeout_s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="a request body must arrive whole within this many seconds of its admission (else 408, "
                        "connection closed); also the longest wait for admission (else 503)")
    p.add_argument("--init_seed", type=int, default=0, help="seed of the random init when --weights is omitted")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer directory: also serve the OpenAI-compatible /v1/completions, "
                        "/v1/chat/completions and /v1/models (pdm_jax.sampler.openai_api)")
    p.add_argument("--served_model_name", default="pdm_jax",
                   help="the model id of the OpenAI-compatible endpoints (requests naming another model get 404)")
    p.add_argument("--log_level", default="warning")
    p.add_argument("--parent_pid", type=int, default=0,
                   help="exit when this process (the trainer that launched us) is gone; 0 = never")
    args = p.parse_args(argv)
    if not is_loopback(args.host) and not args.token:
        p.error(f"--host={args.host} is not a loopback address: a shared --token is required")
    if args.token and wire.token_problem(args.token):
        p.error(f"--token (or PDM_SAMPLER_TOKEN) {wire.token_problem(args.token)}")
    if args.port < 0 or args.port > 65535:
        p.error(f"--port={args.port} out of range")
    try:
        args.engine_spec = EngineSpec.from_flags(args)  # built and validated once, passed to the engine
    except ValueError as e:
        p.error(str(e))
    if args.max_body_bytes < 1:
        p.error(f"--max_body_bytes={args.max_body_bytes} must be >= 1")
    if args.max_inflight_body_bytes < args.max_body_bytes:
        p.error(f"--max_inflight_body_bytes={args.max_inflight_body_bytes} must be >= --max_body_bytes="
                f"{args.max_body_bytes} (else a full-size body could never be admitted)")
    if not 0 < args.body_timeout_s < float("inf"):  # NaN fails too
        p.error(f"--body_timeout_s={args.body_timeout_s} must be a finite number of seconds > 0")
    return args


def load_model_config(path: str):
    """A Qwen3Config from an HF config.json (or a directory holding one)."""
    # heavy (imports JAX): deferred so that parse_args / --help do not pay for it
    from pdm_jax.models.qwen3 import Qwen3Config

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return Qwen3Config.from_hf_dict(json.load(f))


class HTTPError(Exception):
    """An error response: status code, message, optional field name (its wire name), error type.

    The message is prefixed with ``"<field>: "`` when it does not already start so.
    """

    def __init__(self, status: int, message: str, field: Optional[str] = None, kind: str = "invalid_request",
                 headers: Optional[dict] = None):
        shown = field if field is None or len(field) <= 100 else field[:97] + "..."  # as wire.RequestError
        if field and not message.startswith(f"{shown}:"):
            message = f"{shown}: {message}"
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind
        self.headers = dict(headers or {})  # e.g. Connection: close after a body left unread


def respond(request: Request, payload: dict, status: int = 200, headers: Optional[dict] = None) -> Response:
    """`payload` encoded as msgpack or JSON (`wire_codec.response_is_msgpack` of the request's headers)."""
    use_mp = wire_codec.response_is_msgpack(request.headers.get("accept"), request.headers.get("content-type"))
    return Response(wire_codec.dumps(payload, msgpack=use_mp), status_code=status, headers=headers,
                    media_type=wire_codec.MSGPACK if use_mp else wire_codec.JSON)


def error_response(request: Request, e: HTTPError) -> Response:
    """The error body of `e` (``{"error": {"message", "field", "type"}}``) with its status and headers; on the
    OpenAI-compatible routes OpenAI's body (``{"error": {"message", "type", "param", "code"}}``, JSON)."""
    if openai_api.is_openai_path(request.url.path):
        response = openai_api.error_response(openai_api.OpenAIError(e.status, e.message, e.field))
        response.headers.update(e.headers or {})
        return response
    return respond(request, wire.error_body(e.message, e.field, e.kind), e.status, headers=e.headers or None)


#: The headers of an answer sent before the request's body was read whole: the connection cannot carry another
#: request (its unread bytes would be taken for one), so it is closed once the answer is sent.
CLOSE = {"Connection": "close"}


class SamplerService:
    """The HTTP handlers of the sampler service over one `SamplingEngine` (see the module docstring).

    Each handler decodes the request with `wire`, calls the engine and encodes
    the answer with `wire`; failures become `HTTPError`s, answered as error bodies.

    Args:
      engine: the SamplingEngine (its lock serialises generation and loads).
      checkpoint_root: directory `/v1/weights` may load from.
      token: if set, every request needs ``Authorization: Bearer <token>``.
      max_body_bytes: request bodies above this get 413.
      max_inflight_body_bytes: the bodies of the requests in flight reserve at most this many bytes together
        (`pdm_jax.sampler.admission.BodyBudget`; >= max_body_bytes); a request waits for its share.
      body_timeout_s: a body must arrive whole within this many seconds of its admission, else 408 and the
        connection is closed; the longest wait for admission too, else 503 (``Retry-After``, connection closed).

    Raises:
      ValueError: max_inflight_body_bytes < max_body_bytes, or body_timeout_s not a finite number > 0.
    """

    def __init__(self, engine, *, checkpoint_root: str, token: Optional[str] = None, max_body_bytes: int = 8 << 20,
                 compile_counter=None, max_inflight_body_bytes: int = DEFAULT_INFLIGHT_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        if int(max_inflight_body_bytes) < int(max_body_bytes):
            raise ValueError(f"max_inflight_body_bytes {max_inflight_body_bytes} must be >= max_body_bytes "
                             f"{max_body_bytes}: a full-size body could never be admitted")
        if not 0 < float(body_timeout_s) < float("inf"):
            raise ValueError(f"body_timeout_s must be a finite number of seconds > 0, got {body_timeout_s!r}")
        self.engine = engine
        self.compile_counter = compile_counter
        self.checkpoint_root = checkpoint_root
        self.token = token
        self.max_body_bytes = int(max_body_bytes)
        self.body_budget = BodyBudget(int(max_inflight_body_bytes))
        self.body_timeout_s = float(body_timeout_s)
        self.requests = 0
        self.generated_tokens = 0
        self.started = time.time()

    # ------------------------------------------------------------------ middleware
    async def guard(self, request: Request, call_next) -> Response:
        """HTTP middleware: bearer token (401), declared body size (400 bad / 413 too large), then admission of a
        request with a body by bytes (`BodyBudget`: its Content-Length, else max_body_bytes, held until the answer
        is sent; 503 when it does not fit within body_timeout_s)."""
        try:
            self._check_token(request)
            declared = self._check_content_length(request)
        except HTTPError as e:
            return error_response(request, e)
        if request.method in ("GET", "HEAD") and not declared:
            return await call_next(request)
        want = self.max_body_bytes if declared is None else declared
        try:
            async with self.body_budget.reserve(want, self.body_timeout_s) as reservation:
                request.state.body_reservation = reservation
                return await call_next(request)
        except BudgetTimeout as e:
            return error_response(request, HTTPError(
                503, f"server busy: the request's body was not admitted within {self.body_timeout_s:g} s ({e}); "
                     f"retry", kind="busy", headers={"Retry-After": "1", **CLOSE}))

    def _check_token(self, request: Request) -> None:
        """401 unless ``Authorization: Bearer <token>`` (scheme case-insensitive, RFC 7235) holds the token."""
        if self.token is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.strip().encode(), self.token.encode()):
            raise HTTPError(401, "missing or wrong bearer token", kind="unauthorized")

    def _check_content_length(self, request: Request) -> Optional[int]:
        """The declared body size (None: none declared); HTTPError 400 unreadable, 413 over max_body_bytes."""
        cl = request.headers.get("content-length")
        if cl is None:
            return None
        try:
            n = int(cl)
        except ValueError:
            raise HTTPError(400, f"bad Content-Length {cl!r}")
        if n < 0:
            raise HTTPError(400, f"bad Content-Length {cl!r}")
        if n > self.max_body_bytes:
            raise HTTPError(413, f"request body of {n} bytes exceeds the limit of {self.max_body_bytes} bytes",
                            kind="too_large")
        return n

    async def read_body(self, request: Request) -> dict:
        """The request body decoded by `wire_codec.decode_body`; streamed, cut off at `max_body_bytes` (413) and at
        `body_timeout_s` (408: a body trickled in, or a client that stopped sending; the connection is closed).
        The body's admission (`guard`) shrinks to its size once it is whole.

        Raises:
          HTTPError: 408 not whole in time, 413 too large, 415 unsupported content type, 400 malformed or not a map.
        """
        chunks, size = [], 0
        reservation = getattr(request.state, "body_reservation", None)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise HTTPError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                                        kind="too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(408, f"request body not received whole within {self.body_timeout_s:g} s "
                                 f"({size} bytes arrived)", kind="request_timeout", headers=CLOSE) from None
        if reservation is not None:
            reservation.shrink(size)
        try:  # parsing an 8 MB body takes a while: off the event loop, so /health keeps answering meanwhile
            return await run_in_threadpool(wire_codec.decode_body, b"".join(chunks),
                                           request.headers.get("content-type"))
        except wire_codec.BodyError as e:
            raise HTTPError(e.status, str(e), field=e.field, kind=e.kind) from e

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        """``GET /health``: the engine's health plus request counters and uptime."""
        return respond(request, wire_response.health_with_stats(
            self.engine.health(), requests=self.requests, generated_tokens=self.generated_tokens,
            uptime_s=time.time() - self.started))

    async def generate(self, request: Request) -> Response:
        """``POST /v1/generate``: decode (`wire_request.GenerateRequest`), validate, generate, encode (422 names
        the field).

        Decoding, validation, generation and encoding all run in a worker thread, off the event loop, so
        ``/health`` answers while they run (the trainer's stall probe relies on that).
        """
        body = await self.read_body(request)

        def work():
            req = wire_request.GenerateRequest.from_wire(body)
            self.engine.validate(req.prompts, req.params())
            batch = self.engine.generate(req.prompts, req.params())
            resp = wire_response.GenerateResponse(batch, model=self.engine.health()[wire.MODEL],
                                                  prompt_tokens=req.prompt_tokens)
            return resp, respond(request, resp.to_wire(req.response_format))

        resp, answer = await run_in_threadpool(work)
        self.requests += 1
        self.generated_tokens += resp.completion_tokens
        return answer

    async def load_weights(self, request: Request) -> Response:
        """``POST /v1/weights``: 403 outside the root, 404 missing/incomplete, 409 stale or other version,
        422 unusable weights (corrupt files, non-finite values, wrong shapes; the current version stays)."""
        req = wire_request.LoadWeightsRequest.from_wire(await self.read_body(request))
        try:
            full = self._weights_dir(req.path)
            info = await run_in_threadpool(self._load, full, req.version)
        except HTTPError as e:  # the message names paths as the client sent them, never the server's own root
            e.message = self._scrub(e.message)
            raise
        stats = None if self.compile_counter is None else self.compile_counter.snapshot()
        return respond(request, wire_response.weights_response(info, stats))

    def _scrub(self, message: str) -> str:
        """`message` with the checkpoint root's absolute path (as given and resolved) replaced by
        ``<checkpoint_root>``: error bodies never tell a client where the server keeps its files."""
        for root in sorted({os.path.realpath(self.checkpoint_root), os.path.abspath(self.checkpoint_root)},
                           key=len, reverse=True):
            message = message.replace(root, "<checkpoint_root>")
        return message

    def _weights_dir(self, path: str) -> str:
        """`path` resolved under the checkpoint root; HTTPError 403 (outside / ``..``) or 404 (incomplete)."""
        # heavy (import JAX); already loaded once an engine exists, deferred for parse_args / --help
        from pdm_jax.sampler import weights as wts
        from pdm_jax.sampler.engine import check_weights_path  # engine loads JAX: imported once a request needs it

        try:
            full = check_weights_path(path, self.checkpoint_root)
        except wts.WeightsError as e:
            raise HTTPError(403, str(e), field=wire.PATH, kind="forbidden_path")
        if not os.path.isdir(full) or not os.path.isfile(os.path.join(full, wts.META_FILE)):
            raise HTTPError(404, f"weights path {path!r} does not exist or is incomplete "
                            f"(no {wts.META_FILE})", field=wire.PATH, kind="not_found")
        return full

    def _load(self, full: str, version: int) -> dict:
        """`engine.load_weights`; HTTPError 409 for a stale or mismatched version, 422 for unusable weights.

        Unusable: a corrupt or truncated file (integrity check), non-finite values,
        shapes that do not fit the model, or weights the quantizer refuses (the
        engine's WeightsError).  The engine then keeps serving its current version.
        """
        # heavy (import JAX); already loaded once an engine exists, deferred for parse_args / --help
        from pdm_jax.sampler import weights as wts
        from pdm_jax.sampler.engine import StaleWeightsError  # engine loads JAX: imported once a request needs it

        try:
            return self.engine.load_weights(full, version, root=self.checkpoint_root)
        except StaleWeightsError as e:
            raise HTTPError(409, str(e), field=wire.VERSION, kind="stale_version")
        except wts.VersionMismatchError as e:
            raise HTTPError(409, str(e), field=wire.VERSION, kind="bad_weights") from e
        except wts.WeightsError as e:  # the directory's content (integrity, non-finite, shapes, quantizer)
            raise HTTPError(422, str(e), field=wire.PATH, kind="bad_weights") from e


def guarded(handler):
    """Wraps an endpoint so that every failure is answered with an error body, never raised to the server.

    `HTTPError` -> its status; `wire.RequestError` -> 422 naming the field; any
    other exception -> 500 (type ``internal_error``) whose message carries the
    exception, logged with its traceback.  A 500 is a server bug: every bad
    input must be a 4xx.  Answering (instead of raising through the middleware)
    keeps the keep-alive connection usable for the next request.
    """
    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as e:
            return error_response(request, e)
        except wire.RequestError as e:
            return error_response(request, HTTPError(422, str(e), field=e.field))
        except Exception as e:  # noqa: BLE001 - the last line of defence: an answer instead of a reset
            log.exception("unexpected failure in %s %s", request.method, request.url.path)
            return error_response(request, HTTPError(500, f"internal error: {type(e).__name__}: {e}"[:2000],
                                                     kind="internal_error"))
    return endpoint


@dataclasses.dataclass(frozen=True)
class OpenAIRoutes:
    """The OpenAI-compatible routes' settings (`openai_api.mount`): a Hugging Face ``tokenizer`` (None: the routes
    answer 404 saying that the server has no tokenizer), its directory ``tokenizer_dir``, and the model id they
    report, ``served_model_name``."""

    tokenizer: Any = None
    tokenizer_dir: Optional[str] = None
    served_model_name: str = "pdm_jax"


def create_app(engine, *, checkpoint_root: str, token: Optional[str] = None, max_body_bytes: int = 8 << 20,
               compile_counter=None, max_inflight_body_bytes: int = DEFAULT_INFLIGHT_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, openai: OpenAIRoutes = OpenAIRoutes()):
    """The FastAPI app serving `engine` (a SamplingEngine) through a `SamplerService`.

    Args:
      engine: the SamplingEngine (its lock serialises generation and loads).
      checkpoint_root: directory `/v1/weights` may load from.
      token: if set, every request needs ``Authorization: Bearer <token>``.
      max_body_bytes: request bodies above this get 413.
      compile_counter: a `pdm_jax.profiling.CompileCounter`; its snapshot rides on every
        ``/v1/weights`` answer (``compile_stats``), or None.
      max_inflight_body_bytes, body_timeout_s: the admission of bodies by bytes and their deadline
        (`SamplerService`).
      openai: the OpenAI-compatible routes' tokenizer and model id (`OpenAIRoutes`).
    Returns:
      a ``fastapi.FastAPI`` application.
    """
    service = SamplerService(engine, checkpoint_root=checkpoint_root, token=token, max_body_bytes=max_body_bytes,
                             compile_counter=compile_counter, max_inflight_body_bytes=max_inflight_body_bytes,
                             body_timeout_s=body_timeout_s)
    app = FastAPI(title="pdm_jax sampler", docs_url=None, redoc_url=None, openapi_url=None)
    app.middleware("http")(service.guard)
    app.get("/health")(guarded(service.health))
    app.post("/v1/generate")(guarded(service.generate))
    app.post("/v1/weights")(guarded(service.load_weights))
    openai_api.mount(app, service, openai.tokenizer, tokenizer_dir=openai.tokenizer_dir,
                     model_name=openai.served_model_name)
    app.state.service = service
    return app


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Starts a daemon thread that ends this process once `parent_pid` is no longer our parent.

    A trainer killed with SIGKILL cannot stop its sampler; without this the
    sampler would live on as an orphan holding memory and a port.
    """
    def watch():
        while True:
            if os.getppid() != parent_pid:
                logging.getLogger(__name__).warning("parent %d is gone; sampler exiting", parent_pid)
                os._exit(0)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv=None) -> None:
    """Entry point: parse flags, build the engine, bind, write the port file, serve."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # heavy (JAX, Flax): imported only after the flags are checked, so that --help and bad flags answer fast
    from flax import nnx

    from pdm_jax.models.qwen3 import Qwen3ForCausalLM  # after the flags parse: --help without JAX
    from pdm_jax.profiling import CompileCounter, enable_compile_cache  # after the flags parse: imports JAX
    from pdm_jax.sampler import weights as wts  # after the flags parse: --help without JAX
    from pdm_jax.sampler.engine import SamplingEngine, make_sampler_mesh  # after the flags parse: --help without JAX

    if args.reuse_freed_host_memory:  # before any thread of JAX's backend allocates (pdm_jax.host_memory)
        from pdm_jax.host_memory import reuse_freed_host_memory

        reuse_freed_host_memory()
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    enable_compile_cache(args.compile_cache_dir, min_compile_time_s=args.compile_cache_min_compile_time_s)
    compile_counter = CompileCounter()
    config = load_model_config(args.model_config)
    version = args.version
    if args.weights:
        params = wts.load_weights(args.weights, config, version=version)
        if version is None:
            version = int(wts.read_meta(args.weights)["version"])
    else:
        version = 0 if version is None else version
        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(args.init_seed)), nnx.Param))
    spec = args.engine_spec
    engine = SamplingEngine(config, params, spec, version=version, weights_path=args.weights,
                            mesh=make_sampler_mesh(spec.mesh_data, spec.mesh_tensor))
    tokenizer = None
    if args.tokenizer:
        from pdm_jax.models.tokenizer import load_tokenizer  # transformers: only with --tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    app = create_app(engine, checkpoint_root=args.checkpoint_root, token=args.token,
                     max_body_bytes=args.max_body_bytes, compile_counter=compile_counter,
                     max_inflight_body_bytes=args.max_inflight_body_bytes, body_timeout_s=args.body_timeout_s,
                     openai=OpenAIRoutes(tokenizer=tokenizer, tokenizer_dir=args.tokenizer,
                                         served_model_name=args.served_model_name))
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    port = sock.getsockname()[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"SAMPLER_LISTENING port={port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                           timeout_keep_alive=30))
    gc.freeze()  # the imports, weights and engine: the cyclic GC's full collections stop walking them (as train.run)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
