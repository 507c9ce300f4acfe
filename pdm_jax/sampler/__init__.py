"""pdm_jax.sampler: the rollout service (the trainer's side of it is ``pdm_jax.rollouts``).

wire       the HTTP schema's field names and error bodies (RequestError names wire fields)
wire_request / wire_response   GenerateRequest / LoadWeightsRequest, request validation; GenerateResponse
wire_codec the JSON / msgpack body codecs (untrusting decoder)
limits     the bounds the run config checks without the engine (stop ids, seed, temperature, the mesh)
quantize   bf16 / fp8-e4m3 (per-output-channel, weight-only) sampler weights
weights    save_weights / load_weights: the trainer -> sampler weight-sync format
engine     SamplingEngine (jitted KV-cache prefill + decode -> RolloutBatch)
static_batching / continuous_batching   the engine's two batching programs; sampling: the per-token draw
server     python -m pdm_jax.sampler.server (FastAPI + uvicorn)
vllm_fake  python -m pdm_jax.sampler.vllm_fake: a fake of that server backed by SamplingEngine (tests, rehearsal)

Names are imported lazily so that `python -m pdm_jax.sampler.server --help`
does not pay for importing JAX.
"""

import importlib

_EXPORTS = {
    "SamplingEngine": "engine", "RequestError": "wire",
    "StaleWeightsError": "engine",
    "GenerateRequest": "wire_request", "GenerateResponse": "wire_response", "LoadWeightsRequest": "wire_request",
    "save_weights": "weights", "load_weights": "weights", "WeightsError": "weights",
    "prepare_sampler_params": "quantize", "quantize_fp8": "quantize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    """The public names above, imported from their module on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"pdm_jax.sampler.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'pdm_jax.sampler' has no attribute {name!r}")
