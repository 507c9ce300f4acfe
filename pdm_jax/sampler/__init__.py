"""pdm_jax.sampler: the rollout service (the trainer's side of it is ``pdm_jax.rollouts``).

wire       the HTTP schema: field names, GenerateRequest / GenerateResponse / LoadWeightsRequest,
           request validation (RequestError names wire fields), JSON / msgpack body codecs
quantize   bf16 / fp8-e4m3 (per-output-channel, weight-only) sampler weights
weights    save_weights / load_weights: the trainer -> sampler weight-sync format
engine     SamplingEngine (jitted KV-cache prefill + decode -> RolloutBatch)
server     python -m pdm_jax.sampler.server (FastAPI + uvicorn)
vllm_fake  python -m pdm_jax.sampler.vllm_fake: a fake of that server backed by SamplingEngine (tests, rehearsal)

Names are imported lazily so that `python -m pdm_jax.sampler.server --help`
does not pay for importing JAX.
"""

import importlib

_EXPORTS = {
    "SamplingEngine": "engine", "RequestError": "wire",
    "StaleWeightsError": "engine",
    "GenerateRequest": "wire", "GenerateResponse": "wire", "LoadWeightsRequest": "wire",
    "save_weights": "weights", "load_weights": "weights", "WeightsError": "weights",
    "prepare_sampler_params": "quantize", "quantize_fp8": "quantize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    """The public names above, imported from their module on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"pdm_jax.sampler.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'pdm_jax.sampler' has no attribute {name!r}")
