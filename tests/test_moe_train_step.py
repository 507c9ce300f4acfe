"""The RL step trains Qwen3-MoE: rl.router_aux_loss_coef x the router load-balancing loss enters the
loss (checked against the model's own aux loss and its autodiff gradient), logged as router_aux_loss,
in the one-shot, chunked and micro-batched steps; a dense model logs no router_aux_loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdm_jax.rl import train_step as ts, trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.qwen3 import Qwen3Config, init_model
from pdm_jax.rl.step_batch import StepBatch

V, P, T, K, B = 37, 3, 5, 4, 4
CFG = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8)
TR = trust_region.TrustRegionConfig(mask="pdm", estimator="bucket_exact")


def _setup(cfg=CFG):
    graphdef, params = nnx.split(init_model(cfg, seed=0))  # one compiled init, not dozens of eager programs
    rng = np.random.default_rng(0)
    pm = np.ones((B, P), bool)
    pm[0, 0] = False
    cm = np.arange(T)[None] < np.array([T, 3, 1, 4])[:, None]
    logmu = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.standard_normal((B, T, V)) * 2), -1))
    cids = rng.integers(0, V, (B, T)).astype(np.int32)
    topk = np.argsort(-logmu, -1)[..., :K].astype(np.int32)
    batch = StepBatch(prompt_ids=rng.integers(0, V, (B, P)).astype(np.int32), prompt_mask=pm, completion_ids=cids,
                      completion_mask=cm,
                      behavior_logprobs=np.take_along_axis(logmu, cids[..., None], -1)[..., 0].astype(np.float32),
                      topk_ids=topk, topk_logprobs=np.take_along_axis(logmu, topk, -1).astype(np.float32),
                      advantages=np.array([1.0, -0.5, 0.7, -1.2], np.float32), ref_logprobs=None)
    return graphdef, params, jax.tree.map(lambda x: None if x is None else jnp.asarray(x), batch)


def _model_aux(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], 1)
    return model(ids, attention_mask=mask, return_aux=True)[1]


def _vg(graphdef, params, batch, **kw):
    fn = ts.make_rl_loss(graphdef, TR, PolicyLossConfig(**kw))
    (loss, m), g = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, batch)
    return float(loss), jax.device_get(m), jax.device_get(g)


# Mixed sparse/dense-MLP layers (layer 0 dense, 1 sparse): the step trains it too.
MIXED = Qwen3Config(**{**CFG.__dict__, "mlp_only_layers": (0,)})


@pytest.mark.parametrize("chunk,cfg", [(0, CFG), (2, CFG), pytest.param(0, MIXED, marks=pytest.mark.slow)],
                         ids=["full", "chunked", "mixed"])
@pytest.mark.slow
def test_router_aux_loss_enters_the_loss(chunk, cfg):
    graphdef, params, batch = _setup(cfg)
    c = 0.3
    fns = [ts.make_rl_loss(graphdef, TR, PolicyLossConfig(logits_chunk_size=chunk, router_aux_loss_coef=coef))
           for coef in (0.0, c)]

    @jax.jit  # the model's aux loss and the two losses (without and with the coefficient): one program
    def values_and_grads(params, batch):
        return (jax.value_and_grad(lambda p: _model_aux(graphdef, p, batch))(params),
                [jax.value_and_grad(fn, has_aux=True)(params, batch) for fn in fns])

    (aux, aux_grad), (((l0, m0), g0), ((l1, m1), g1)) = jax.device_get(values_and_grads(params, batch))
    l0, l1 = float(l0), float(l1)
    assert float(aux) > 0.5  # ~1 for balanced routing (HF's normalisation: E * sum f_e P_e)
    np.testing.assert_allclose(m0["router_aux_loss"], float(aux), rtol=1e-6)
    np.testing.assert_allclose(l1 - l0, c * float(aux), rtol=1e-5)
    np.testing.assert_allclose(m1["policy_loss"], m0["policy_loss"], rtol=1e-6)
    want = jax.tree.map(lambda a, b: a + c * b, g0, jax.device_get(aux_grad))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g1, want)


@pytest.mark.slow
def test_micro_batched_step_logs_mean_of_micro_batch_aux():
    graphdef, params, batch = _setup()
    tx = optax.sgd(0.0)
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    lc = PolicyLossConfig(micro_batch_size=2, router_aux_loss_coef=0.1)
    steps = [ts.make_rl_train_step(graphdef, tx, TR, c) for c in (lc, PolicyLossConfig(micro_batch_size=2))]
    n = B // 2  # micro-batch j holds rows j, j + n

    @jax.jit  # both steps' metrics and the model's aux loss on each micro-batch: one program
    def metrics_and_micro_aux(state, batch):
        micro_aux = [_model_aux(graphdef, state.params, jax.tree.map(lambda x: x[j::n], batch)) for j in range(n)]
        return [step(state, batch)[1] for step in steps], micro_aux

    (m, m0), micro_aux = jax.device_get(metrics_and_micro_aux(state, batch))
    want = np.mean([float(a) for a in micro_aux])
    np.testing.assert_allclose(m["router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(m["loss"] - m0["loss"], 0.1 * want, rtol=1e-4)


def test_dense_model_has_no_router_metric_and_coef_is_checked():
    dense = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    graphdef, params, batch = _setup(dense)
    _, m, _ = _vg(graphdef, params, batch, router_aux_loss_coef=0.5)
    assert "router_aux_loss" not in m
    with pytest.raises(ValueError, match="rl.router_aux_loss_coef"):
        PolicyLossConfig(router_aux_loss_coef=-1.0)


def test_tiny_moe_config_builds_a_moe_model_and_the_default_stays_dense():
    import importlib.util
    import os

    from pdm_jax.config import get_base_config, model_config_from_fields, step_configs
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_moe.py")
    spec = importlib.util.spec_from_file_location("tiny_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    mcfg = model_config_from_fields(c.model, 16)
    assert (mcfg.num_experts, mcfg.num_experts_per_tok, mcfg.moe_intermediate_size) == (4, 2, 96)
    assert step_configs(c).policy_loss.router_aux_loss_coef == 0.0
    assert model_config_from_fields(get_base_config().model, 16).num_experts == 0
