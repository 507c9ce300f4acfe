"""pdm_jax.sampler.static_batching: the KV cache grown in segments (the engine's static-batching checks run
through `SamplingEngine` in tests/test_sampler_engine.py)."""
import numpy as np
import pytest

from pdm_jax.sampler.static_batching import cache_segments
from tests.test_sampler_engine import GEN, PROMPTS, TAU, make_engine, make_params


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture(scope="module")
def batch(params):
    return make_engine(params, version=3).generate(PROMPTS, temperature=TAU, seed=11, **GEN)


def test_growing_cache_segments_match_single_segment(params, batch):
    """Cache grown in segments (P+4, P+8, P+16 slots) == one P+16 cache: same tokens, logprobs to f32 rounding."""
    assert cache_segments(16, 4) == [4, 8, 16] and cache_segments(12, 64) == [12]
    assert cache_segments(128, 64) == [64, 128]
    eng = make_engine(params, version=3, first_cache_segment=4)
    b = eng.generate(PROMPTS, temperature=TAU, seed=11, **GEN)
    np.testing.assert_array_equal(b.completion_ids, batch.completion_ids)
    np.testing.assert_allclose(b.behavior_logprobs, batch.behavior_logprobs, atol=1e-5)
    np.testing.assert_allclose(b.topk_logprobs, batch.topk_logprobs, atol=1e-5, rtol=2e-6)
    # and a stop inside the second segment ends the row there
    stop = int(batch.completion_ids[0, 5])
    s = eng.generate(PROMPTS, temperature=TAU, seed=11, stop_token_ids=[stop], **GEN)
    t = int(np.flatnonzero(batch.completion_ids[0] == stop)[0]) + 1
    assert s.finish_reason[0] == "stop" and s.completion_mask[0].sum() == t
