"""A fake vLLM OpenAI-compatible server backed by our `SamplingEngine`: ``python -m pdm_jax.sampler.vllm_fake``.

For tests and for a dry rehearsal of ``sampler.backend = "vllm"`` where no vLLM runs.  It answers the
routes `pdm_jax.rollouts.vllm_client.VLLMSampler` uses, in the shapes vLLM documents (its
``CompletionResponse`` / ``CompletionLogProbs``, error bodies ``{"error": {"message", "type", "param",
"code"}}``), with real rollouts from our engine:

* ``GET /health`` -> 200, empty body; ``GET /v1/models`` -> ``{"object": "list", "data": [{"id", ...}]}``;
* ``POST /v1/completions`` -> choices ``index = i * n + j``; with ``logprobs: K`` each choice's
  ``logprobs`` holds ``tokens`` (``"token_id:<id>"``; only ``return_tokens_as_token_ids: true`` is
  served: there is no tokenizer), ``token_logprobs``, ``top_logprobs`` (the sampled token first, then the
  top K in rank order, K or K + 1 entries, as vLLM builds them; -inf written as -9999.0) and
  ``text_offset``; ``text`` is "" and ``stop_reason`` the stop id.  The log-probabilities are those of
  the distribution the tokens were drawn from, i.e. what a vLLM server started with
  ``--logprobs-mode processed_logprobs`` returns;
* dev-mode routes (off with ``--no_dev_mode``, then 404 as on a vLLM without ``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause``, ``POST /resume``, ``POST /reset_prefix_cache`` and ``POST /collective_rpc`` with
  method ``reload_weights`` and ``kwargs.weights_path`` a Hugging Face directory under ``--weights_root``
  (read with `pdm_jax.models.hf_io.from_pretrained`; other methods: 400).

Until the first reload (or ``--model`` at start) there are no weights and completions get 503.  Bodies
are parsed as JSON only (`wire_codec.loads`: strict, depth-limited); nothing is unpickled.  It binds to
loopback unless ``--host`` says otherwise.  Not a vLLM: no text prompts, no streaming, no penalties
(a non-neutral value is refused with 400).
"""


import argparse
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pdm_jax.sampler import vllm_api, wire, wire_codec
from pdm_jax.sampler.server import is_loopback

log = logging.getLogger("pdm_jax.sampler.vllm_fake")


class FakeVLLMError(Exception):
    """An error answer: HTTP status, message and the offending request field (vLLM's ``param``)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(e: FakeVLLMError) -> dict:
    """vLLM's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError"}.get(e.status, "InternalError")
    return {wire.ERROR: {wire.MESSAGE: e.message, wire.TYPE: kind, "param": e.param, "code": e.status}}


LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


class FakeVLLM:
    """The fake server's state and handlers (framework-free, so tests can call them directly).

    Args:
      weights_root: directory ``reload_weights`` may read from (realpath prefix check).
      model_name: the id listed by ``/v1/models`` and echoed in responses.
      quantization, compute_dtype: of the engine (`SamplingEngine`); "none" = f32, the trainer's numerics.
      max_prompt_length, max_tokens, max_batch_size: engine limits (tokens / sequences).
      max_logprobs: largest ``logprobs`` served (vLLM's ``--max-logprobs``, default 20).
      dev_mode: serve the dev-mode routes.
      logprobs_mode: vLLM's ``--logprobs-mode``: "processed_logprobs" (what the trainer needs: log mu after
        temperature) or "raw_logprobs" (vLLM's default, emulated: the log-probabilities of the model's
        logits at temperature 1, whatever the request's; the tokens are then drawn at temperature 1 too).
    """

    def __init__(self, *, weights_root: str, model_name: str = "fake-vllm", quantization: str = "none",
                 compute_dtype: str = "auto", max_prompt_length: int = 64, max_tokens: int = 16,
                 max_batch_size: int = 64, max_logprobs: int = 20, dev_mode: bool = True,
                 logprobs_mode: str = "processed_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.weights_root = os.path.realpath(weights_root)
        self.model_name = model_name
        self.engine_kwargs = dict(quantization=quantization, compute_dtype=compute_dtype,
                                  max_prompt_length=int(max_prompt_length), max_new_tokens=int(max_tokens),
                                  max_batch_size=int(max_batch_size))
        self.max_logprobs = int(max_logprobs)
        self.dev_mode = bool(dev_mode)
        self.engine = None
        self.weights_path: Optional[str] = None
        self.reloads = 0
        self.requests = []  # the decoded /v1/completions bodies (tests read them)
        self.calls = []  # the dev-mode routes called, in order (tests read them)
        self._resumed = threading.Event()
        self._resumed.set()

    # ------------------------------------------------------------------ weights
    def reload(self, weights_path) -> None:
        """Loads the Hugging Face directory `weights_path` (under `weights_root`) into the engine."""
        # JAX: imported when weights are loaded, so that --help and a server without weights start fast
        from pdm_jax.models import hf_io
        from pdm_jax.sampler.engine import SamplingEngine

        if not isinstance(weights_path, str) or not weights_path:
            raise FakeVLLMError(400,
                                f"kwargs.weights_path must be a non-empty string, got {wire_codec._kind(weights_path)}",
                                "kwargs")
        real = os.path.realpath(weights_path)
        if os.path.commonpath([real, self.weights_root]) != self.weights_root:
            raise FakeVLLMError(403, f"weights_path {weights_path!r} is outside --weights_root {self.weights_root!r}",
                                "kwargs")
        if not os.path.isfile(os.path.join(real, hf_io.CONFIG_NAME)):
            raise FakeVLLMError(400, f"weights_path {weights_path!r} holds no {hf_io.CONFIG_NAME}", "kwargs")
        try:
            model = hf_io.from_pretrained(real)
        except (ValueError, OSError) as e:
            raise FakeVLLMError(400, f"cannot load {weights_path!r}: {e}", "kwargs") from e
        version = self.reloads + 1
        if self.engine is None or self.engine.config != model.config:
            self.engine = SamplingEngine(model.config, model, version=version, **self.engine_kwargs)
        else:
            self.engine.set_params(model, version=version)
        self.weights_path, self.reloads = real, version

    # ------------------------------------------------------------------ completions
    def completions(self, body) -> dict:
        """The ``/v1/completions`` answer to a decoded JSON body (FakeVLLMError for a refused request)."""
        if not isinstance(body, dict):
            raise FakeVLLMError(400, "the body must be a JSON object")
        self.requests.append(body)
        if body.get(wire.STREAM):
            raise FakeVLLMError(400, "streaming is not served by the fake server", wire.STREAM)
        if body.get(vllm_api.ECHO):
            raise FakeVLLMError(400, "echo is not served by the fake server", vllm_api.ECHO)
        for name, neutral in vllm_api.VLLM_NEUTRAL_SAMPLING.items():
            if body.get(name, neutral) != neutral:
                raise FakeVLLMError(400, f"{name}={body[name]!r}: only the neutral value {neutral} is served", name)
        prompts = body.get(wire.PROMPT)
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
            raise FakeVLLMError(400, "prompt must be token ids (a list of ints, or of int lists): the fake server "
                                     "has no tokenizer", wire.PROMPT)
        k = body.get(wire.LOGPROBS)
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise FakeVLLMError(400, f"logprobs must be an integer >= 0, got {k!r}", wire.LOGPROBS)
            if k > self.max_logprobs:
                raise FakeVLLMError(400, f"Requested sample logprobs of {k}, which is greater than max allowed: "
                                         f"{self.max_logprobs}", wire.LOGPROBS)
            if body.get(vllm_api.RETURN_TOKENS_AS_TOKEN_IDS) is not True:
                raise FakeVLLMError(400, "the fake server has no tokenizer: set return_tokens_as_token_ids=true",
                                    vllm_api.RETURN_TOKENS_AS_TOKEN_IDS)
        self._resumed.wait(timeout=600)
        engine = self.engine
        if engine is None:
            raise FakeVLLMError(503, "no weights loaded yet (POST /collective_rpc reload_weights first)")
        top_k = body.get(wire.TOP_K, -1)
        n = body.get(wire.N, 1)
        stops = body.get(wire.STOP_TOKEN_IDS) or []
        try:
            raw = self.logprobs_mode == "raw_logprobs" and body.get(wire.TEMPERATURE, 1.0) != 0
            batch = engine.generate(prompts, n=n, temperature=1.0 if raw else body.get(wire.TEMPERATURE, 1.0),
                                    max_new_tokens=body.get(wire.MAX_TOKENS, wire.DEFAULT_MAX_TOKENS),
                                    top_k_logprobs=k or 0, stop_token_ids=stops, seed=body.get(wire.SEED),
                                    top_p=body.get(wire.TOP_P, 1.0),
                                    top_k=0 if isinstance(top_k, int) and top_k == -1 else top_k)
        except wire.RequestError as e:
            raise FakeVLLMError(400, str(e), e.field) from e
        return self._response(batch, k, set(stops), prompt_tokens=sum(len(p) for p in prompts))

    def _response(self, batch, k, stops, *, prompt_tokens: int) -> dict:
        """vLLM's CompletionResponse for a RolloutBatch (choice r = row r)."""
        lengths = batch.completion_mask.sum(axis=1)
        choices = []
        for r in range(batch.num_sequences):
            t_r = int(lengths[r])
            ids = [int(x) for x in batch.completion_ids[r, :t_r]]
            logprobs = None
            if k is not None:
                top = []
                for t in range(t_r):
                    entry = {f"{vllm_api.TOKEN_ID_PREFIX}{ids[t]}": _clamp(batch.behavior_logprobs[r, t])}
                    for i, v in zip(batch.topk_ids[r, t, :k], batch.topk_logprobs[r, t, :k]):
                        entry.setdefault(f"{vllm_api.TOKEN_ID_PREFIX}{int(i)}", _clamp(v))
                    top.append(entry)
                logprobs = {vllm_api.TEXT_OFFSET: [0] * t_r,
                            vllm_api.TOKEN_LOGPROBS: [_clamp(v) for v in batch.behavior_logprobs[r, :t_r]],
                            vllm_api.TOKENS: [f"{vllm_api.TOKEN_ID_PREFIX}{i}" for i in ids], wire.TOP_LOGPROBS: top}
            reason = str(batch.finish_reason[r])
            choices.append({wire.INDEX: r, vllm_api.TEXT: "", wire.LOGPROBS: logprobs, wire.FINISH_REASON: reason,
                            vllm_api.STOP_REASON: ids[-1] if reason == "stop" and ids[-1] in stops else None,
                            "prompt_logprobs": None})
        completion = int(lengths.sum())
        return {vllm_api.ID: f"cmpl-{secrets.token_hex(8)}", wire.OBJECT: wire.TEXT_COMPLETION,
                "created": int(time.time()), wire.MODEL: self.model_name, wire.CHOICES: choices,
                wire.USAGE: {wire.PROMPT_TOKENS: prompt_tokens, wire.COMPLETION_TOKENS: completion,
                             "total_tokens": prompt_tokens + completion}}

    # ------------------------------------------------------------------ dev-mode routes
    def collective_rpc(self, body) -> dict:
        """``reload_weights`` with ``kwargs.weights_path``; vLLM's answer ``{"results": [null]}`` (one worker)."""
        if not isinstance(body, dict) or body.get("method") is None:
            raise FakeVLLMError(400, "Missing 'method' in request body", "method")
        if body["method"] != vllm_api.VLLM_RELOAD_METHOD:
            raise FakeVLLMError(400, f"method {body['method']!r} is not served by the fake server (only "
                                     f"{vllm_api.VLLM_RELOAD_METHOD!r})", "method")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise FakeVLLMError(400, "kwargs must be an object", "kwargs")
        self.reload(kwargs.get(vllm_api.VLLM_WEIGHTS_PATH))
        return {"results": [None]}

    def pause(self) -> dict:
        self._resumed.clear()
        return {wire.STATUS: "paused"}

    def resume(self) -> dict:
        self._resumed.set()
        return {wire.STATUS: "resumed"}

    def models(self) -> dict:
        return {wire.OBJECT: "list", vllm_api.DATA: [{vllm_api.ID: self.model_name, wire.OBJECT: "model",
                                                  "owned_by": "vllm", "root": self.weights_path,
                                                  "max_model_len": self.engine_kwargs["max_prompt_length"]
                                                  + self.engine_kwargs["max_new_tokens"]}]}


def _clamp(v) -> float:
    """A log-probability as vLLM writes it: -inf (and anything below) -> -9999.0."""
    return max(float(v), vllm_api.VLLM_MIN_LOGPROB)


def create_app(fake: FakeVLLM, *, api_key: Optional[str] = None):
    """The FastAPI app serving `fake` (JSON bodies only, `wire_codec.loads`; bearer `api_key` if given)."""
    app = FastAPI(title="fake vLLM", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(fn, *, dev: bool = False, body: bool = True):
        async def endpoint(request: Request):
            try:
                if dev:
                    fake.calls.append(request.url.path)
                if dev and not fake.dev_mode:
                    raise FakeVLLMError(404, "Not Found")
                if api_key and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                       f"Bearer {api_key}".encode()):
                    raise FakeVLLMError(401, "Unauthorized")
                args = ()
                if body:
                    raw = await request.body()
                    try:
                        args = (wire_codec.loads(raw, msgpack=False) if raw else {},)
                    except ValueError as e:
                        raise FakeVLLMError(400, f"JSON decode error: {e}") from e
                result = await run_in_threadpool(fn, *args)
            except FakeVLLMError as e:
                return JSONResponse(error_body(e), status_code=e.status)
            except Exception as e:  # noqa: BLE001 - a bug of the fake: an answer, not a reset connection
                log.exception("fake vLLM failed")
                return JSONResponse(error_body(FakeVLLMError(500, f"{type(e).__name__}: {e}")), status_code=500)
            return Response(status_code=200) if result is None else JSONResponse(result)
        return endpoint

    app.get(vllm_api.VLLM_HEALTH)(answer(lambda: None, body=False))
    app.get(vllm_api.VLLM_MODELS)(answer(fake.models, body=False))
    app.post(vllm_api.VLLM_COMPLETIONS)(answer(fake.completions))
    app.post(vllm_api.VLLM_PAUSE)(answer(fake.pause, dev=True, body=False))
    app.post(vllm_api.VLLM_RESUME)(answer(fake.resume, dev=True, body=False))
    app.post(vllm_api.VLLM_RESET_PREFIX_CACHE)(answer(lambda: None, dev=True, body=False))
    app.post(vllm_api.VLLM_COLLECTIVE_RPC)(answer(fake.collective_rpc, dev=True))
    app.state.fake = fake
    return app


def serve_in_thread(app, host: str = "127.0.0.1"):
    """Serves `app` on ``host`` (a free port) from a daemon thread; returns ``(base_url, stop)``.

    ``stop()`` shuts the server down and joins the thread.  For tests and notebooks.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), name="fake-vllm", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline and thread.is_alive():
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return f"http://{host}:{sock.getsockname()[1]}", stop


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `main`. Like the native server, a non-loopback ``--host`` needs an ``--api_key``, and
    a key no client could send (`wire.token_problem`) is refused; both exit 2 before anything starts."""
    p = argparse.ArgumentParser(prog="python -m pdm_jax.sampler.vllm_fake", description=__doc__.split("\n")[0])
    p.add_argument("--weights_root", required=True, help="directory reload_weights may read Hugging Face dirs from")
    p.add_argument("--model", default=None, help="a Hugging Face directory (under --weights_root) to serve at start")
    p.add_argument("--served_model_name", default="fake-vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default=None)
    p.add_argument("--quantization", default="none")
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--max_tokens", type=int, default=256)
    p.add_argument("--max_logprobs", type=int, default=20)
    p.add_argument("--logprobs_mode", default="processed_logprobs", choices=LOGPROBS_MODES,
                   help="vLLM's --logprobs-mode: raw_logprobs (vLLM's default) emulated to test the client's check")
    p.add_argument("--no_dev_mode", action="store_true", help="404 on the dev-mode routes (as without "
                                                              "VLLM_SERVER_DEV_MODE=1)")
    args = p.parse_args(argv)
    if not is_loopback(args.host) and not args.api_key:
        p.error(f"--host={args.host} is not a loopback address: an --api_key is required")
    if args.api_key and wire.token_problem(args.api_key):
        p.error(f"--api_key {wire.token_problem(args.api_key)}")
    return args


def main(argv=None) -> None:
    """``python -m pdm_jax.sampler.vllm_fake --weights_root DIR [--model HF_DIR] [--port 8000]``."""
    args = parse_args(argv)
    logging.basicConfig(level="INFO")
    fake = FakeVLLM(weights_root=args.weights_root, model_name=args.served_model_name,
                    quantization=args.quantization, max_prompt_length=args.max_prompt_length,
                    max_tokens=args.max_tokens, max_logprobs=args.max_logprobs, dev_mode=not args.no_dev_mode,
                    logprobs_mode=args.logprobs_mode)
    if args.model:
        fake.reload(args.model)
    uvicorn.run(create_app(fake, api_key=args.api_key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
