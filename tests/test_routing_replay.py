"""Routing replay (issue #14): a Qwen3-MoE forward that runs given experts per (position, layer),
weighted by its own router's probabilities over them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models import moe as moe_lib
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

B, T = 2, 6


def _model(norm_topk_prob=True, scan_layers=True):
    cfg = Qwen3Config(vocab_size=29, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=norm_topk_prob)
    m = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 29)
    mask = jnp.ones((B, T), bool).at[0, 0].set(False)
    return m, ids, mask


def _loss_and_grads(model, ids, mask, routed=None):
    graphdef, params = nnx.split(model)

    def f(p):
        logits = nnx.merge(graphdef, p)(ids, attention_mask=mask, routed_experts=routed)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)
    return jax.jit(jax.value_and_grad(f))(params)


def _forward(model, ids, mask, routed_experts=None, return_routing=False):
    """``model(ids, attention_mask=mask, ...)`` as one compiled program (not one program per operation)."""
    graphdef, params = nnx.split(model)

    def f(p, routed):
        return nnx.merge(graphdef, p)(ids, attention_mask=mask, routed_experts=routed, return_routing=return_routing)
    return jax.jit(f)(params, routed_experts)


@pytest.mark.parametrize("norm_topk_prob,scan_layers", [(True, True), (False, False)])
@pytest.mark.slow
def test_replaying_own_routing_equals_no_replay(norm_topk_prob, scan_layers):
    model, ids, mask = _model(norm_topk_prob, scan_layers)
    logits, routed = _forward(model, ids, mask, return_routing=True)
    assert routed.shape == (B, T, 2, 2) and routed.dtype == jnp.int32
    assert np.all(np.sort(np.asarray(routed), -1)[..., 0] < np.sort(np.asarray(routed), -1)[..., 1])  # distinct
    replay = _forward(model, ids, mask, routed)
    np.testing.assert_allclose(replay, logits, rtol=1e-6, atol=1e-6)
    # the order of the k replayed experts does not matter
    np.testing.assert_allclose(_forward(model, ids, mask, routed[..., ::-1]), logits, rtol=1e-5, atol=1e-6)
    l0, g0 = _loss_and_grads(model, ids, mask)
    l1, g1 = _loss_and_grads(model, ids, mask, routed)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)


def test_replaying_other_experts_changes_which_experts_run():
    model, ids, mask = _model()
    logits, routed = model(ids, attention_mask=mask, return_routing=True)
    other = (routed + 1) % 4  # a different pair of distinct experts everywhere
    _, used = model(ids, attention_mask=mask, routed_experts=other, return_routing=True)
    np.testing.assert_array_equal(used, other)
    replay = model(ids, attention_mask=mask, routed_experts=other)
    assert np.abs(np.asarray(replay - logits)).max() > 1e-3
    _, g = _loss_and_grads(model, ids, mask, other)
    router_grad = g["layers"]["mlp"]["gate"]["kernel"]
    assert np.abs(np.asarray(router_grad)).max() > 0  # the router still learns through the weights


def test_route_replayed_weights_against_numpy():
    logits = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    experts = jnp.array([[0, 1], [3, 2], [1, 3], [2, 0], [0, 3]])
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    want = np.take_along_axis(p, np.asarray(experts), -1)
    for norm in (False, True):
        w, e, probs = moe_lib.route_replayed(logits, experts, norm)
        np.testing.assert_allclose(w, want / want.sum(-1, keepdims=True) if norm else want, rtol=1e-6)
        np.testing.assert_array_equal(e, experts)
    # replaying route's own choice gives route's weights
    w0, e0, _ = moe_lib.route(logits, 2, True)
    np.testing.assert_allclose(moe_lib.route_replayed(logits, e0, True)[0], w0, rtol=1e-6)


def test_bad_routed_experts_and_dense_model_refused():
    model, ids, mask = _model()
    with pytest.raises(ValueError, match="routed_experts must be"):
        model(ids, attention_mask=mask, routed_experts=jnp.zeros((B, T, 2, 3), jnp.int32))
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=29, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="need a MoE model"):
        dense(ids, return_routing=True)
