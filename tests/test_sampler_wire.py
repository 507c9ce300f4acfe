"""pdm_jax.sampler.wire: the sampler's HTTP schema, without a server or an engine.

Round trips of requests and responses through both body codecs, the exact JSON
layout of a response (the bytes the server sends), and validation errors that
name fields by their wire names.
"""
import json
import time

import msgpack
import numpy as np
import pytest

from pdm_jax.rollout import RolloutBatch
from pdm_jax.sampler import wire
from pdm_jax.rollouts.client import response_to_batch

CODECS = [pytest.param(False, id="json"), pytest.param(True, id="msgpack")]
BATCH_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behavior_logprobs", "topk_ids",
                "topk_logprobs", "weights_version", "group_ids", "finish_reason")


def through(obj, use_msgpack):
    return wire.loads(wire.dumps(obj, msgpack=use_msgpack), msgpack=use_msgpack)


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
def test_generate_request_round_trip(use_msgpack):
    req = wire.GenerateRequest(prompts=[[1, 2, 3], [4]], n=2, temperature=0.7, max_new_tokens=12, top_k_logprobs=5,
                               stop_token_ids=[3, 9], seed=2**63 - 1, top_p=0.9, top_k=4)
    body = through(req.to_wire(), use_msgpack)
    assert body["max_tokens"] == 12 and body["logprobs"] == 5 and "max_new_tokens" not in body
    assert wire.GenerateRequest.from_wire(body) == req
    assert req.engine_kwargs() == dict(n=2, temperature=0.7, max_new_tokens=12, top_k_logprobs=5,
                                       stop_token_ids=[3, 9], seed=2**63 - 1, top_p=0.9, top_k=4)
    assert req.prompt_tokens == 4


def test_generate_request_defaults_and_vllm_forms():
    req = wire.GenerateRequest.from_wire({"prompt": [1, 2], "top_k": -1, "logprobs": None, "model": "x",
                                          "stream": False})
    assert req == wire.GenerateRequest(prompts=[[1, 2]], n=1, temperature=1.0, max_new_tokens=16, top_k_logprobs=0,
                                       stop_token_ids=[], seed=None, top_p=1.0, top_k=0)
    packed = wire.GenerateRequest.from_wire(through({"prompt": np.array([[1, 2], [3, 4]], np.int32)}, True))
    assert packed.prompts == [[1, 2], [3, 4]]
    # values are carried as given; their checks are the engine's (validate_request)
    assert wire.GenerateRequest.from_wire({"prompt": [[1]], "n": None}).n is None


@pytest.mark.parametrize("body,field,words", [
    ({"prompt": [[1]], "bogus": 1, "zzz": 2}, "bogus", "unknown field"),
    ({"prompt": [[1]], "stream": True}, "stream", "not supported"),
    ({"n": 1}, "prompt", "missing"),
    ({"prompt": [[1]], "stop_token_ids": 3}, "stop_token_ids", "list"),
])
def test_generate_request_structure_errors_name_the_wire_field(body, field, words):
    with pytest.raises(wire.RequestError) as e:
        wire.GenerateRequest.from_wire(body)
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
        wire.validate_request(prompts, **{**OK_KW, **kw}, **LIMITS)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    assert wire.validate_request([(1, 2), np.array([3])], **OK_KW, **LIMITS) == [[1, 2], [3]]


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_load_weights_request_round_trip_and_errors(use_msgpack):
    req = wire.LoadWeightsRequest("weights/3", 3)
    assert wire.LoadWeightsRequest.from_wire(through(req.to_wire(), use_msgpack)) == req
    for body, field in (({"version": 1}, "path"), ({"path": "", "version": 1}, "path"),
                        ({"path": "w", "version": -1}, "version"), ({"path": "w", "version": True}, "version"),
                        ({"path": "w"}, "version")):
        with pytest.raises(wire.RequestError) as e:
            wire.LoadWeightsRequest.from_wire(body)
        assert e.value.field == field and str(e.value).startswith(f"{field}: ")


# ----------------------------------------------------------------------------- responses
@pytest.mark.parametrize("use_msgpack", CODECS)
@pytest.mark.parametrize("k", [3, 0])
def test_generate_response_round_trip(use_msgpack, k):
    prompts, batch = make_batch(k)
    resp = wire.GenerateResponse(batch, model="qwen3(test)", prompt_tokens=4)
    assert resp.weights_version == 7 and resp.completion_tokens == 9
    body = through(resp.to_wire(), use_msgpack)
    back = wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=k)
    assert back.model == "qwen3(test)" and back.prompt_tokens == 4 and back.weights_version == 7
    assert_batches_equal(back.batch, batch)
    assert np.isneginf(back.batch.topk_logprobs).sum() == (1 if k else 0)
    assert_batches_equal(response_to_batch(prompts, body, top_k_logprobs=k), batch)


@pytest.mark.parametrize("use_msgpack", CODECS)
@pytest.mark.parametrize("k", [3, 0])
def test_generate_response_columns_give_the_same_batch_as_choices(use_msgpack, k):
    """response_format "columns" (what SamplerClient asks for): the batch's arrays whole, decoded to the same batch."""
    prompts, batch = make_batch(k)
    resp = wire.GenerateResponse(batch, model="qwen3(test)", prompt_tokens=4)
    body = through(resp.to_wire("columns"), use_msgpack)
    assert wire.CHOICES not in body and body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9}
    cols = body["columns"]
    assert sorted(cols) == sorted(["token_ids", "lengths", "logprobs", "top_logprobs", "prompt_index",
                                   "finish_reason", "weights_version"])
    assert np.asarray(cols["lengths"]).tolist() == [2, 3, 1, 3]
    back = wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=k)
    assert back.model == "qwen3(test)" and back.prompt_tokens == 4 and back.weights_version == 7
    assert_batches_equal(back.batch, batch)
    assert_batches_equal(back.batch, wire.GenerateResponse.from_wire(through(resp.to_wire(), use_msgpack), prompts,
                                                                     top_k_logprobs=k).batch)
    if use_msgpack:  # a handful of packed arrays, not ~4 per row
        assert len(wire.dumps(resp.to_wire("columns"), msgpack=True)) < len(wire.dumps(resp.to_wire(), msgpack=True))
    # the per-token columns hold the 9 generated tokens, row after row, not the padded 4 x 3
    assert np.asarray(cols["token_ids"]).tolist() == batch.completion_ids[batch.completion_mask.astype(bool)].tolist()
    assert np.shape(cols["top_logprobs"]["logprobs"]) in (((9, k),) if k else ((0, 0), (0,)))  # K = 0: no table
    # a padded body (servers before the packed columns: [N, T(, K)] arrays) decodes to the same batch
    padded = dict(body, columns=dict(cols, token_ids=batch.completion_ids, logprobs=batch.behavior_logprobs,
                                     top_logprobs=dict(ids=batch.topk_ids, logprobs=batch.topk_logprobs)))
    assert_batches_equal(wire.GenerateResponse.from_wire(through(padded, use_msgpack), prompts, top_k_logprobs=k).batch,
                         batch)


def _columns_body(mutate):
    prompts, batch = make_batch(3)
    body = through(wire.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire("columns"), True)
    mutate(body["columns"])
    return prompts, body


@pytest.mark.parametrize("mutate, where", [
    (lambda c: c.update(lengths=np.array([2, 3, 1, 4], np.int32)), "columns.lengths"),  # 10 tokens, 9 sent
    (lambda c: c.update(lengths=np.array([2, 3, 1], np.int32)), "columns.lengths"),  # 3 of 4 rows
    (lambda c: c.update(lengths=np.array([2, 3, -1, 5], np.int32)), "columns.lengths"),  # sums to 9, one < 0
    (lambda c: c.update(prompt_index=np.array([0, 0, 1, 2], np.int32)), "columns.prompt_index"),  # 2 prompts
    (lambda c: c["top_logprobs"].update(ids=np.zeros((9, 2), np.int32)), "columns.top_logprobs.ids"),  # K 2 != 3
    (lambda c: c.update(logprobs=np.zeros((8,), np.float32)), "columns.logprobs"),  # 8 of 9 tokens
    (lambda c: c.update(logprobs=np.zeros((4, 3), np.float32)), "columns.logprobs"),  # padded beside packed ids
    (lambda c: c.update(token_ids=np.zeros((9,), np.float32)), "columns.token_ids"),  # not integers
    (lambda c: c.update(token_ids=np.zeros((4, 3), np.float32)), "columns.token_ids"),  # padded, not integers
    (lambda c: c.pop("weights_version"), "columns.weights_version"),
    (lambda c: c.update(finish_reason=["stop"] * 3), "columns.finish_reason"),
    (lambda c: c.update(top_logprobs=[1, 2]), "columns.top_logprobs"),
    # integers beyond int32 would wrap silently in a cast (prompt 2**32 -> prompt 0)
    (lambda c: c.update(prompt_index=np.array([0, 0, 1, 2**32], np.int64)), "columns.prompt_index"),
    (lambda c: c.update(token_ids=c["token_ids"].astype(np.int64) + 2**32), "columns.token_ids"),
    (lambda c: c.update(lengths=[2, 3, True, 3]), "columns.lengths"),  # a bool numpy would read as 1
    (lambda c: c.update(logprobs=["-0.5"] + [0] * 8), "columns.logprobs"),  # a string numpy would parse
    (lambda c: c["logprobs"].__setitem__(0, np.nan), "columns.logprobs"),  # never a silent NaN
    (lambda c: c["top_logprobs"]["logprobs"].__setitem__((1, 0), 5.0), "columns.top_logprobs.logprobs"),
    (lambda c: c.update(logprobs=[10**400] + [0] * 8), "columns.logprobs"),  # beyond any float
    (lambda c: c.update(finish_reason=["stop", "length", "eos", "stop"]), "columns.finish_reason"),
    # a negative version would make the logged staleness wrong (trainer version - row version)
    (lambda c: c.update(weights_version=np.array([0, -1, 0, 0], np.int32)), "columns.weights_version"),
])
def test_bad_columns_are_refused_naming_the_column(mutate, where):
    prompts, body = _columns_body(mutate)
    with pytest.raises(ValueError, match=where.replace(".", r"\.") + ":"):
        wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)


def test_bodies_beyond_the_request_are_refused_before_they_are_unpacked():
    """With the request's rows and max_new_tokens (what SamplerClient passes), a small packed body whose rows x longest
    row would be gigabytes ([20000, 2000, 20] here, from 2000 tokens) is refused naming columns.lengths, before any
    [N, T] array is built; so are more rows or longer rows than the request's, in the choices form too; a
    top_k_logprobs that is not an integer >= 0 is refused on the columns path as on the choices path."""
    prompts, batch = make_batch(3)
    lengths = np.zeros(20000, np.int32)
    lengths[0] = 2000
    cols = {"token_ids": np.ones(2000, np.int32), "lengths": lengths, "logprobs": -np.ones(2000, np.float32),
            "top_logprobs": {"ids": np.zeros((2000, 20), np.int32), "logprobs": -np.ones((2000, 20), np.float32)},
            "prompt_index": np.zeros(20000, np.int32), "finish_reason": ["length"] * 20000,
            "weights_version": np.zeros(20000, np.int32)}
    body = through({"columns": cols}, True)
    with pytest.raises(ValueError, match=r"columns\.lengths: the request asked for 4 rows .* has 20000"):
        wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=20, rows=4, max_new_tokens=8)
    good = wire.GenerateResponse(batch, model="m", prompt_tokens=4)
    for fmt, where in (("columns", r"columns\.lengths"), ("choices", r"choices\[\*\]\.token_ids")):
        body = through(good.to_wire(fmt), True)
        assert_batches_equal(wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=4,
                                                             max_new_tokens=3).batch, batch)
        with pytest.raises(ValueError, match=where + r": a row of 3 tokens, beyond the request's max_new_tokens 2"):
            wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=4, max_new_tokens=2)
        with pytest.raises(ValueError, match=r"the request asked for 8 rows"):
            wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=8)
        for bad in (-1, 2.5, "3", None):
            with pytest.raises(ValueError, match="top_k_logprobs: must be an integer >= 0"):
                wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=bad)


@pytest.mark.parametrize("change, words", [
    (lambda b: b.update(choices=[]), "not both"),
    (lambda b: b.update(usage=[1]), "usage: must be a map"),
    (lambda b: b["usage"].update(prompt_tokens="4"), "usage.prompt_tokens"),
    (lambda b: b.update(model=[1]), "model: must be a string"),
])
def test_bad_response_headers_are_refused(change, words):
    prompts, body = _columns_body(lambda c: None)
    change(body)
    with pytest.raises(ValueError, match=words):
        wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
    with pytest.raises(ValueError, match="response_format"):
        wire.GenerateResponse(make_batch()[1]).to_wire("colums")


def test_response_format_request_field():
    req = wire.GenerateRequest(prompts=[[1, 2]], response_format="columns")
    body = through(req.to_wire(), True)
    assert body["response_format"] == "columns" and wire.GenerateRequest.from_wire(body) == req
    assert "response_format" not in req.engine_kwargs() and "response_format" not in wire.GenerateRequest(
        prompts=[[1]]).to_wire()  # the default: the vLLM-shaped choices, bodies unchanged
    with pytest.raises(wire.RequestError) as e:
        wire.GenerateRequest.from_wire({"prompt": [[1]], "response_format": "rows"})
    assert e.value.field == "response_format" and "'rows'" in str(e.value)


def test_generate_response_json_layout_is_the_vllm_shaped_schema():
    prompts, batch = make_batch(k=1)
    got = json.loads(wire.dumps(wire.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(), msgpack=False))
    assert list(got) == ["object", "model", "weights_version", "choices", "usage"]
    assert got["object"] == "text_completion" and got["weights_version"] == 7
    assert got["usage"] == {"prompt_tokens": 4, "completion_tokens": 9}
    c = got["choices"][3]
    assert list(c) == ["index", "prompt_index", "token_ids", "logprobs", "top_logprobs", "finish_reason",
                       "weights_version"]
    assert c["index"] == 3 and c["prompt_index"] == 1 and c["finish_reason"] == "length" and c["weights_version"] == 8
    assert c["token_ids"] == batch.completion_ids[3].tolist()
    np.testing.assert_allclose(c["logprobs"], batch.behavior_logprobs[3])
    assert list(c["top_logprobs"]) == ["ids", "logprobs"] and c["top_logprobs"]["ids"] == batch.topk_ids[3].tolist()
    assert len(got["choices"][2]["token_ids"]) == 1  # cut to the completion length


def test_response_without_usage_or_model_and_out_of_order_choices():
    prompts, batch = make_batch()
    body = through(wire.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(), True)
    del body["usage"], body["model"]
    body["choices"] = body["choices"][::-1]
    for c in body["choices"]:
        del c["weights_version"]  # falls back to the response-level version
    back = wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
    assert back.model == "" and back.prompt_tokens == 4
    np.testing.assert_array_equal(back.batch.weights_version, [7, 7, 7, 7])
    np.testing.assert_array_equal(back.batch.completion_ids, batch.completion_ids)


@pytest.mark.parametrize("mutate,words", [
    (lambda c: c[1].update(logprobs=c[1]["logprobs"][:1]),
     r"choices\[1\]\.logprobs: must have shape \[3\], got shape \[1\]"),
    (lambda c: c[1]["top_logprobs"].update(ids=c[1]["top_logprobs"]["ids"][:-1]),
     r"choices\[1\]\.top_logprobs\.ids: must have shape \[3, 3\], got shape \[2, 3\]"),
    (lambda c: c[1]["top_logprobs"].update(ids=[list(r) for r in zip(*c[1]["top_logprobs"]["ids"])][:2] + [[1, 2, 3]]),
     None),  # transposed but square (3 x 3): a valid shape, nothing to tell it from
    (lambda c: c[1]["top_logprobs"]["logprobs"][2].pop(), r"choices\[1\]\.top_logprobs\.logprobs: "),
    (lambda c: c[1]["top_logprobs"].update(ids=[[2 ** 32 + 7] * 3] * 3),
     r"choices\[1\]\.top_logprobs\.ids: integers must fit int32"),
    (lambda c: c[1]["top_logprobs"].update(ids=[["25", "20", "21"]] * 3),
     r"choices\[1\]\.top_logprobs\.ids: must hold integers, got '25' \(str\)"),
    (lambda c: c[1].update(top_logprobs=None), r"choices\[1\]\.top_logprobs: must be a map of ids and logprobs"),
    (lambda c: c[1].update(logprobs=[False, False, False]), r"choices\[1\]\.logprobs: must hold numbers or null"),
    (lambda c: c[0].update(token_ids=[1.5, 2.0]), r"choices\[0\]\.token_ids: must hold integers"),
    (lambda c: c[0].update(index="z"), r"choices\[0\]\.index: must be an integer"),
    (lambda c: c.append([1, 2]), r"choices: must be a list of maps"),
    (lambda c: c[0].update(prompt_index=-1), r"choices\[0\]\.prompt_index: must be an integer in \[0, 2\)"),
    (lambda c: c[0].update(prompt_index=2), r"choices\[0\]\.prompt_index: must be an integer in \[0, 2\)"),
    (lambda c: c[1].update(weights_version=-3), r"choices\[\*\]\.weights_version: must be integers in "
                                                 r"\[0, 2147483647\] \(weights versions\), got -3"),
    (lambda c: c[1].update(weights_version=2.5), r"choices\[\*\]\.weights_version: .* got 2\.5"),
])
def test_bad_choices_are_refused_naming_the_field(mutate, words):
    """The ``choices`` form (vLLM's shape; another server may send it) is checked field by field, as the columns
    are: one log-prob for three tokens, a short or ragged top-K list, ids past int32 or given as strings, a missing
    top-K, bools for log-probs, a prompt index outside the request (-1 would be Python's last prompt)."""
    prompts, batch = make_batch()
    body = through(wire.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(), False)
    assert len(body["choices"][1]["token_ids"]) == 3 and body["choices"][0]["prompt_index"] == 0
    mutate(body["choices"])
    if words is None:
        wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
        return
    with pytest.raises(ValueError, match=words):
        wire.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)


def test_a_huge_number_is_never_echoed_whole():
    """A 4,000-digit ``n`` is refused with a message that shows it cut, not an 8 KB echo."""
    with pytest.raises(wire.RequestError) as e:
        wire.validate_request([[1]], **{**OK_KW, "n": 10 ** 4000}, **LIMITS)
    assert e.value.field == "n" and len(str(e.value)) < 200, str(e.value)


# ----------------------------------------------------------------------------- bodies, errors, health
def test_decode_body_statuses():
    assert wire.decode_body(b'{"a": 1}', None) == {"a": 1}
    assert wire.decode_body(msgpack.packb({"a": 1}), "application/x-msgpack") == {"a": 1}
    for body, ctype, status, words in ((b"a=1", "text/plain", 415, "Content-Type"), (b"{", "application/json", 400,
                                       "malformed JSON"), (b"\xc1", wire.MSGPACK, 400, "malformed msgpack"),
                                       (b"[1]", "application/json", 400, "object (map)")):
        with pytest.raises(wire.BodyError) as e:
            wire.decode_body(body, ctype)
        assert e.value.status == status and words in str(e.value)
    assert wire.response_is_msgpack("application/msgpack", None)
    assert wire.response_is_msgpack("*/*", wire.MSGPACK) and wire.response_is_msgpack(None, wire.MSGPACK)
    assert not wire.response_is_msgpack("application/json", wire.MSGPACK)


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_error_and_health_bodies(use_msgpack):
    body = through(wire.error_body("max_tokens: too many", "max_tokens", "invalid_request"), use_msgpack)
    assert body == {"error": {"message": "max_tokens: too many", "field": "max_tokens", "type": "invalid_request"}}
    assert wire.decode_error(body) == ("max_tokens: too many", "max_tokens")
    assert wire.decode_error("busy") == ("busy", None) and wire.error_detail("busy") == "busy"
    h = wire.health_with_stats(wire.health_body(model="m", quantization="fp8", version=3, compute_dtype="bfloat16",
                                                vocab_size=32, max_prompt_length=8, max_new_tokens=16,
                                                weights_path=None, weight_noise=0.05, weight_noise_seed=3),
                               requests=1, generated_tokens=5, uptime_s=0.5)
    assert (h["weight_noise"], h["weight_noise_seed"]) == (0.05, 3)
    assert list(h) == ["status", "model", "quantization", "weight_noise", "weight_noise_seed", "version",
                       "compute_dtype", "vocab_size",
                       "max_prompt_length", "max_new_tokens", "weights_path", "loading", "requests",
                       "generated_tokens", "uptime_s"]
    assert h["loading"] is None
    busy = wire.health_body(model="m", quantization="fp8", version=3, compute_dtype="bfloat16", vocab_size=32,
                            max_prompt_length=8, max_new_tokens=16, weights_path=None,
                            loading={"version": 4, "since": time.monotonic() - 2.0})["loading"]
    assert busy["version"] == 4 and 2.0 <= busy["seconds"] < 60
    assert wire.weights_response(wire.weights_loaded(version=3, path="/w", seconds=0.1, reloaded=False)) == {
        "status": "ok", "version": 3, "path": "/w", "seconds": 0.1, "reloaded": False}


def test_wire_json_nonfinite_and_array_roundtrip():
    a = np.array([[0.5, -np.inf], [1.0, 2.0]], np.float32)
    j = wire.loads(wire.dumps({"x": a}, msgpack=False), msgpack=False)
    assert j["x"] == [[0.5, None], [1.0, 2.0]]
    np.testing.assert_array_equal(wire.float_list(j["x"]), a)
    m = wire.loads(wire.dumps({"x": a, "i": np.arange(3, dtype=np.int32)}, msgpack=True), msgpack=True)
    np.testing.assert_array_equal(m["x"], a) and np.testing.assert_array_equal(m["i"], [0, 1, 2])
    with pytest.raises(ValueError, match="malformed"):
        wire.loads(b"{", msgpack=False)


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_columns_without_top_k_carry_no_table_whatever_the_token_count(use_msgpack):
    """top_k_logprobs 0: the columns send no [sum T_r, 0] table (msgpack's `loads` refuses an empty array past
    MAX_EMPTY_ARRAY_ITEMS rows, so a 300 x 256-token batch did not decode); the batch comes back with K = 0."""
    n, t = 300, 256
    assert n * t > wire.MAX_EMPTY_ARRAY_ITEMS
    rng = np.random.default_rng(1)
    batch = RolloutBatch(
        prompt_ids=np.full((n, 1), 5, np.int32), prompt_mask=np.ones((n, 1), bool),
        completion_ids=rng.integers(1, 30, (n, t)).astype(np.int32), completion_mask=np.ones((n, t), bool),
        behavior_logprobs=-rng.random((n, t), np.float32), topk_ids=np.zeros((n, t, 0), np.int32),
        topk_logprobs=np.zeros((n, t, 0), np.float32), weights_version=np.zeros((n,), np.int32),
        group_ids=np.zeros((n,), np.int32), finish_reason=np.array(["length"] * n, dtype=object))
    body = through(wire.GenerateResponse(batch, model="m", prompt_tokens=1).to_wire("columns"), use_msgpack)
    assert np.shape(body["columns"]["top_logprobs"]["ids"]) in ((0, 0), (0,))
    back = wire.GenerateResponse.from_wire(body, [[5]], top_k_logprobs=0, rows=n, max_new_tokens=t)
    assert_batches_equal(back.batch, batch)
    # a table where none was asked for is refused, naming it
    for ids in ([[1]], [[1], [1, 2]], [[]] * 3):  # a table, a ragged one, empty rows of the wrong count
        bad = dict(body, columns=dict(body["columns"], top_logprobs=dict(ids=ids, logprobs=[])))
        with pytest.raises(ValueError, match=r"columns\.top_logprobs\.ids"):
            wire.GenerateResponse.from_wire(bad, [[5]], top_k_logprobs=0)
    # an earlier server's [sum T_r, 0] table (JSON: one empty list per token) still reads
    small = dict(body, columns=dict(body["columns"], token_ids=[3, 4], lengths=[2], logprobs=[-0.5, -0.25],
                                    prompt_index=[0], weights_version=[0], finish_reason=["length"],
                                    top_logprobs=dict(ids=[[], []], logprobs=[[], []])))
    got = wire.GenerateResponse.from_wire(small, [[5]], top_k_logprobs=0).batch
    assert got.topk_ids.shape == (1, 2, 0) and got.completion_ids.tolist() == [[3, 4]]
