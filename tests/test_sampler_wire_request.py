"""pdm_jax.sampler.wire_request: generation and weights requests through both codecs, and validation errors that
name fields by their wire names."""
import numpy as np
import pytest

from pdm_jax.rollout import GenerateParams
from pdm_jax.sampler import wire, wire_request
from tests.test_sampler_wire import CODECS, through


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_generate_request_round_trip(use_msgpack):
    req = wire_request.GenerateRequest(prompts=[[1, 2, 3], [4]], n=2, temperature=0.7, max_new_tokens=12,
                                       top_k_logprobs=5,
                               stop_token_ids=[3, 9], seed=2**63 - 1, top_p=0.9, top_k=4)
    body = through(req.to_wire(), use_msgpack)
    assert body["max_tokens"] == 12 and body["logprobs"] == 5 and "max_new_tokens" not in body
    assert wire_request.GenerateRequest.from_wire(body) == req
    assert req.params() == GenerateParams(n=2, temperature=0.7, max_new_tokens=12, top_k_logprobs=5,
                                          stop_token_ids=[3, 9], seed=2**63 - 1, top_p=0.9, top_k=4)
    assert wire_request.GenerateRequest.of(req.prompts, req.params()) == req
    assert req.prompt_tokens == 4


def test_generate_request_defaults_and_vllm_forms():
    req = wire_request.GenerateRequest.from_wire({"prompt": [1, 2], "top_k": -1, "logprobs": None, "model": "x",
                                          "stream": False})
    assert req == wire_request.GenerateRequest(prompts=[[1, 2]], n=1, temperature=1.0, max_new_tokens=16,
                                               top_k_logprobs=0,
                                       stop_token_ids=[], seed=None, top_p=1.0, top_k=0)
    packed = wire_request.GenerateRequest.from_wire(through({"prompt": np.array([[1, 2], [3, 4]], np.int32)}, True))
    assert packed.prompts == [[1, 2], [3, 4]]
    # values are carried as given; their checks are the engine's (validate_request)
    assert wire_request.GenerateRequest.from_wire({"prompt": [[1]], "n": None}).n is None


@pytest.mark.parametrize("body,field,words", [
    ({"prompt": [[1]], "bogus": 1, "zzz": 2}, "bogus", "unknown field"),
    ({"prompt": [[1]], "stream": True}, "stream", "not supported"),
    ({"n": 1}, "prompt", "missing"),
    ({"prompt": [[1]], "stop_token_ids": 3}, "stop_token_ids", "list"),
])
def test_generate_request_structure_errors_name_the_wire_field(body, field, words):
    with pytest.raises(wire.RequestError) as e:
        wire_request.GenerateRequest.from_wire(body)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ") and words in str(e.value)


LIMITS = dict(vocab_size=32, max_prompt_length=8, max_new_tokens_limit=16, max_stop_tokens=4, max_sequences=64)
OK_KW = dict(n=1, temperature=1.0, max_new_tokens=4, top_k_logprobs=2, stop_token_ids=[], seed=None, top_p=1.0,
             top_k=0)


@pytest.mark.parametrize("prompts,kw,field", [
    ([], {}, "prompt"),
    ([[1] * 9], {}, "prompt"),
    ([[32]], {}, "prompt"),
    ([[1]], dict(n=0), "n"),
    ([[1]] * 9, dict(n=8), "n"),
    ([[1]], dict(temperature=-1.0), "temperature"),
    ([[1]], dict(temperature=1e-9), "temperature"),
    ([[1]], dict(top_p=0.0), "top_p"),
    ([[1]], dict(top_k=-1), "top_k"),
    ([[1]], dict(max_new_tokens=0), "max_tokens"),     # Python max_new_tokens, wire max_tokens
    ([[1]], dict(max_new_tokens=17), "max_tokens"),
    ([[1]], dict(top_k_logprobs=33), "logprobs"),      # Python top_k_logprobs, wire logprobs
    ([[1]], dict(stop_token_ids=[1, 2, 3, 4, 5]), "stop_token_ids"),
    ([[1]], dict(stop_token_ids=[32]), "stop_token_ids"),
    ([[1]], dict(seed=2**63), "seed"),
])
def test_validation_errors_name_the_wire_field(prompts, kw, field):
    with pytest.raises(wire.RequestError) as e:
        wire_request.validate_request(prompts, GenerateParams(**{**OK_KW, **kw}), **LIMITS)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    assert wire_request.validate_request([(1, 2), np.array([3])], GenerateParams(**OK_KW), **LIMITS) == [[1, 2], [3]]


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_load_weights_request_round_trip_and_errors(use_msgpack):
    req = wire_request.LoadWeightsRequest("weights/3", 3)
    assert wire_request.LoadWeightsRequest.from_wire(through(req.to_wire(), use_msgpack)) == req
    for body, field in (({"version": 1}, "path"), ({"path": "", "version": 1}, "path"),
                        ({"path": "w", "version": -1}, "version"), ({"path": "w", "version": True}, "version"),
                        ({"path": "w"}, "version")):
        with pytest.raises(wire.RequestError) as e:
            wire_request.LoadWeightsRequest.from_wire(body)
        assert e.value.field == field and str(e.value).startswith(f"{field}: ")


# ----------------------------------------------------------------------------- responses


def test_response_format_request_field():
    req = wire_request.GenerateRequest(prompts=[[1, 2]], response_format="columns")
    body = through(req.to_wire(), True)
    assert body["response_format"] == "columns" and wire_request.GenerateRequest.from_wire(body) == req
    assert not hasattr(req.params(), "response_format") and "response_format" not in wire_request.GenerateRequest(
        prompts=[[1]]).to_wire()  # the default: the vLLM-shaped choices, bodies unchanged
    with pytest.raises(wire.RequestError) as e:
        wire_request.GenerateRequest.from_wire({"prompt": [[1]], "response_format": "rows"})
    assert e.value.field == "response_format" and "'rows'" in str(e.value)


def test_a_huge_number_is_never_echoed_whole():
    """A 4,000-digit ``n`` is refused with a message that shows it cut, not an 8 KB echo."""
    with pytest.raises(wire.RequestError) as e:
        wire_request.validate_request([[1]], GenerateParams(**{**OK_KW, "n": 10 ** 4000}), **LIMITS)
    assert e.value.field == "n" and len(str(e.value)) < 200, str(e.value)
