"""The sampler service: ``python -m pdm_jax.sampler.server ...`` (FastAPI + uvicorn).

Endpoints (bodies JSON or msgpack by Content-Type; the response follows
Accept, else the request's type; schema in ``pdm_jax.sampler.wire``):

* ``POST /v1/generate`` -- vLLM-completions-shaped generation with token ids,
  behaviour log-probabilities and top-K (``logprobs: K``).
* ``POST /v1/weights`` -- ``{"path", "version"}``: load a `save_weights`
  directory under ``--checkpoint_root`` and re-quantize.  Accepted when version
  > current, or version == current with the same path (idempotent).  Errors:
  403 path outside the root or containing ``..``, 404 missing/incomplete
  directory, 409 stale version or a directory holding another version.
* ``GET /health`` -- model, quantization, version, limits.

Security: binds 127.0.0.1 by default; any other host requires ``--token``
(a shared bearer token, checked with ``hmac.compare_digest`` on every request,
401 otherwise).  Bodies over ``--max_body_bytes`` get 413.  Invalid requests
get 4xx with ``{"error": {"message", "field", "type"}}`` naming the field;
unexpected failures are 500 (the client retries those).  Generation requests
are serialised by the engine's lock (one jitted batch at a time), so
concurrent requests are answered correctly, each as if alone.

With ``--port=0`` the OS picks a free port; it is printed
(``SAMPLER_LISTENING port=P``) and written to ``--port_file`` when given.
"""


import argparse
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import time
from typing import Optional

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
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
    p.add_argument("--quantization", default="fp8", choices=("none", "bf16", "fp8"))
    p.add_argument("--checkpoint_root", required=True, help="/v1/weights only loads from under this directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    p.add_argument("--port_file", default=None, help="write the bound port here (atomically)")
    p.add_argument("--token", default=os.environ.get("PDM_SAMPLER_TOKEN"),
                   help="shared bearer token (required for a non-loopback host); env PDM_SAMPLER_TOKEN")
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_batch_size", type=int, default=64)
    p.add_argument("--max_body_bytes", type=int, default=8 << 20)
    p.add_argument("--init_seed", type=int, default=0, help="seed of the random init when --weights is omitted")
    p.add_argument("--log_level", default="warning")
    p.add_argument("--parent_pid", type=int, default=0,
                   help="exit when this process (the trainer that launched us) is gone; 0 = never")
    args = p.parse_args(argv)
    if not is_loopback(args.host) and not args.token:
        p.error(f"--host={args.host} is not a loopback address: a shared --token is required")
    if args.port < 0 or args.port > 65535:
        p.error(f"--port={args.port} out of range")
    return args


def load_model_config(path: str):
    """A Qwen3Config from an HF config.json (or a directory holding one)."""
    from pdm_jax.models.qwen3 import Qwen3Config

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return Qwen3Config.from_hf_dict(json.load(f))


class HTTPError(Exception):
    """An error response: status code, message, optional field name."""

    def __init__(self, status: int, message: str, field: Optional[str] = None, kind: str = "invalid_request"):
        if field and not message.startswith(f"{field}:"):
            message = f"{field}: {message}"
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind


def create_app(engine, *, checkpoint_root: str, token: Optional[str] = None, max_body_bytes: int = 8 << 20):
    """The FastAPI app serving `engine` (a SamplingEngine).

    Args:
      engine: the SamplingEngine (its lock serialises generation and loads).
      checkpoint_root: directory `/v1/weights` may load from.
      token: if set, every request needs ``Authorization: Bearer <token>``.
      max_body_bytes: request bodies above this get 413.
    """
    import numpy as np
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool

    from pdm_jax.sampler import wire
    from pdm_jax.sampler import weights as wts
    from pdm_jax.sampler.engine import RequestError, StaleWeightsError, check_weights_path

    app = FastAPI(title="pdm_jax sampler", docs_url=None, redoc_url=None, openapi_url=None)
    stats = {"requests": 0, "generated_tokens": 0, "started": time.time()}

    def respond(request, payload, status=200):
        accept = request.headers.get("accept", "")
        use_mp = wire.is_msgpack(accept) or (not accept or "*/*" in accept) and wire.is_msgpack(
            request.headers.get("content-type"))
        return Response(wire.dumps(payload, msgpack=use_mp), status_code=status,
                        media_type=wire.MSGPACK if use_mp else wire.JSON)

    def error(request, e: HTTPError):
        return respond(request, {"error": {"message": e.message, "field": e.field, "type": e.kind}}, e.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        try:
            if token is not None:
                auth = request.headers.get("authorization", "")
                if not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
                    raise HTTPError(401, "missing or wrong bearer token", kind="unauthorized")
            cl = request.headers.get("content-length")
            if cl is not None:
                try:
                    n = int(cl)
                except ValueError:
                    raise HTTPError(400, f"bad Content-Length {cl!r}")
                if n > max_body_bytes:
                    raise HTTPError(413, f"request body of {n} bytes exceeds the limit of {max_body_bytes} bytes",
                                    kind="too_large")
            return await call_next(request)
        except HTTPError as e:
            return error(request, e)

    async def read_body(request) -> object:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise HTTPError(413, f"request body exceeds the limit of {max_body_bytes} bytes", kind="too_large")
            chunks.append(chunk)
        body = b"".join(chunks)
        ctype = request.headers.get("content-type", wire.JSON)
        if not (wire.is_msgpack(ctype) or "json" in ctype.lower()):
            raise HTTPError(415, f"unsupported Content-Type {ctype!r}; use {wire.JSON} or {wire.MSGPACK}")
        try:
            obj = wire.loads(body, msgpack=wire.is_msgpack(ctype))
        except ValueError as e:
            raise HTTPError(400, str(e), kind="malformed_body")
        if not isinstance(obj, dict):
            raise HTTPError(400, f"body must be an object (map), got {type(obj).__name__}", kind="malformed_body")
        return obj

    @app.get("/health")
    async def health(request: Request):
        h = dict(engine.health())
        h.update(requests=stats["requests"], generated_tokens=stats["generated_tokens"],
                 uptime_s=time.time() - stats["started"])
        return respond(request, h)

    gen_fields = {"prompt", "n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs",
                  "seed", "model", "stream"}

    @app.post("/v1/generate")
    async def generate(request: Request):
        try:
            body = await read_body(request)
            unknown = sorted(set(body) - gen_fields)
            if unknown:
                raise HTTPError(422, f"unknown field(s) {unknown}", field=unknown[0])
            if body.get("stream"):
                raise HTTPError(422, "streaming is not supported", field="stream")
            if "prompt" not in body:
                raise HTTPError(422, "missing required field 'prompt'", field="prompt")
            prompts = body["prompt"]
            if isinstance(prompts, np.ndarray):
                prompts = prompts.tolist()
            if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompts):
                prompts = [prompts]  # a single prompt, as vLLM accepts
            top_k = body.get("top_k", 0)
            if top_k == -1:
                top_k = 0
            kwargs = dict(n=body.get("n", 1), temperature=body.get("temperature", 1.0),
                          max_new_tokens=body.get("max_tokens", 16), top_k_logprobs=body.get("logprobs", 0) or 0,
                          stop_token_ids=body.get("stop_token_ids") or [], seed=body.get("seed"),
                          top_p=body.get("top_p", 1.0), top_k=top_k)
            if not isinstance(kwargs["stop_token_ids"], list):
                raise HTTPError(422, "must be a list of token ids", field="stop_token_ids")
            try:
                engine.validate(prompts, **kwargs)
                batch = await run_in_threadpool(engine.generate, prompts, **kwargs)
            except RequestError as e:
                raise HTTPError(422, str(e), field=e.field)
        except HTTPError as e:
            return error(request, e)
        lengths = batch.completion_mask.sum(axis=1)
        choices = []
        for r in range(batch.num_sequences):
            t = int(lengths[r])
            choices.append({
                "index": r, "prompt_index": int(batch.group_ids[r]),
                "token_ids": batch.completion_ids[r, :t], "logprobs": batch.behavior_logprobs[r, :t],
                "top_logprobs": {"ids": batch.topk_ids[r, :t], "logprobs": batch.topk_logprobs[r, :t]},
                "finish_reason": str(batch.finish_reason[r]), "weights_version": int(batch.weights_version[r])})
        stats["requests"] += 1
        stats["generated_tokens"] += int(lengths.sum())
        version = int(batch.weights_version[0])
        return respond(request, {
            "object": "text_completion", "model": engine.health()["model"], "weights_version": version,
            "choices": choices,
            # As vLLM: each prompt counted once, however many samples (n) it has.
            "usage": {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": int(lengths.sum())}})

    @app.post("/v1/weights")
    async def load_weights(request: Request):
        try:
            body = await read_body(request)
            path, version = body.get("path"), body.get("version")
            if not isinstance(path, str) or not path:
                raise HTTPError(422, f"must be a non-empty string, got {path!r}", field="path")
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise HTTPError(422, f"must be an integer >= 0, got {version!r}", field="version")
            try:
                full = check_weights_path(path, checkpoint_root)
            except wts.WeightsError as e:
                raise HTTPError(403, str(e), field="path", kind="forbidden_path")
            if not os.path.isdir(full) or not os.path.isfile(os.path.join(full, wts.META_FILE)):
                raise HTTPError(404, f"weights path {path!r} does not exist or is incomplete "
                                f"(no {wts.META_FILE})", field="path", kind="not_found")
            try:
                info = await run_in_threadpool(engine.load_weights, full, version)
            except StaleWeightsError as e:
                raise HTTPError(409, str(e), field="version", kind="stale_version")
            except wts.WeightsError as e:
                status = 409 if "version" in str(e) else 422
                raise HTTPError(status, str(e), field="version" if status == 409 else "path", kind="bad_weights")
        except HTTPError as e:
            return error(request, e)
        return respond(request, {"status": "ok", **info})

    return app


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Starts a daemon thread that ends this process once `parent_pid` is no longer our parent.

    A trainer killed with SIGKILL cannot stop its sampler; without this the
    sampler would live on as an orphan holding memory and a port.
    """
    import threading
    import time

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
    import uvicorn

    from pdm_jax.sampler import weights as wts
    from pdm_jax.sampler.engine import SamplingEngine

    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    config = load_model_config(args.model_config)
    version = args.version
    if args.weights:
        params = wts.load_weights(args.weights, config, version=version)
        if version is None:
            version = int(wts.read_meta(args.weights)["version"])
    else:
        version = 0 if version is None else version
        from flax import nnx

        from pdm_jax.models.qwen3 import Qwen3ForCausalLM

        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(args.init_seed)), nnx.Param))
    engine = SamplingEngine(config, params, quantization=args.quantization, version=version,
                            weights_path=args.weights, max_prompt_length=args.max_prompt_length,
                            max_new_tokens=args.max_new_tokens, max_batch_size=args.max_batch_size)
    app = create_app(engine, checkpoint_root=args.checkpoint_root, token=args.token,
                     max_body_bytes=args.max_body_bytes)
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
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
