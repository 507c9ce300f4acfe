"""pdm_jax.sampler.wire: the schema's error bodies and the health body, without a server or an engine; the
helpers the request, response and codec tests share (tests/test_sampler_wire_*.py)."""
import time

import numpy as np
import pytest

from pdm_jax.rollout import RolloutBatch
from pdm_jax.sampler import wire, wire_codec, wire_response

CODECS = [pytest.param(False, id="json"), pytest.param(True, id="msgpack")]
BATCH_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behavior_logprobs", "topk_ids",
                "topk_logprobs", "weights_version", "group_ids", "finish_reason")


def through(obj, use_msgpack):
    return wire_codec.loads(wire_codec.dumps(obj, msgpack=use_msgpack), msgpack=use_msgpack)


def make_batch(k=3):
    """Two prompts (lengths 3 and 1) x n=2, completions of lengths 2, 3, 1, 3 (T = 3), as the engine lays them out."""
    prompts = [[5, 6, 7], [9]]
    lengths = [2, 3, 1, 3]
    n, t, p = 4, 3, 3
    rng = np.random.default_rng(0)
    mask = np.arange(t)[None, :] < np.array(lengths)[:, None]
    prompt_ids = np.zeros((n, p), np.int32)
    prompt_mask = np.zeros((n, p), bool)
    for r in range(n):
        pr = prompts[r // 2]
        prompt_ids[r, p - len(pr):] = pr
        prompt_mask[r, p - len(pr):] = True
    topk_lp = np.where(mask[..., None], -rng.random((n, t, k), np.float32) * 3, 0.0).astype(np.float32)
    if k >= 3:
        topk_lp[0, 1, 2] = -np.inf  # an id removed by top-k/top-p filtering
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=np.where(mask, rng.integers(1, 30, (n, t)), 0).astype(np.int32), completion_mask=mask,
        behavior_logprobs=np.where(mask, -rng.random((n, t), np.float32), 0.0).astype(np.float32),
        topk_ids=np.where(mask[..., None], rng.integers(0, 30, (n, t, k)), 0).astype(np.int32), topk_logprobs=topk_lp,
        weights_version=np.array([7, 7, 7, 8], np.int32), group_ids=np.array([0, 0, 1, 1], np.int32),
        finish_reason=np.array(["stop", "length", "stop", "length"], dtype=object))
    return prompts, batch


def assert_batches_equal(a, b):
    for f in BATCH_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape and x.dtype == y.dtype, (f, x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_array_equal(x, y, err_msg=f)


# ----------------------------------------------------------------------------- requests
@pytest.mark.parametrize("use_msgpack", CODECS)
def test_error_and_health_bodies(use_msgpack):
    body = through(wire.error_body("max_tokens: too many", "max_tokens", "invalid_request"), use_msgpack)
    assert body == {"error": {"message": "max_tokens: too many", "field": "max_tokens", "type": "invalid_request"}}
    assert wire.decode_error(body) == ("max_tokens: too many", "max_tokens")
    assert wire.decode_error("busy") == ("busy", None) and wire.error_detail("busy") == "busy"
    h = wire_response.health_with_stats(wire_response.health_body(wire_response.EngineHealth(
        model="m", quantization="fp8", version=3, compute_dtype="bfloat16", vocab_size=32, max_prompt_length=8,
        max_new_tokens=16, weights_path=None, weight_noise=0.05, weight_noise_seed=3)),
                               requests=1, generated_tokens=5, uptime_s=0.5)
    assert (h["weight_noise"], h["weight_noise_seed"]) == (0.05, 3)
    assert list(h) == ["status", "model", "quantization", "weight_noise", "weight_noise_seed", "version",
                       "compute_dtype", "vocab_size",
                       "max_prompt_length", "max_new_tokens", "weights_path", "loading", "requests",
                       "generated_tokens", "uptime_s"]
    assert h["loading"] is None
    busy = wire_response.health_body(wire_response.EngineHealth(
        model="m", quantization="fp8", version=3, compute_dtype="bfloat16", vocab_size=32, max_prompt_length=8,
        max_new_tokens=16, weights_path=None, loading={"version": 4, "since": time.monotonic() - 2.0}))["loading"]
    assert busy["version"] == 4 and 2.0 <= busy["seconds"] < 60
    assert wire_response.weights_response(wire_response.weights_loaded(version=3, path="/w", seconds=0.1,
                                                                       reloaded=False)) == {
        "status": "ok", "version": 3, "path": "/w", "seconds": 0.1, "reloaded": False}


