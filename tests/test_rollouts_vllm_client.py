"""sampler.backend=vllm: the request we send, the documented response shape parsed exactly, malformed answers
named by field, the weight push through the fake server (== our engine), and RL steps against the fake server."""

import copy
import json
import math
import os

import httpx
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import vllm_api, wire
from pdm_jax.rollouts.client import SamplerError, SamplerRequestError
from pdm_jax.sampler.engine import SamplingEngine
from pdm_jax.rollout import GenerateParams, RolloutBatch
from pdm_jax.rollouts.vllm_client import (StaleVLLMWeightsError, VLLMResponseError, VLLMSampler, completions_request,
                                         export_hf_weights, parse_completions, prompt_seed)
from pdm_jax.sampler.vllm_fake import FakeVLLM, create_app, serve_in_thread
from pdm_jax.sampler.weights import save_weights, to_pure_dict

# An answer in vLLM's documented CompletionResponse / CompletionLogProbs shape for one prompt, n=2,
# logprobs=2, return_tokens_as_token_ids=true (hand-written from vLLM's serving_completion / protocol
# models, not captured from a running server: no vLLM here).  Choice 0 stops on stop id 3; at its
# position 1 the sampled token (4) is outside the top 2, so that dict has K + 1 = 3 entries, sampled
# first; -9999.0 is vLLM's JSON for -inf.
RECORDED = json.loads("""
{"id": "cmpl-8b1f3c", "object": "text_completion", "created": 1764500000, "model": "qwen3-tiny",
 "choices": [
  {"index": 0, "text": "", "finish_reason": "stop", "stop_reason": 3, "prompt_logprobs": null,
   "logprobs": {"text_offset": [0, 10, 20], "tokens": ["token_id:5", "token_id:4", "token_id:3"],
                "token_logprobs": [-0.105, -3.0, -0.01],
                "top_logprobs": [{"token_id:5": -0.105, "token_id:7": -2.4},
                                 {"token_id:4": -3.0, "token_id:1": -0.2, "token_id:6": -1.7},
                                 {"token_id:3": -0.01, "token_id:9": -9999.0}]}},
  {"index": 1, "text": "", "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null,
   "logprobs": {"text_offset": [0, 10, 20, 30], "tokens": ["token_id:7", "token_id:7", "token_id:2", "token_id:8"],
                "token_logprobs": [-2.4, -0.5, -0.7, -1.1],
                "top_logprobs": [{"token_id:7": -2.4, "token_id:5": -0.105},
                                 {"token_id:7": -0.5, "token_id:2": -1.0},
                                 {"token_id:2": -0.7, "token_id:8": -0.7},
                                 {"token_id:8": -1.1, "token_id:0": -0.5}]}}],
 "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}
""")
PARSE = dict(n=2, top_k_logprobs=2, max_new_tokens=4, stop_token_ids=[3], version=7)


def test_request_carries_the_options_that_fix_the_sampling_distribution():
    body = completions_request([[1, 2], [3]], GenerateParams(n=4, temperature=0.7, max_new_tokens=5, top_k_logprobs=3,
                                                             stop_token_ids=[11, 12], seed=99), model="m")
    assert body == {"prompt": [[1, 2], [3]], "n": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                    wire.MAX_TOKENS: 5, "stop_token_ids": [11, 12], "ignore_eos": True, "logprobs": 3,
                    "return_tokens_as_token_ids": True, "seed": 99, "echo": False, "stream": False,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                    "min_tokens": 0, "model": "m"}
    assert completions_request([[1]], GenerateParams(max_new_tokens=1, top_k_logprobs=0, seed=0,
                                                     top_k=5))["top_k"] == 5


def test_recorded_response_parses_to_the_expected_batch():
    rb = parse_completions(RECORDED, [[10, 11, 12]], **PARSE)
    assert rb.completion_ids.tolist() == [[5, 4, 3, 0], [7, 7, 2, 8]]
    assert rb.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    np.testing.assert_array_equal(rb.behavior_logprobs,
                                  np.float32([[-0.105, -3.0, -0.01, 0], [-2.4, -0.5, -0.7, -1.1]]))
    # top-K: the K largest, descending; ties (-0.7, ids 2 and 8) smaller id first; -9999 -> -inf
    assert rb.topk_ids.tolist() == [[[5, 7], [1, 6], [3, 9], [0, 0]], [[5, 7], [7, 2], [2, 8], [0, 8]]]
    np.testing.assert_array_equal(rb.topk_logprobs, np.float32([
        [[-0.105, -2.4], [-0.2, -1.7], [-0.01, -np.inf], [0, 0]],
        [[-0.105, -2.4], [-0.5, -1.0], [-0.7, -0.7], [-0.5, -1.1]]]))
    assert rb.finish_reason.tolist() == ["stop", "length"]
    assert rb.group_ids.tolist() == [0, 0] and rb.weights_version.tolist() == [7, 7]
    assert rb.prompt_ids.tolist() == [[10, 11, 12]] * 2 and rb.prompt_mask.all()
    # choices may arrive in any order; prompts are left-padded to the longest
    shuffled = dict(RECORDED, choices=RECORDED["choices"][::-1])
    two = dict(RECORDED, choices=[RECORDED["choices"][0], dict(RECORDED["choices"][1], index=1)])
    assert parse_completions(shuffled, [[10, 11, 12]], **PARSE).completion_ids.tolist() == rb.completion_ids.tolist()
    rb2 = parse_completions(two, [[10, 11, 12], [4]], **dict(PARSE, n=1))
    assert rb2.prompt_ids.tolist() == [[10, 11, 12], [0, 0, 4]] and rb2.group_ids.tolist() == [0, 1]


def _mutate(path, value):
    body = copy.deepcopy(RECORDED)
    node = body
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


LP0 = ("choices", 0, "logprobs")


@pytest.mark.parametrize("body, field", [
    (_mutate(("choices",), KeyError), "choices"),
    (_mutate(("choices",), RECORDED["choices"][:1]), "choices"),
    (_mutate(("choices", 1, "index"), 0), "choices[1].index"),
    (_mutate(("choices", 0, "logprobs"), None), "choices[0].logprobs"),
    (_mutate(LP0 + ("tokens", 1), "hello"), "choices[0].logprobs.tokens[1]"),
    (_mutate(LP0 + ("token_logprobs", 2), float("nan")), "choices[0].logprobs.token_logprobs[2]"),
    (_mutate(LP0 + ("token_logprobs", 2), None), "choices[0].logprobs.token_logprobs[2]"),
    (_mutate(LP0 + ("token_logprobs", 0), 0.5), "choices[0].logprobs.token_logprobs[0]"),
    (_mutate(LP0 + ("token_logprobs",), [-0.1, -3.0]), "choices[0].logprobs.token_logprobs"),
    (_mutate(LP0 + ("top_logprobs", 0), {"token_id:7": -2.4, "token_id:1": -0.1}),
     "choices[0].logprobs.top_logprobs[0]"),
    (_mutate(LP0 + ("top_logprobs", 0), {"token_id:5": -0.2, "token_id:7": -2.4}),
     "choices[0].logprobs.top_logprobs[0]"),
    (_mutate(LP0 + ("top_logprobs", 2), {"token_id:3": -0.01}), "choices[0].logprobs.top_logprobs[2]"),
    (_mutate(LP0 + ("top_logprobs", 1, "token_id:6"), float("inf")),
     "choices[0].logprobs.top_logprobs[1]['token_id:6']"),
    (_mutate(("choices", 0, "finish_reason"), "abort"), "choices[0].finish_reason"),
    (_mutate(("choices", 1, "finish_reason"), "stop"), "choices[1].finish_reason"),
    (_mutate(("choices", 0, "token_ids"), [5, 4, 2]), "choices[0].token_ids"),
    (_mutate(("error",), {"message": "boom"}), "error"),
    (_mutate(("object",), "chat.completion"), "object"),
])
def test_malformed_responses_are_named_by_field(body, field):
    with pytest.raises(VLLMResponseError) as e:
        parse_completions(body, [[10, 11, 12]], **PARSE)
    assert e.value.field == field, str(e.value)


def test_sampled_token_at_minus_inf_and_early_stop_id_are_refused():
    body = _mutate(LP0 + ("token_logprobs", 1), -9999.0)
    body["choices"][0]["logprobs"]["top_logprobs"][1]["token_id:4"] = -9999.0
    with pytest.raises(VLLMResponseError, match=r"token_logprobs\[1\].*processed_logprobs"):
        parse_completions(body, [[10, 11, 12]], **PARSE)
    with pytest.raises(VLLMResponseError, match=r"tokens\[0\].*stop id 5 before the end"):
        parse_completions(RECORDED, [[10, 11, 12]], **dict(PARSE, stop_token_ids=[3, 5]))


def test_prompt_seeds_are_deterministic_distinct_and_leave_room_for_the_n_children():
    n = 8
    seeds = {(s, i): prompt_seed(s, i, n) for s in (0, 1, 2, 2**63 - 1) for i in range(256)}
    assert prompt_seed(5, 3, n) == prompt_seed(5, 3, n)
    assert all(0 <= v <= 2**63 - 1 - n for v in seeds.values())
    ranges = sorted(seeds.values())  # vLLM seeds the children v .. v + n - 1: no two prompts share one
    assert all(b - a >= n for a, b in zip(ranges, ranges[1:]))


# ----------------------------------------------------------------------------- what the client trusts of a server
def test_the_vllm_client_refuses_a_gzip_bomb_by_its_decoded_size():
    """The vLLM client's answers are capped by what its request can need, decoded size counted, as the native
    client's are (0.5 MB on the wire once grew it to 3.3 GB)."""
    import gzip

    from pdm_jax.rollouts.vllm_client import VLLMSampler

    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of JSON whitespace: ~64 KB on the wire

    def handler(request):
        return httpx.Response(200, content=bomb, headers={"content-type": "application/json",
                                                          "content-encoding": "gzip"})

    v = VLLMSampler("http://vllm", model_config=None, weights_dir="/nonexistent", model="m", retries=2,
                    backoff_s=0.0, transport=httpx.MockTransport(handler))
    v._version = 0  # as after a first weight push
    with pytest.raises(SamplerError, match=r"larger than \d+ bytes \(decoded\); refused"):
        v.generate([[1, 2], [3]], n=2, max_new_tokens=3, top_k_logprobs=3, seed=0)
    assert v.retry_counts == {}  # not retried


def test_the_vllm_client_reads_a_deeply_nested_body_as_text_and_names_it():
    from pdm_jax.rollouts.client import SamplerProtocolError
    from pdm_jax.rollouts.vllm_client import VLLMSampler

    def handler(request):
        if request.url.path == vllm_api.VLLM_HEALTH:
            return httpx.Response(200)
        return httpx.Response(200, content=b"[" * 100_000 + b"]" * 100_000,
                              headers={"content-type": "application/json"})

    v = VLLMSampler("http://vllm", model_config=None, weights_dir="/nonexistent", retries=0,
                    transport=httpx.MockTransport(handler))
    with pytest.raises(SamplerProtocolError, match="not a model list"):
        v.health()


# ----------------------------------------------------------------------------- against the fake server
CFG = Qwen3Config(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=128)


def _params(seed):
    return to_pure_dict(nnx.state(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(seed)), nnx.Param))


@pytest.fixture
def fake_server(tmp_path):
    fake = FakeVLLM(weights_root=str(tmp_path), max_prompt_length=16, max_tokens=8, max_logprobs=5)
    url, stop = serve_in_thread(create_app(fake))
    yield fake, url
    stop()


@pytest.mark.slow
def test_weight_push_and_rollouts_through_the_fake_server_equal_our_engine(tmp_path, fake_server):
    fake, url = fake_server
    client = VLLMSampler(url, model_config=CFG, weights_dir=str(tmp_path / "hf"), retries=0)
    assert client.health()["model"] == "fake-vllm"
    with pytest.raises(ValueError, match="no weights version loaded"):
        client.generate([[1, 2]], max_new_tokens=3, seed=0)
    prompts, kw = [[1, 2, 3], [4, 5]], dict(n=3, temperature=0.9, max_new_tokens=6, top_k_logprobs=4,
                                           stop_token_ids=[7], seed=1234)
    for version, seed in ((1, 0), (2, 1)):
        params = _params(seed)
        save_weights(params, str(tmp_path / f"w{version}"), version=version)
        info = client.load_weights(str(tmp_path / f"w{version}"), version)
        assert info["path"] == client.hf_path(version) and fake.weights_path == os.path.realpath(info["path"])
        got = client.generate(prompts, **kw)
        engine = SamplingEngine(CFG, params, quantization="none", max_prompt_length=16, max_new_tokens=8)
        want = RolloutBatch.concatenate([engine.generate([p], **dict(kw, seed=prompt_seed(kw["seed"], i, kw["n"])))
                                         for i, p in enumerate(prompts)])
        for name in ("completion_ids", "completion_mask", "topk_ids", "group_ids", "finish_reason", "prompt_ids"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        np.testing.assert_allclose(got.behavior_logprobs, want.behavior_logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, rtol=0, atol=1e-6)
        assert got.weights_version.tolist() == [version] * 6
    assert sorted(os.listdir(tmp_path / "hf")) == ["v000001", "v000002"] and fake.reloads == 2
    # one request per prompt, own seed; the requests run concurrently, so they arrive in any order (the first
    # load also sent the two one-token logprobs-mode probes)
    assert sum(r["max_tokens"] == 1 for r in fake.requests) == 2
    assert sorted((r["prompt"], r["seed"]) for r in fake.requests[-2:]) == sorted(
        ([p], prompt_seed(1234, i, 3)) for i, p in enumerate(prompts))
    sent = fake.requests[-1]
    assert sent["ignore_eos"] is True and sent["return_tokens_as_token_ids"] is True and sent["model"] == "fake-vllm"
    assert fake.calls == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"] * 2
    # a reload the server refuses (a directory outside its --weights_root): resumed anyway, version kept
    outside = VLLMSampler(url, model_config=CFG, weights_dir=str(tmp_path.parent / f"{tmp_path.name}_out"), retries=0)
    outside.health()
    with pytest.raises(SamplerRequestError) as e:
        outside.load_weights(str(tmp_path / "w2"), 2)
    assert e.value.status == 403 and "outside --weights_root" in e.value.message and outside.version is None
    assert fake.calls[-3:] == ["/pause", "/collective_rpc", "/resume"] and fake._resumed.is_set()
    with pytest.raises(StaleVLLMWeightsError, match="stale weights version 1"):
        client.load_weights(str(tmp_path / "w1"), 1)
    with pytest.raises(SamplerRequestError) as e:  # vLLM's error body: message and param
        client.generate(prompts, **dict(kw, top_k_logprobs=6))
    assert e.value.status == 400 and e.value.field == "logprobs" and "max allowed: 5" in e.value.message


def test_exported_hf_directory_is_bit_exact_and_refuses_wrong_shapes(tmp_path):
    from pdm_jax.models.hf_io import from_pretrained

    params = _params(3)
    export_hf_weights(params, CFG, str(tmp_path / "hf"))
    back = to_pure_dict(nnx.state(from_pretrained(str(tmp_path / "hf")), nnx.Param))
    import jax
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the CLI that writes a server's starting directory: from a save_weights directory, same tensors
    from pdm_jax.rollouts.vllm_client import main
    save_weights(params, str(tmp_path / "w"), version=0)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    main(["--model_config", str(tmp_path / "config.json"), "--weights", str(tmp_path / "w"),
          "--out", str(tmp_path / "cli")])
    cli = to_pure_dict(nnx.state(from_pretrained(str(tmp_path / "cli")), nnx.Param))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(cli)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = jax.tree.map(lambda x: x, params)
    bad["norm"]["scale"] = np.zeros((31,), np.float32)
    with pytest.raises(ValueError, match=r"norm.*shape \(31,\).*\(32,\)"):
        export_hf_weights(bad, CFG, str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad")


def test_server_without_dev_mode_names_the_missing_route(tmp_path):
    fake = FakeVLLM(weights_root=str(tmp_path), dev_mode=False)
    url, stop = serve_in_thread(create_app(fake))
    try:
        save_weights(_params(0), str(tmp_path / "w0"), version=0)
        client = VLLMSampler(url, model_config=CFG, weights_dir=str(tmp_path / "hf"), retries=0)
        with pytest.raises(SamplerRequestError) as e:
            client.load_weights(str(tmp_path / "w0"), 0)
        assert e.value.status == 404 and "/collective_rpc" in str(e.value)
    finally:
        stop()


def test_a_server_returning_raw_logprobs_is_refused_at_the_first_load(tmp_path):
    """vLLM's default --logprobs-mode (raw: before temperature) would compare pi at tau with mu at 1: the
    client's probe (top-1 log-probability at temperatures 0.5 and 1.0) refuses it, naming the flag; a
    processed-logprobs server passes the same probe (test above)."""
    from pdm_jax.rollouts.vllm_client import VLLMLogprobsModeError

    fake = FakeVLLM(weights_root=str(tmp_path), max_prompt_length=16, max_tokens=8, max_logprobs=5,
                    logprobs_mode="raw_logprobs")
    url, stop = serve_in_thread(create_app(fake))
    try:
        save_weights(_params(0), str(tmp_path / "w1"), version=1)
        client = VLLMSampler(url, model_config=CFG, weights_dir=str(tmp_path / "hf"), retries=0)
        client.health()
        with pytest.raises(VLLMLogprobsModeError, match="returns raw log-probabilities .* --logprobs-mode "
                                                         "processed_logprobs"):
            client.load_weights(str(tmp_path / "w1"), 1)
        probes = [r for r in fake.requests if r["max_tokens"] == 1]
        assert sorted(r["temperature"] for r in probes) == [0.5, 1.0]
    finally:
        stop()


@pytest.mark.parametrize("overrides, match", [
    ({"sampler.backend": "sglang"}, "sampler.backend"),
    ({"sampler.backend": "vllm", "sampler.mode": "subprocess"}, "sampler.mode.*'remote' when sampler.backend"),
    ({"sampler.backend": "vllm", "sampler.mode": "remote", "sampler.address": ""}, "sampler.address"),
])
def test_config_names_a_bad_backend_setting(overrides, match):
    from test_trainer import tiny_test_config

    from pdm_jax.config import validate_config

    with pytest.raises(ValueError, match=match):
        validate_config(tiny_test_config(**overrides))


# ----------------------------------------------------------------------------- RL steps of the tiny task
@pytest.mark.slow
def test_rl_steps_with_the_vllm_backend_equal_the_in_process_engine(tmp_path, monkeypatch):
    """A few RL steps of the tiny task with sampler.backend=vllm against the fake server: every weights
    version goes through the HF export and reload, and the run's numbers equal an in-process run with the
    same (f32, unquantized) engine, seeds and request layout."""
    from test_trainer import DETERMINISTIC_KEYS, _rl_records, tiny_test_config

    from pdm_jax.trainer import Trainer

    fake = FakeVLLM(weights_root=str(tmp_path), max_prompt_length=64, max_tokens=5, max_logprobs=20)
    url, stop = serve_in_thread(create_app(fake))
    common = {"rl.steps": 2, "sampler.quantization": "none"}
    try:
        c = tiny_test_config(**common, **{"sampler.backend": "vllm", "sampler.mode": "remote",
                                          "sampler.address": url, "sampler.retries": 0})
        summary = Trainer(c, str(tmp_path / "vllm")).run()
    finally:
        stop()
    assert summary["steps"] == 2 and fake.reloads == 3  # version 0 at start, then one per RL step
    assert sorted(os.listdir(tmp_path / "vllm" / "weights_hf")) == ["v000001", "v000002"]
    # reference: our in-process engine with the client's request layout (one call per prompt, prompt_seed)
    from pdm_jax.rollouts.supervisor import SamplerSupervisor
    plain = SamplerSupervisor.generate

    def per_prompt(self, prompts, params=None, **kw):
        q = GenerateParams.of(params, **kw)
        return RolloutBatch.concatenate([plain(self, [p], q, seed=prompt_seed(q.seed, i, q.n))
                                         for i, p in enumerate(prompts)])

    monkeypatch.setattr(SamplerSupervisor, "generate", per_prompt)
    ref_summary = Trainer(tiny_test_config(**common, **{"sampler.mode": "in_process"}), str(tmp_path / "ref")).run()
    got, ref = _rl_records(tmp_path / "vllm"), _rl_records(tmp_path / "ref")
    assert sorted(got) == [1, 2]
    for s in (1, 2):
        for k in DETERMINISTIC_KEYS:
            assert math.isfinite(got[s][k])
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-6), (s, k)
    assert summary["final_accuracy"] == ref_summary["final_accuracy"]


def test_duplicate_top_logprobs_keys_and_out_of_range_ids_are_named_response_errors():
    """A top_logprobs entry naming a token twice (a repeated JSON key, which json keeps silently as its last value,
    or two spellings of one id) and a 10-digit id beyond int32 (numpy's OverflowError before) are the named
    SamplerResponseError (VLLMResponseError); an error body with a repeated key stays readable text."""
    from types import SimpleNamespace

    from pdm_jax.rollouts.client import SamplerResponseError

    raw = json.dumps(RECORDED).replace('{"token_id:5": -0.105, "token_id:7": -2.4}',
                                       '{"token_id:5": -0.105, "token_id:7": -2.4, "token_id:7": -0.01}', 1)
    assert raw.count('"token_id:7": -0.01') == 1
    assert json.loads(raw) == json.loads(raw)  # json alone: no error, the last value wins
    with pytest.raises(SamplerResponseError, match=r"an object names the key 'token_id:7' twice") as e:
        VLLMSampler._decode(SimpleNamespace(is_success=True), raw.encode())
    assert isinstance(e.value, VLLMResponseError) and e.value.field == "$"
    assert VLLMSampler._decode(SimpleNamespace(is_success=False), b'{"error": 1, "error": 2}') == {"error": 2}
    assert VLLMSampler._decode(SimpleNamespace(is_success=True), json.dumps(RECORDED).encode()) == RECORDED
    spelled = _mutate(LP0 + ("top_logprobs", 0), {"token_id:5": -0.105, "token_id:7": -2.4, "token_id:07": -0.01})
    with pytest.raises(SamplerResponseError, match=r"top_logprobs\[0\]: names token 7 twice \(key 'token_id:07'\)"):
        parse_completions(spelled, [[10, 11, 12]], **PARSE)
    for path, value in ((LP0 + ("top_logprobs", 0), {"token_id:5": -0.105, "token_id:9999999999": -2.4}),
                        (LP0 + ("tokens", 0), "token_id:2147483648")):
        with pytest.raises(SamplerResponseError, match=r"token id (9999999999|2147483648) is beyond 2147483647"):
            parse_completions(_mutate(path, value), [[10, 11, 12]], **PARSE)
    edge = _mutate(LP0 + ("top_logprobs", 0), {"token_id:5": -0.105, "token_id:2147483647": -2.4})
    assert parse_completions(edge, [[10, 11, 12]], **PARSE).topk_ids[0, 0].tolist() == [5, 2147483647]
