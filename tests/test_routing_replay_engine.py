"""Routing replay end to end (issue #14): the engine's per-token routing (static and continuous
batching) == the routing the model computes on the sampled sequences; the wire carries it; a train
step replaying the sampler's own routing == the step without replay (f32, unquantized)."""
import jax
import numpy as np
import pytest
from flax import nnx

from pdm_jax.rl import train_step as ts, trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rollout import ROUTING_PAD, GenerateParams, RolloutBatch
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.sampler import wire, wire_codec, wire_request, wire_response
from pdm_jax.sampler.engine import SamplingEngine
from pdm_jax.sampler.wire import RequestError
from conftest import TINY_MOE

CFG = TINY_MOE
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
GEN = dict(n=2, max_new_tokens=10, top_k_logprobs=3, temperature=1.0, seed=5, stop_token_ids=[0])


@pytest.fixture(scope="module")
def model():
    m = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    for _, p in nnx.iter_graph(m):  # peaked distributions and router logits: stable top-k
        if isinstance(p, nnx.Param):
            p[...] = p[...] * 6.0
    return m


@pytest.fixture(scope="module")
def static_rollouts(model):
    return _engine(model, "static").generate(PROMPTS, return_routing=True, **GEN)


def _engine(model, batching, **kw):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return SamplingEngine(CFG, params, quantization="none", max_prompt_length=16, max_new_tokens=16,
                          max_batch_size=4, batching=batching, max_slots=4, min_new_tokens_bucket=8, **kw)


def _model_routing(model, rb: RolloutBatch):
    ids = np.concatenate([rb.prompt_ids, rb.completion_ids], axis=1)
    mask = np.concatenate([rb.prompt_mask, rb.completion_mask], axis=1)
    _, routed = model(ids, attention_mask=mask, return_routing=True)
    return np.asarray(routed)


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous", "continuous, prefill_chunk 1"])
def test_engine_routing_equals_model_routing(model, static_rollouts, batching):
    """The engine's routing == the model's; continuous batching's prompt store prefilled whole or a prompt at a
    time (the prefill's routing written chunk by chunk)."""
    chunk = int(batching.split("prefill_chunk ")[1]) if "prefill_chunk" in batching else 0
    engine = _engine(model, batching.split(",")[0], prefill_chunk=chunk)
    rb = static_rollouts if batching == "static" else engine.generate(PROMPTS, return_routing=True, **GEN)
    plain = engine.generate(PROMPTS, **GEN)
    assert plain.routed_experts is None
    np.testing.assert_array_equal(rb.completion_ids, plain.completion_ids)  # routing changes no token
    n, p, t = rb.num_sequences, rb.prompt_ids.shape[1], rb.completion_ids.shape[1]
    r = rb.routed_experts
    assert r.shape == (n, p + t, CFG.num_hidden_layers, 2) and r.dtype == np.int8
    # routing exactly where the sampler fed a token: real prompt tokens and all but each row's last token
    lengths = rb.completion_mask.sum(1)
    fed = np.concatenate([rb.prompt_mask, np.arange(t)[None] < lengths[:, None] - 1], axis=1)
    np.testing.assert_array_equal(np.all(r >= 0, axis=(2, 3)), fed)
    assert np.all(r[~fed] == ROUTING_PAD)
    assert len(set(lengths.tolist())) > 1  # rows of different lengths (stop id 0)
    want = _model_routing(model, rb)
    np.testing.assert_array_equal(np.sort(r, -1)[fed], np.sort(want, -1)[fed])


def test_dense_engine_refuses_return_routing():
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    engine = SamplingEngine(cfg, params, max_prompt_length=8, max_new_tokens=8, max_batch_size=2)
    with pytest.raises(RequestError) as e:
        engine.generate([[1, 2]], return_routing=True)
    assert e.value.field == wire.RETURN_ROUTING


def _hand_batch():
    rng = np.random.default_rng(0)
    pm = np.array([[False, True, True], [True, True, True]])
    cm = np.array([[True, True, False, False], [True, True, True, True]])
    routed = rng.integers(0, 4, (2, 7, 2, 2)).astype(np.int8)
    routed[:, :3][~pm] = ROUTING_PAD
    routed[:, 3:][~cm] = ROUTING_PAD
    return RolloutBatch(prompt_ids=np.where(pm, 5, 0), prompt_mask=pm, completion_ids=np.where(cm, 7, 0),
                        completion_mask=cm, behavior_logprobs=np.zeros((2, 4)), topk_ids=np.zeros((2, 4, 1)),
                        topk_logprobs=np.zeros((2, 4, 1)), weights_version=np.zeros(2), group_ids=np.array([0, 1]),
                        finish_reason=np.array(["stop", "length"], object), routed_experts=routed)


def test_wire_round_trip_of_routed_experts():
    rb = _hand_batch()
    prompts = [[5, 5], [5, 5, 5]]
    resp = wire_response.GenerateResponse(rb, model="m", prompt_tokens=5).to_wire()
    assert resp[wire.CHOICES][0][wire.ROUTED_EXPERTS].shape == (2 + 2, 2, 2)  # the row's real tokens only
    for msgpack in (False, True):
        body = wire_codec.loads(wire_codec.dumps(resp, msgpack=msgpack), msgpack=msgpack)
        back = wire_response.GenerateResponse.from_wire(body, prompts, top_k_logprobs=1).batch
        np.testing.assert_array_equal(back.routed_experts, rb.routed_experts)
        columns = wire_codec.loads(wire_codec.dumps(wire_response.GenerateResponse(rb).to_wire("columns"),
                                                    msgpack=msgpack), msgpack=msgpack)
        by_columns = wire_response.GenerateResponse.from_wire(columns, prompts, top_k_logprobs=1).batch
        np.testing.assert_array_equal(by_columns.routed_experts, rb.routed_experts)
        assert by_columns.routed_experts.dtype == back.routed_experts.dtype
    no_routing = wire_response.GenerateResponse(rb.replace(routed_experts=None)).to_wire()
    assert wire.ROUTED_EXPERTS not in no_routing[wire.CHOICES][0]
    assert wire_response.GenerateResponse.from_wire(no_routing, prompts, top_k_logprobs=1).batch.routed_experts is None
    req = wire_request.GenerateRequest(prompts=prompts, return_routing=True)
    assert wire_request.GenerateRequest.from_wire(req.to_wire()).params().return_routing is True
    assert wire.RETURN_ROUTING not in wire_request.GenerateRequest(prompts=prompts).to_wire()
    with pytest.raises(RequestError, match="return_routing"):
        wire_request.validate_request(prompts, GenerateParams(max_new_tokens=4, top_k_logprobs=0, seed=0,
                                                              return_routing="yes"),
                                      vocab_size=32, max_prompt_length=16, max_new_tokens_limit=8, max_stop_tokens=8)


def test_concatenate_and_step_batch_pad_routing():
    rb = _hand_batch()
    short = rb.replace(prompt_ids=rb.prompt_ids[:, 1:], prompt_mask=rb.prompt_mask[:, 1:],
                       completion_ids=rb.completion_ids[:, :2], completion_mask=rb.completion_mask[:, :2],
                       behavior_logprobs=rb.behavior_logprobs[:, :2], topk_ids=rb.topk_ids[:, :2],
                       topk_logprobs=rb.topk_logprobs[:, :2],
                       routed_experts=np.concatenate([rb.routed_experts[:, 1:3], rb.routed_experts[:, 3:5]], 1))
    both = RolloutBatch.concatenate([short.select(np.arange(1)), rb.select(np.arange(1, 2))])
    want = rb.routed_experts.copy()
    want[0, 5:] = ROUTING_PAD  # row 0 cut to 2 completion tokens (its real ones), then padded back
    np.testing.assert_array_equal(both.routed_experts, want)
    sb = StepBatch.from_rollouts(rb, np.zeros(2, np.float32), prompt_len=5, completion_len=6, routing=True)
    assert sb.routed_experts.shape == (2, 11, 2, 2)
    np.testing.assert_array_equal(sb.routed_experts[:, 2:9], rb.routed_experts)
    assert np.all(sb.routed_experts[:, :2] == ROUTING_PAD) and np.all(sb.routed_experts[:, 9:] == ROUTING_PAD)
    assert StepBatch.from_rollouts(rb, np.zeros(2, np.float32), prompt_len=3, completion_len=4).routed_experts is None
    with pytest.raises(ValueError, match="routed_experts"):
        StepBatch.from_rollouts(rb.replace(routed_experts=None), np.zeros(2, np.float32), prompt_len=3,
                                completion_len=4, routing=True)
    with pytest.raises(ValueError, match="routed_experts"):
        rb.replace(routed_experts=np.zeros((2, 6, 2, 2), np.int8))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 4])
def test_train_step_replaying_sampler_routing_equals_no_replay(model, static_rollouts, chunk):
    """f32 unquantized sampler == trainer weights: replaying the sampler's routing changes nothing
    (loss, metrics, gradients); replaying other experts does change the loss (the replay is used)."""
    rb = static_rollouts
    adv = np.linspace(-1, 1, rb.num_sequences).astype(np.float32)
    batch = StepBatch.from_rollouts(rb, adv, prompt_len=16, completion_len=16, routing=True)
    graphdef, params = nnx.split(model)
    tr = trust_region.TrustRegionConfig(mask="pdm", estimator="bucket_exact")
    fn = jax.jit(jax.value_and_grad(ts.make_rl_loss(graphdef, tr, PolicyLossConfig(logits_chunk_size=chunk)),
                                    has_aux=True))
    (l0, m0), g0 = fn(params, batch.replace(routed_experts=None))
    (l1, m1), g1 = fn(params, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-7)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # Gradient entries reach ~2.6 (sums over the batch's tokens, summed in another order with the replay): 1e-5
    # absolute is f32 rounding at that scale.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g1, g0)
    other = np.where(batch.routed_experts >= 0, (batch.routed_experts + 1) % CFG.num_experts, ROUTING_PAD)
    (l2, _), _ = fn(params, batch.replace(routed_experts=other.astype(np.int8)))
    assert abs(float(l2) - float(l0)) > 1e-4


def _base_config(**fields):
    from pdm_jax.config import get_base_config
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    for k, v in fields.items():
        group, name = k.split(".")
        c[group][name] = v
    return c


@pytest.mark.parametrize("fields, needle", [
    ({}, "model.moe_routing_replay = True: needs a mixture-of-experts model"),
    ({"model.num_experts": 4, "sampler.backend": "vllm", "sampler.mode": "remote", "sampler.address": "h:1"},
     "model.moe_routing_replay = True: needs the pdm_jax sampler"),
])
def test_routing_replay_config_errors(fields, needle):
    from pdm_jax.config import validate_config
    c = _base_config(**fields)
    c.model.moe_routing_replay = True
    with pytest.raises(ValueError, match=needle):
        validate_config(c)
    c.model.moe_routing_replay = False
    validate_config(c)
    c = _base_config(**{"model.num_experts": 4})
    c.model.moe_routing_replay = True
    validate_config(c)


def test_routing_replay_refused_for_a_dense_loaded_model():
    from pdm_jax.config import check_routing_replay_model
    c = _base_config()
    c.model.moe_routing_replay = True
    with pytest.raises(ValueError, match="model.moe_routing_replay = True: .*the loaded model is dense"):
        check_routing_replay_model(c, Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                  num_hidden_layers=1, num_attention_heads=1,
                                                  num_key_value_heads=1, head_dim=8))
    check_routing_replay_model(c, CFG)
