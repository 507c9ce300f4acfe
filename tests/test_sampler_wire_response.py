"""pdm_jax.sampler.wire_response: responses through both codecs, the exact JSON layout of a response (the bytes
the server sends), the "columns" form, and bad responses refused naming the field."""
import json

import numpy as np
import pytest

from pdm_jax.rollout import RolloutBatch
from pdm_jax.rollouts.client import response_to_batch
from pdm_jax.sampler import wire, wire_codec, wire_response
from tests.test_sampler_wire import CODECS, assert_batches_equal, make_batch, through


@pytest.mark.parametrize("use_msgpack", CODECS)
@pytest.mark.parametrize("k", [3, 0])
def test_generate_response_round_trip(use_msgpack, k):
    prompts, batch = make_batch(k)
    resp = wire_response.GenerateResponse(batch, model="qwen3(test)", prompt_tokens=4)
    assert resp.weights_version == 7 and resp.completion_tokens == 9
    body = through(resp.to_wire(), use_msgpack)
    back = wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=k)
    assert back.model == "qwen3(test)" and back.prompt_tokens == 4 and back.weights_version == 7
    assert_batches_equal(back.batch, batch)
    assert np.isneginf(back.batch.topk_logprobs).sum() == (1 if k else 0)
    assert_batches_equal(response_to_batch(prompts, body, top_k_logprobs=k), batch)


@pytest.mark.parametrize("use_msgpack", CODECS)
@pytest.mark.parametrize("k", [3, 0])
def test_generate_response_columns_give_the_same_batch_as_choices(use_msgpack, k):
    """response_format "columns" (what SamplerClient asks for): the batch's arrays whole, decoded to the same batch."""
    prompts, batch = make_batch(k)
    resp = wire_response.GenerateResponse(batch, model="qwen3(test)", prompt_tokens=4)
    body = through(resp.to_wire("columns"), use_msgpack)
    assert wire.CHOICES not in body and body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9}
    cols = body["columns"]
    assert sorted(cols) == sorted(["token_ids", "lengths", "logprobs", "top_logprobs", "prompt_index",
                                   "finish_reason", "weights_version"])
    assert np.asarray(cols["lengths"]).tolist() == [2, 3, 1, 3]
    back = wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=k)
    assert back.model == "qwen3(test)" and back.prompt_tokens == 4 and back.weights_version == 7
    assert_batches_equal(back.batch, batch)
    assert_batches_equal(back.batch, wire_response.GenerateResponse.from_wire(through(resp.to_wire(), use_msgpack),
                                                                              prompts,
                                                                     top_k_logprobs=k).batch)
    if use_msgpack:  # a handful of packed arrays, not ~4 per row
        assert len(wire_codec.dumps(resp.to_wire("columns"), msgpack=True)) < len(wire_codec.dumps(resp.to_wire(),
                                                                                                   msgpack=True))
    # the per-token columns hold the 9 generated tokens, row after row, not the padded 4 x 3
    assert np.asarray(cols["token_ids"]).tolist() == batch.completion_ids[batch.completion_mask.astype(bool)].tolist()
    assert np.shape(cols["top_logprobs"]["logprobs"]) in (((9, k),) if k else ((0, 0), (0,)))  # K = 0: no table
    # a padded body (servers before the packed columns: [N, T(, K)] arrays) decodes to the same batch
    padded = dict(body, columns=dict(cols, token_ids=batch.completion_ids, logprobs=batch.behavior_logprobs,
                                     top_logprobs=dict(ids=batch.topk_ids, logprobs=batch.topk_logprobs)))
    assert_batches_equal(wire_response.GenerateResponse.from_wire(through(padded, use_msgpack), prompts,
                                                                  top_k_logprobs=k).batch,
                         batch)


def _columns_body(mutate):
    prompts, batch = make_batch(3)
    body = through(wire_response.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire("columns"), True)
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
        wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)


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
        wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=20, rows=4, max_new_tokens=8)
    good = wire_response.GenerateResponse(batch, model="m", prompt_tokens=4)
    for fmt, where in (("columns", r"columns\.lengths"), ("choices", r"choices\[\*\]\.token_ids")):
        body = through(good.to_wire(fmt), True)
        assert_batches_equal(wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=4,
                                                             max_new_tokens=3).batch, batch)
        with pytest.raises(ValueError, match=where + r": a row of 3 tokens, beyond the request's max_new_tokens 2"):
            wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=4, max_new_tokens=2)
        with pytest.raises(ValueError, match=r"the request asked for 8 rows"):
            wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3, rows=8)
        for bad in (-1, 2.5, "3", None):
            with pytest.raises(ValueError, match="top_k_logprobs: must be an integer >= 0"):
                wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=bad)


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
        wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
    with pytest.raises(ValueError, match="response_format"):
        wire_response.GenerateResponse(make_batch()[1]).to_wire("colums")


def test_generate_response_json_layout_is_the_vllm_shaped_schema():
    prompts, batch = make_batch(k=1)
    got = json.loads(wire_codec.dumps(wire_response.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(),
                                      msgpack=False))
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
    body = through(wire_response.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(), True)
    del body["usage"], body["model"]
    body["choices"] = body["choices"][::-1]
    for c in body["choices"]:
        del c["weights_version"]  # falls back to the response-level version
    back = wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
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
    body = through(wire_response.GenerateResponse(batch, model="m", prompt_tokens=4).to_wire(), False)
    assert len(body["choices"][1]["token_ids"]) == 3 and body["choices"][0]["prompt_index"] == 0
    mutate(body["choices"])
    if words is None:
        wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)
        return
    with pytest.raises(ValueError, match=words):
        wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=3)


# ----------------------------------------------------------------------------- bodies, errors, health


@pytest.mark.parametrize("use_msgpack", CODECS)
def test_columns_without_top_k_carry_no_table_whatever_the_token_count(use_msgpack):
    """top_k_logprobs 0: the columns send no [sum T_r, 0] table (msgpack's `loads` refuses an empty array past
    MAX_EMPTY_ARRAY_ITEMS rows, so a 300 x 256-token batch did not decode); the batch comes back with K = 0."""
    n, t = 300, 256
    assert n * t > wire_codec.MAX_EMPTY_ARRAY_ITEMS
    rng = np.random.default_rng(1)
    batch = RolloutBatch(
        prompt_ids=np.full((n, 1), 5, np.int32), prompt_mask=np.ones((n, 1), bool),
        completion_ids=rng.integers(1, 30, (n, t)).astype(np.int32), completion_mask=np.ones((n, t), bool),
        behavior_logprobs=-rng.random((n, t), np.float32), topk_ids=np.zeros((n, t, 0), np.int32),
        topk_logprobs=np.zeros((n, t, 0), np.float32), weights_version=np.zeros((n,), np.int32),
        group_ids=np.zeros((n,), np.int32), finish_reason=np.array(["length"] * n, dtype=object))
    body = through(wire_response.GenerateResponse(batch, model="m", prompt_tokens=1).to_wire("columns"), use_msgpack)
    assert np.shape(body["columns"]["top_logprobs"]["ids"]) in ((0, 0), (0,))
    back = wire_response.GenerateResponse.from_wire(body, [[5]], top_k_logprobs=0, rows=n, max_new_tokens=t)
    assert_batches_equal(back.batch, batch)
    # a table where none was asked for is refused, naming it
    for ids in ([[1]], [[1], [1, 2]], [[]] * 3):  # a table, a ragged one, empty rows of the wrong count
        bad = dict(body, columns=dict(body["columns"], top_logprobs=dict(ids=ids, logprobs=[])))
        with pytest.raises(ValueError, match=r"columns\.top_logprobs\.ids"):
            wire_response.GenerateResponse.from_wire(bad, [[5]], top_k_logprobs=0)
    # an earlier server's [sum T_r, 0] table (JSON: one empty list per token) still reads
    small = dict(body, columns=dict(body["columns"], token_ids=[3, 4], lengths=[2], logprobs=[-0.5, -0.25],
                                    prompt_index=[0], weights_version=[0], finish_reason=["length"],
                                    top_logprobs=dict(ids=[[], []], logprobs=[[], []])))
    got = wire_response.GenerateResponse.from_wire(small, [[5]], top_k_logprobs=0).batch
    assert got.topk_ids.shape == (1, 2, 0) and got.completion_ids.tolist() == [[3, 4]]
