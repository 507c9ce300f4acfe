"""Adversarial tests: bad and edge inputs across the public API.

The project rule: bad input gets a clear error naming the field and the value,
or a documented, counted fallback -- never a silent NaN, lost data, a hang or a
crash far from the cause. Tests marked ``xfail(strict=True)`` reproduce bugs
found by this file (one test per bug; the reason names the function); the
others pin behaviours verified to hold under the same attacks.
"""

from __future__ import annotations

import functools
import json
import math
import re
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from pdm_jax import config as config_lib
from pdm_jax.rl import objectives
from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.config import validate_config
from conftest import data_spec

# --------------------------------------------------------------------------- helpers

B, T, V, K = 2, 3, 8, 3


def _tr_inputs(seed=0, vocab=V, k=K):
    """Consistent trust-region inputs: mu = softmax(perturbed logits), top-K and log mu(y) of it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, vocab)).astype(np.float32)
    logmu = np.asarray(jax.nn.log_softmax(logits + 0.5 * rng.normal(size=(B, T, vocab)), -1))
    tokens = rng.integers(0, vocab, size=(B, T)).astype(np.int32)
    topk_lp, topk_ids = jax.lax.top_k(logmu, k)
    behavior = np.take_along_axis(logmu, tokens[..., None], -1)[..., 0]
    valid = np.ones((B, T), bool)
    valid[1, 2] = False
    return dict(logits=logits, tokens=tokens, topk_ids=np.array(topk_ids), topk_logprobs=np.array(topk_lp),
                behavior_logprobs=behavior, advantages=np.array([1.0, -1.0], np.float32), valid_mask=valid)


@functools.partial(jax.jit, static_argnames="config")
def _mask_loss_grad_compiled(d, config):
    # One program per config, shared by every test's inputs (all of one shape), instead of the gradient's
    # operations compiled one by one (the trainer runs the mask under jit too).
    def loss(z):
        m, lp, st = tr.trust_region_mask_and_logprobs(
            z, d["tokens"], d["topk_ids"], d["topk_logprobs"], d["behavior_logprobs"], d["advantages"],
            d["valid_mask"], config)
        return jnp.sum(jnp.where(m, lp, 0.0)), (m, lp, st)

    return jax.grad(loss, has_aux=True)(jnp.asarray(d["logits"]))


def _mask_loss_grad(d, config):
    """(mask, logprobs, stats, grad of sum(mask * logprobs) w.r.t. the logits)."""
    grad, (mask, logprobs, stats) = _mask_loss_grad_compiled(d, config)
    return np.asarray(mask), np.asarray(logprobs), {k: float(v) for k, v in stats.items()}, np.asarray(grad)


def _config(**fields) -> ml_collections.ConfigDict:
    c = config_lib.get_base_config()
    for path, value in fields.items():
        node = c
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return c


TINY_QWEN3 = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module")
def engine():
    from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
    from pdm_jax.sampler.engine import SamplingEngine

    cfg = Qwen3Config(**TINY_QWEN3)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    return SamplingEngine(cfg, model, max_prompt_length=8, max_new_tokens=4, max_batch_size=2,
                          min_prompt_bucket=8, min_new_tokens_bucket=4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
    from pdm_jax.models.hf_io import save_pretrained

    path = str(tmp_path_factory.mktemp("hf") / "good")
    save_pretrained(Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3), rngs=nnx.Rngs(0)), path)
    return path


def _hf_variant(hf_dir, tmp_path, mutate) -> str:
    path = str(tmp_path / "variant")
    shutil.copytree(hf_dir, path)
    mutate(path)
    return path


def _edit_hf_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# =========================================================================== trust region


@pytest.mark.parametrize("where", ["valid", "pad"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_mask_nonfinite_logits_give_finite_outputs_and_grad(where, value):
    d = _tr_inputs()
    pos = (0, 0) if where == "valid" else (1, 2)
    d["logits"][pos + (1,)] = value
    mask, logprobs, stats, grad = _mask_loss_grad(d, tr.TrustRegionConfig(delta=1e-4))
    assert np.isfinite(logprobs).all() and np.isfinite(grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    assert not mask[pos] and not mask[1, 2]
    assert stats["num_nonfinite"] == (1.0 if where == "valid" else 0.0)


def test_mask_bad_ids_and_nonfinite_behavior_are_counted_and_masked():
    d = _tr_inputs()
    d["topk_ids"][0, 0, 0] = V + 3  # out of range
    d["topk_ids"][0, 1, 1] = -1  # negative
    d["tokens"][1, 0] = V
    d["behavior_logprobs"][1, 1] = np.nan
    d["topk_logprobs"][0, 2, 0] = np.inf
    d["logits"][1, 2] = np.nan  # pad
    d["advantages"] = np.array([1.0, np.nan], np.float32)  # NaN advantage on row 1 (valid positions)
    mask, logprobs, stats, grad = _mask_loss_grad(d, tr.TrustRegionConfig(delta=1e-4))
    assert not mask.any()
    assert stats["num_bad_ids"] == 3.0
    assert stats["num_nonfinite"] == 2.0  # (0,2) +inf top-K log mu; (1,1) NaN log mu/advantage
    assert np.isfinite(grad).all() and np.isfinite(logprobs).all()


def test_mask_minus_inf_behavior_is_zero_probability_not_nan():
    d = _tr_inputs()
    d["behavior_logprobs"][0, 0] = -np.inf
    d["topk_logprobs"][0, 1, 2] = -np.inf
    for cfg in (tr.TrustRegionConfig(delta=1e-4),
                tr.TrustRegionConfig(divergence="topk_reverse_kl", estimator="autodiff", delta=1e-4)):
        _, logprobs, stats, grad = _mask_loss_grad(d, cfg)
        assert stats["num_nonfinite"] == 0.0, cfg
        assert np.isfinite(grad).all() and np.isfinite(logprobs).all()


def test_mask_error_mode_raises_only_for_valid_positions():
    d = _tr_inputs()
    cfg = tr.TrustRegionConfig(nonfinite="error")

    def call():
        return tr.trust_region_mask(d["logits"], d["tokens"], d["topk_ids"], d["topk_logprobs"],
                                    d["behavior_logprobs"], d["advantages"], d["valid_mask"], cfg)

    d["logits"][1, 2, 0] = np.nan  # pad: fine
    mask, stats = call()
    assert float(stats["num_nonfinite"]) == 0.0 and not mask[1, 2]
    d["logits"][0, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"position \(0, 1\)"):
        call()


def test_mask_advantage_shapes():
    d = _tr_inputs()
    args = (d["logits"], d["tokens"], d["topk_ids"], d["topk_logprobs"], d["behavior_logprobs"])
    cfg = tr.TrustRegionConfig(delta=1e-4)
    m_b, _ = tr.trust_region_mask(*args, np.array([1.0, -1.0]), d["valid_mask"], cfg)
    m_bt, _ = tr.trust_region_mask(*args, np.repeat([[1.0], [-1.0]], T, 1), d["valid_mask"], cfg)
    np.testing.assert_array_equal(m_b, m_bt)
    m0, st0 = tr.trust_region_mask(*args, np.zeros(B), d["valid_mask"], cfg)  # A = 0: nothing pushes out
    np.testing.assert_array_equal(np.asarray(m0), d["valid_mask"])
    for bad in (np.ones(T + 1), np.ones((B, 1)), np.float32(1.0)):
        with pytest.raises(ValueError, match="advantages"):
            tr.trust_region_mask(*args, bad, d["valid_mask"], cfg)


@pytest.mark.parametrize("case", ["duplicate_ids", "k_equals_v", "sampled_in_topk", "minus_inf_topk",
                                  "topk_mass_above_one"])
def test_bucket_exact_matches_jvp_on_edge_inputs(case):
    d = _tr_inputs(seed=3, k=V if case == "k_equals_v" else K)
    if case == "duplicate_ids":
        d["topk_ids"][..., 1] = d["topk_ids"][..., 0]
    elif case == "sampled_in_topk":
        d["tokens"][:] = d["topk_ids"][..., 2]
        d["behavior_logprobs"][:] = d["topk_logprobs"][..., 2]
    elif case == "minus_inf_topk":
        d["topk_logprobs"][..., 2] = -np.inf
    elif case == "topk_mass_above_one":
        d["topk_logprobs"][..., 0] = 0.0
    args = (d["logits"], d["tokens"], d["topk_ids"], d["topk_logprobs"], d["behavior_logprobs"])
    exact = tr.kl_directional_derivative(*args, estimator="bucket_exact")
    jvp = tr.autodiff_directional_derivative(tr.topk_kl, *args)
    np.testing.assert_allclose(exact, jvp, atol=1e-6)
    agg = tr.kl_directional_derivative(*args, estimator="aggregated_tail")
    uni = tr.kl_directional_derivative(*args, estimator="uniform_tail")
    assert np.all((np.minimum(agg, uni) - 1e-6 <= exact) & (exact <= np.maximum(agg, uni) + 1e-6))


def test_bf16_inputs_give_f32_outputs_close_to_f32():
    d = _tr_inputs()
    args32 = (d["logits"], d["tokens"], d["topk_ids"], d["topk_logprobs"], d["behavior_logprobs"])
    args16 = (jnp.asarray(d["logits"], jnp.bfloat16), d["tokens"], d["topk_ids"],
              jnp.asarray(d["topk_logprobs"], jnp.bfloat16), jnp.asarray(d["behavior_logprobs"], jnp.bfloat16))
    kl16 = tr.topk_kl(*args16)
    assert kl16.dtype == jnp.float32
    np.testing.assert_allclose(kl16, tr.topk_kl(*args32), atol=0.05)


def test_trust_region_config_rejects_bad_fields():
    for kw, field in ((dict(delta=0.0), "delta"), (dict(delta=-1.0), "delta"), (dict(delta=math.nan), "delta"),
                      (dict(delta=True), "delta"), (dict(delta_low=0.0), "delta_low"),
                      (dict(delta_high=math.inf), "delta_high"), (dict(mask="PDM"), "mask"),
                      (dict(clip_eps_low=1.0), "clip_eps_low"), (dict(direction_stats=1), "direction_stats"),
                      (dict(divergence="topk_tv"), "estimator")):
        with pytest.raises(ValueError, match=field):
            tr.TrustRegionConfig(**kw)


def test_validate_topk_names_position():
    with pytest.raises(ValueError, match=r"position \(1,\).*id 4 more than once"):
        tr.validate_topk(np.array([[0, 1], [4, 4]]))
    with pytest.raises(ValueError, match=r"position \(0,\).*outside \[0, 5\)"):
        tr.validate_topk(np.array([[1, 9], [0, 1]]), vocab_size=5)
    tr.validate_topk(np.array([[1, 9], [4, 4]]), vocab_size=5, valid_mask=np.array([False, False]))


def test_trust_region_config_accepts_numpy_float32_delta():
    assert tr.TrustRegionConfig(delta=np.float32(0.1)).delta == pytest.approx(0.1)


def test_mask_logprobs_zero_at_nonfinite_position():
    d = _tr_inputs()
    d["logits"][0, 0, :] = 0.0
    d["logits"][0, 0, 1:] = -np.inf  # pi puts all mass on id 0
    d["tokens"][0, 0] = 3  # the sampler drew id 3: pi(y) = 0
    mask, logprobs, stats, _ = _mask_loss_grad(d, tr.TrustRegionConfig(delta=1e-4))
    assert not mask[0, 0] and stats["num_nonfinite"] == 1.0
    assert np.isfinite(logprobs).all()


# =========================================================================== objectives


def test_group_advantages_degenerate_groups():
    # The host check group_advantages makes on concrete rewards, then the advantages as one compiled program per
    # shape (group_advantages under jit skips that check), instead of ~20 operations compiled one by one per shape.
    def advantages(rewards, group_size, **kw):
        objectives.validate_rewards(rewards, group_size)
        return jax.jit(lambda r: objectives.group_advantages(r, group_size, **kw))(rewards)

    np.testing.assert_array_equal(advantages(np.full(4, 0.3), 2, normalize_std=True), 0.0)
    np.testing.assert_array_equal(advantages(np.arange(3.0), 1, normalize_std=True), 0.0)
    assert advantages(np.zeros(0), 2).shape == (0,)
    with pytest.raises(ValueError, match="N=5.*group_size=2"):
        objectives.group_advantages(np.arange(5.0), 2)
    with pytest.raises(ValueError, match="group_size"):
        objectives.group_advantages(np.arange(4.0), 2.0)
    with pytest.raises(ValueError, match=r"sample index 1 \(group 0"):
        objectives.group_advantages(np.array([1.0, np.nan, 0.0, 0.0]), 2)


@jax.jit
def _all_masked_value_and_grad(lp):
    """{mode: (loss, gradient)} of an all-masked batch for every aggregation mode: one program, which the modes'
    tests share (same input), instead of each mode's gradient compiled op by op."""
    none = jnp.zeros((B, T), bool)
    out = {}
    for mode in objectives.AGGREGATION_MODES:
        def loss(logprobs):
            per_tok = objectives.tis_policy_loss(logprobs, lp + 0.1, jnp.ones(B), none, tis_cap=5.0)
            s, den = objectives.aggregate_loss(per_tok, none, mode)
            return objectives.combine([s], [den])

        out[mode] = jax.value_and_grad(loss)(lp)
    return out


@pytest.mark.parametrize("mode", objectives.AGGREGATION_MODES)
def test_all_masked_batch_gives_zero_loss_not_nan(mode):
    value, grad = _all_masked_value_and_grad(jnp.full((B, T), -1.0))[mode]
    assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)


def test_losses_zero_grad_at_masked_nan_positions():
    lp = jnp.full((B, T), -1.0).at[1, 2].set(jnp.nan)
    beh = jnp.full((B, T), -1.2).at[1, 1].set(jnp.nan)
    m = jnp.array([[1, 1, 0], [0, 0, 0]], bool)
    # Each gradient compiled as one program (as in the train step), not operation by operation.
    g = jax.jit(jax.grad(lambda x: objectives.tis_policy_loss(x, beh, jnp.array([1.0, jnp.nan]), m,
                                                              tis_cap=5.0).sum()))(lp)
    assert np.isfinite(np.asarray(g)).all() and np.all(np.asarray(g)[~np.asarray(m)] == 0)
    g = jax.jit(jax.grad(lambda x: objectives.ppo_clip_policy_loss(x, beh, jnp.ones(B), clip_eps_low=0.2,
                                                                   clip_eps_high=0.2, mask=m).sum()))(lp)
    assert np.isfinite(np.asarray(g)).all()


def test_tis_loss_with_minus_inf_behavior_is_capped():
    lp = jnp.full((1, 2), -1.0)
    beh = jnp.array([[-jnp.inf, -1.0]])
    loss = objectives.tis_policy_loss(lp, beh, jnp.ones(1), jnp.ones((1, 2), bool), tis_cap=5.0)
    np.testing.assert_allclose(loss, [[5.0, 1.0]], rtol=1e-6)


def test_group_advantages_huge_rewards_under_jit_not_flushed():
    """Inside jit (no host validation) rewards near the float32 limit are still exact: the scale is a
    power of two whose reciprocal is a normal float (1/2e38 would be flushed to zero on CPU)."""
    fn = jax.jit(lambda x: objectives.group_advantages(x, 2))
    np.testing.assert_allclose(np.asarray(fn(jnp.array([2e38, -1e38]))), [1.5e38, -1.5e38], rtol=1e-6)
    fn_n = jax.jit(lambda x: objectives.group_advantages(x, 2, normalize_std=True))
    np.testing.assert_allclose(np.asarray(fn_n(jnp.array([2e38, -1e38]))), [1.0, -1.0], rtol=1e-5)


def test_validate_rewards_names_huge_finite_float64():
    with pytest.raises(ValueError, match=r"reward 1e\+39 at sample index 0.*exceeds"):
        objectives.validate_rewards(np.array([1e39, 0.0]))


def test_group_advantages_huge_rewards_named_error_or_exact():
    """|r| above MAX_ABS_REWARD is a named error; just below it the advantages are finite and exact."""
    with pytest.raises(ValueError, match=r"reward 3.*e\+38 at sample index 0 \(group 0.*exceeds.*4 such"):
        objectives.group_advantages(np.array([3e38, 3e38, -3e38, 3e38], np.float32), 4)
    big = objectives.MAX_ABS_REWARD
    r = np.array([big, big, -big, big, 1.0, 2.0, 3.0, 6.0], np.float32)
    adv = np.asarray(objectives.group_advantages(r, 4))
    np.testing.assert_allclose(adv, [0.5 * big, 0.5 * big, -1.5 * big, 0.5 * big, -2, -1, 0, 3],
                               rtol=1e-6)
    adv_n = np.asarray(objectives.group_advantages(r, 4, normalize_std=True))
    np.testing.assert_allclose(adv_n[:4], [1 / 3 ** 0.5] * 2 + [-3 ** 0.5] + [1 / 3 ** 0.5],
                               rtol=1e-5)  # std would overflow unscaled: (1e30)^2 > 3.4e38
    np.testing.assert_allclose(adv_n[4:], np.array([-2, -1, 0, 3]) / (np.sqrt(3.5) + 1e-6),
                               rtol=1e-6)


def test_tis_loss_finite_for_zero_policy_probability():
    lp = jnp.array([[-jnp.inf, -1.0]])
    loss = objectives.tis_policy_loss(lp, jnp.full((1, 2), -1.2), jnp.ones(1), jnp.ones((1, 2), bool),
                                      tis_cap=5.0)
    assert np.isfinite(np.asarray(loss)).all()


# =========================================================================== config validation


@pytest.mark.parametrize("fields,vocab,needle", [
    ({"trust_region.delta": 0.0}, None, "delta"),
    ({"trust_region.delta": -1.0}, None, "delta"),
    ({"rl.top_k_logprobs": 100}, 15, "rl.top_k_logprobs = 100"),
    ({"rl.group_size": 1}, None, "rl.group_size = 1"),
    ({"rl.steps": -1}, None, "rl.steps = -1"),
    ({"sft.steps": -1}, None, "sft.steps = -1"),
    ({"sampler.mode": "inproc"}, None, "sampler.mode = 'inproc'"),
    ({"sampler.quantization": "int3"}, None, "sampler.quantization = 'int3'"),
    ({"model.hf_path": "/nonexistent/ckpt"}, None, "model.hf_path = '/nonexistent/ckpt'"),
    ({"data.path": "/nonexistent/data.parquet"}, None, "data.path"),
    ({"rl.learning_rate": math.nan}, None, "rl.learning_rate"),
    ({"rl.temperature": 0.0}, None, "rl.temperature"),
    ({"sampler.temperature": 0.0}, None, "sampler.temperature = 0.0: must be None (= rl.temperature) or finite"),
    ({"sampler.temperature": math.nan}, None, "sampler.temperature = nan"),
    ({"sampler.temperature": 1e-4}, None, "sampler.temperature = 0.0001: must be None (= rl.temperature) or finite "
                                          "and >= 0.001"),  # the sampler's own floor, named before any work
    ({"rl.temperature": 1e-4}, None, "rl.temperature = 0.0001: must be >= 0.001"),
    ({"rl.num_minibatches": 3}, None, "rl.num_minibatches = 3"),
    ({"rl.tis_cap": 0.0}, None, "rl.tis_cap"),
    ({"rl.dual_clip": 0.5}, None, "rl.dual_clip"),
    ({"rl.logits_chunk_size": -1}, None, "rl.logits_chunk_size"),
    ({"sampler.mode": "remote"}, None, "sampler.address"),
    ({"sampler.retries": -1}, None, "sampler.retries = -1"),
    ({"sampler.max_restarts": -2}, None, "sampler.max_restarts = -2"),
    ({"sampler.request_timeout_s": 0.0}, None, "sampler.request_timeout_s = 0.0"),
    ({"sampler.startup_timeout_s": math.inf}, None, "sampler.startup_timeout_s = inf"),
    ({"mesh.tensor": 3}, None, "mesh = (data=-1, fsdp=1, tensor=3)"),
    ({"mesh.data": 0}, None, "MeshConfig.data"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, None, "only one axis may be -1"),
    ({"model.num_key_value_heads": 3}, None, "model: Qwen3Config.num_attention_heads must be divisible"),
    ({"model.head_dim": 7}, None, "head_dim must be even"),
    ({"model.hidden_size": 0}, None, "Qwen3Config.hidden_size"),
    ({"model.rope_theta": math.inf}, None, "Qwen3Config.rope_theta"),
    ({"model.preset": "bogus"}, None, "model.preset = 'bogus'"),
    ({"model.dtype": "float33"}, None, "model.dtype = 'float33'"),
    ({"model.param_dtype": "int8"}, None, "model.param_dtype = 'int8'"),
    ({"trust_region.delta": None}, None, "trust_region.delta = None: must be a number"),
    ({"rl.tis_cap": None}, None, "rl.tis_cap = None: must be a number"),
    ({"rl.learning_rate": None}, None, "rl.learning_rate = None: must be a number"),
    ({"sampler.retries": None}, None, "sampler.retries = None: must be an integer"),
    ({"sampler.retries": True}, None, "sampler.retries = True: must be an integer"),
    ({"model.max_position_embeddings": None}, None, "model.max_position_embeddings = None"),
])
def test_validate_config_rejects_naming_field(fields, vocab, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        validate_config(_config(**fields), vocab_size=vocab)


def test_apply_arg_unknown_and_malformed_keys():
    with pytest.raises(ValueError, match="'foo'"):
        config_lib.apply_arg(config_lib.get_base_config(), "foo=1")
    with pytest.raises(ValueError, match="rl.foo.bar"):
        config_lib.apply_arg(config_lib.get_base_config(), "rl.foo.bar=1")
    with pytest.raises(ValueError, match="'delta'"):
        config_lib.apply_arg(config_lib.get_base_config(), "delta")
    c = config_lib.apply_arg(config_lib.get_base_config(), "delta=0.1,estimator=uniform_tail,steps=3")
    assert (c.trust_region.delta, c.trust_region.estimator, c.rl.steps) == (0.1, "uniform_tail", 3)


def test_apply_arg_sets_none_and_explains_commas():
    c = config_lib.apply_arg(config_lib.get_base_config(), "trust_region.delta_low=0.02")
    assert c.trust_region.delta_low == 0.02
    c = config_lib.apply_arg(c, "trust_region.delta_low=none")
    assert c.trust_region.delta_low is None
    with pytest.raises(ValueError, match="cannot set rl.steps = 'none'"):
        config_lib.apply_arg(c, "steps=none")  # an int field has no None
    with pytest.raises(ValueError, match="cannot set trust_region.delta = 'none'"):
        config_lib.apply_arg(c, "delta=none")  # a required float has no None either
    c = config_lib.apply_arg(c, "trust_region.delta_high= NULL ")
    assert c.trust_region.delta_high is None
    with pytest.raises(ValueError, match="cannot contain one"):
        config_lib.apply_arg(c, "data.path=/a,b.parquet")


def test_apply_arg_bad_number_names_field():
    with pytest.raises(ValueError, match="rl.steps"):
        config_lib.apply_arg(config_lib.get_base_config(), "steps=abc")


def test_apply_arg_rejects_bool_typo():
    with pytest.raises(ValueError, match="log.tensorboard"):
        config_lib.apply_arg(config_lib.get_base_config(), "log.tensorboard=ture")


def test_validate_config_rejects_zero_every_steps():
    for field in ("eval.every_steps", "checkpoint.every_steps"):
        with pytest.raises(ValueError, match=field):
            validate_config(_config(**{field: 0}))


def test_validate_config_rejects_infinite_learning_rate():
    tx, _ = ts.make_optimizer(math.inf)
    params = {"w": jnp.ones(3)}
    updates, _ = jax.jit(tx.update)({"w": jnp.array([0.1, 0.0, -0.2])}, tx.init(params), params)  # one program
    assert not np.isfinite(np.asarray(params["w"] + updates["w"])).all()  # the consequence
    with pytest.raises(ValueError, match="rl.learning_rate"):
        validate_config(_config(**{"rl.learning_rate": math.inf}))


def test_validate_config_rejects_adam_b2_one():
    tx, _ = ts.make_optimizer(1e-3, b2=1.0)
    params = {"w": jnp.ones(3)}
    updates, _ = jax.jit(tx.update)({"w": jnp.array([0.1, 0.0, -0.2])}, tx.init(params), params)  # one program
    assert np.isnan(np.asarray(params["w"] + updates["w"])).any()  # the consequence
    with pytest.raises(ValueError, match="rl.adam_b2"):
        validate_config(_config(**{"rl.adam_b2": 1.0}))


def test_validate_config_rejects_unknown_kl_estimator():
    with pytest.raises(ValueError, match="kl_estimator"):
        validate_config(_config(**{"rl.kl_beta": 0.1, "rl.kl_estimator": "k9"}))


def test_validate_config_rejects_infinite_tis_cap():
    with pytest.raises(ValueError, match="tis_cap"):
        validate_config(_config(**{"rl.tis_cap": math.inf}))


def test_validate_config_rejects_context_overflow():
    with pytest.raises(ValueError, match="max_new_tokens|max_position_embeddings"):
        validate_config(_config(**{"rl.max_new_tokens": 10_000}))


# =========================================================================== sampling engine


@pytest.mark.parametrize("prompts,kw,field", [
    ([], {}, "prompt"),
    ([[]], {}, "prompt"),
    ([[1, 32]], {}, "prompt"),
    ([[1, -1]], {}, "prompt"),
    ([[1] * 9], {}, "prompt"),
    ([[1.0, 2.0]], {}, "prompt"),
    ("abc", {}, "prompt"),
    ([[1]], dict(n=0), "n"),
    ([[1]], dict(n=True), "n"),
    ([[1]], dict(temperature=-1.0), "temperature"),
    ([[1]], dict(temperature=math.nan), "temperature"),
    ([[1]], dict(temperature="1.0"), "temperature"),
    ([[1]], dict(top_k_logprobs=33), "logprobs"),
    ([[1]], dict(max_new_tokens=0), "max_tokens"),
    ([[1]], dict(max_new_tokens=5), "max_tokens"),
    ([[1]], dict(stop_token_ids=list(range(9))), "stop_token_ids"),
    ([[1]], dict(stop_token_ids=[32]), "stop_token_ids"),
    ([[1]], dict(seed=2**63), "seed"),
    ([[1]], dict(seed=-1), "seed"),
    ([[1]], dict(top_p=0.0), "top_p"),
    ([[1]], dict(top_k=-1), "top_k"),
])
def test_engine_rejects_bad_requests_naming_field(engine, prompts, kw, field):
    from pdm_jax.sampler.engine import RequestError

    with pytest.raises(RequestError) as info:
        engine.generate(prompts, **kw)
    assert info.value.field == field


def test_engine_edge_requests_are_finite_and_reproducible(engine):
    kw = dict(top_k_logprobs=2, max_new_tokens=4)
    a = engine.generate([[0, 0, 0]], seed=2**63 - 1, **kw)  # prompt of only id 0, largest seed
    b = engine.generate([[0, 0, 0]], seed=2**63 - 1, **kw)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
    for rb in (a, engine.generate([[1, 2]], seed=0, stop_token_ids=[5, 5, 5], **kw),
               engine.generate([[1, 2]], seed=0, temperature=0.0, **kw)):
        valid = rb.completion_mask
        assert np.isfinite(rb.behavior_logprobs[valid]).all() and (rb.behavior_logprobs[valid] <= 0).all()
        assert np.isfinite(rb.topk_logprobs[valid]).all()
        assert ((rb.topk_ids >= 0) & (rb.topk_ids < TINY_QWEN3["vocab_size"])).all()
    stop_all = engine.generate([[1]], seed=0, stop_token_ids=list(range(8)), **kw)
    assert stop_all.completion_mask.sum() >= 1


def test_engine_tiny_temperature_gives_finite_logprobs(engine):
    from pdm_jax.sampler.engine import RequestError

    try:
        rb = engine.generate([[1, 2]], temperature=1e-30, seed=0, top_k_logprobs=2, max_new_tokens=4)
    except RequestError as e:  # rejecting the value is an acceptable fix
        assert e.field == "temperature"
        return
    greedy = engine.generate([[1, 2]], temperature=0.0, seed=0, top_k_logprobs=2, max_new_tokens=4)
    assert np.isfinite(rb.behavior_logprobs).all() and (rb.behavior_logprobs <= 0).all()
    np.testing.assert_array_equal(rb.completion_ids, greedy.completion_ids)


# =========================================================================== data


def test_make_source_bad_configs_name_field():
    from pdm_jax.data import make_source

    rg = dict(kind="reasoning_gym", task="chain_sum", num_eval=4, seed=0,
              task_config=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2))
    for cfg, needle in ((dict(kind=""), "data.kind"), (dict(kind="x"), "data.kind"),
                        (dict(rg, task="nope"), "data.task"),
                        (dict(rg, task_config=dict(foo=1)), "data.task_config"),
                        (dict(rg, task_config=dict(min_terms=5, max_terms=2)), "data.task_config"),
                        (dict(rg, task_config=dict(seed=3)), "data.task_config"),
                        (dict(rg, num_eval=0), "data.num_eval"),
                        (dict(rg, prompt_format="x"), "data.prompt_format"),
                        (dict(kind="gsm8k"), "data.path"),
                        (dict(kind="dapo_math", path="/nonexistent.parquet"), "data.path")):
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            make_source(data_spec(cfg))


def test_make_source_bad_files_name_field(tmp_path):
    from pdm_jax.data import make_source

    cases = {"empty.jsonl": "", "garbage.jsonl": "{not json\n", "wrong.jsonl": json.dumps({"q": 1}) + "\n",
             "x.csv": "a,b\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=r"data\.path"):
            make_source(data_spec(dict(kind="gsm8k", path=str(tmp_path / name), num_eval=1)))


def test_score_garbage_completions_is_zero():
    from pdm_jax.data import make_source

    src = make_source(data_spec(dict(kind="reasoning_gym", task="chain_sum", num_eval=4, seed=0,
                                     task_config=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2))))
    ex = src.train_example(0)
    for garbage in ("", "\x00\x01", "9" * 10_000, "nan", "inf", "==" * 100, "\ud800", None, 5, b"12"):
        assert src.score(garbage, ex) == 0.0, repr(garbage)[:30]
    assert src.score(src.sft_target(ex), ex) == 1.0
    with pytest.raises(ValueError, match="1 completions for 2 examples"):
        src.score_batch(["1"], [ex, ex])


# =========================================================================== HF checkpoints


def test_from_pretrained_reports_missing_files_and_bad_fields(hf_dir, tmp_path):
    from pdm_jax.models.hf_io import from_pretrained

    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(str(tmp_path / "nonexistent"))
    no_weights = _hf_variant(hf_dir, tmp_path, lambda p: os.remove(os.path.join(p, "model.safetensors")))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(no_weights)
    shutil.rmtree(no_weights)
    bad_vocab = _hf_variant(hf_dir, tmp_path, lambda p: _edit_hf_config(p, vocab_size=64))
    with pytest.raises(ValueError, match="embed_tokens.*shape"):
        from_pretrained(bad_vocab)
    shutil.rmtree(bad_vocab)
    no_field = _hf_variant(hf_dir, tmp_path, lambda p: _edit_hf_config(p, hidden_size=...))
    with pytest.raises(ValueError, match="hidden_size"):
        from_pretrained(no_field)


def test_from_pretrained_corrupt_config_names_file(hf_dir, tmp_path):
    from pdm_jax.models.hf_io import from_pretrained

    path = _hf_variant(hf_dir, tmp_path, lambda p: open(os.path.join(p, "config.json"), "w").write("{bad"))
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(path)


def test_from_pretrained_truncated_safetensors_names_file(hf_dir, tmp_path):
    from pdm_jax.models.hf_io import from_pretrained

    def truncate(p):
        f = os.path.join(p, "model.safetensors")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2])

    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(_hf_variant(hf_dir, tmp_path, truncate))


def test_from_hf_dict_zero_heads_names_field():
    from pdm_jax.models import Qwen3Config

    d = Qwen3Config(**TINY_QWEN3).to_hf_dict()
    d["num_attention_heads"] = 0
    del d["head_dim"]
    with pytest.raises(ValueError, match="num_attention_heads"):
        Qwen3Config.from_hf_dict(d)


def test_from_hf_dict_string_bool_not_silently_true():
    from pdm_jax.models import Qwen3Config

    d = Qwen3Config(**TINY_QWEN3).to_hf_dict()
    d["tie_word_embeddings"] = "false"
    try:
        cfg = Qwen3Config.from_hf_dict(d)
    except ValueError as e:
        assert "tie_word_embeddings" in str(e)
        return
    assert cfg.tie_word_embeddings is False
