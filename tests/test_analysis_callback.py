"""`pdm_jax.analysis.callback.AlignmentCallback`: the isolated step against autodiff, behaviour logits by weights
version, and no effect on training (two short in-process runs)."""

import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.analysis import alignment as al
from pdm_jax.analysis import AlignmentCallback  # the package exports it (docs/analysis.md)
from pdm_jax.analysis.callback import isolated_changes
from pdm_jax.metrics import read_metrics
from pdm_jax.models import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region as tr
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.trainer import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _tiny_model(seed=0):
    cfg = Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=32, tie_word_embeddings=True)
    # Built in one compiled program, its initialisers not compiled one by one (the weights equal the eager ones
    # to float rounding; the test's reference uses these same weights).
    return nnx.split(nnx.jit(lambda key: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(key)))(jax.random.key(seed)))


@pytest.mark.slow
def test_isolated_step_matches_autodiff_reference():
    """iso_first_order = −∇D·∇ℓ/‖∇ℓ‖ (independent grads), and the finite step ≈ ε × first order."""
    graphdef, params = _tiny_model()
    rng = np.random.default_rng(1)
    n, p, t, k = 2, 3, 4, 2
    prompt_ids = rng.integers(0, 8, size=(n, p)).astype(np.int32)
    prompt_mask = np.ones((n, p), bool)
    comp = rng.integers(0, 8, size=(n, t)).astype(np.int32)
    cmask = np.ones((n, t), bool)
    zq = rng.normal(size=(n, t, 8)).astype(np.float32)
    logmu = zq - np.log(np.exp(zq).sum(-1, keepdims=True))
    topk_ids = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    topk_lp = np.take_along_axis(logmu, topk_ids, -1)
    beh = np.take_along_axis(logmu, comp[..., None], -1)[..., 0]
    adv = np.array([1.0, -0.5], np.float32)
    cols = np.array([1, 3], np.int32)
    eps = 1e-3
    d, first, gnorm = jax.device_get(isolated_changes(graphdef, params, prompt_ids, prompt_mask, comp, cmask, beh,
                                                      topk_ids, topk_lp, adv, cols, temperature=1.0, tis_cap=5.0,
                                                      step_size=eps))
    @jax.jit  # one program for both rows: the row and its column are arguments, not constants of the program
    def reference(prm, row, c, a):
        """Per parameter leaf, <grad D, grad loss> and <grad loss, grad loss> at row `row`'s completion column c."""
        ids, pmask, tokens, tmask, tids, tlp, blp = (jnp.asarray(x)[row] for x in (
            prompt_ids, prompt_mask, comp, cmask, topk_ids, topk_lp, beh))

        def logits_at(prm):
            z = ts.completion_logits(graphdef, prm, ids[None], pmask[None], tokens[None], tmask[None])
            return z[0, c]

        def dfn(prm):
            return tr.topk_kl(logits_at(prm), tokens[c], tids[c], tlp[c], blp[c])

        def loss(prm):
            lp = jax.nn.log_softmax(logits_at(prm))[tokens[c]]
            return -a * jax.lax.stop_gradient(jnp.minimum(jnp.exp(lp - blp[c]), 5.0)) * lp

        gd, gl = jax.tree.leaves(jax.grad(dfn)(prm)), jax.tree.leaves(jax.grad(loss)(prm))
        return [jnp.vdot(x, y) for x, y in zip(gd, gl)], [jnp.vdot(y, y) for y in gl]

    for i in range(n):
        dots, squares = reference(params, jnp.int32(i), jnp.int32(cols[i]), jnp.float32(adv[i]))
        dot = sum(float(x) for x in dots)
        norm = math.sqrt(sum(float(x) for x in squares))
        assert gnorm[i] == pytest.approx(norm, rel=1e-4)
        assert first[i] == pytest.approx(-dot / norm, rel=1e-3, abs=1e-7)
        assert d[i] == pytest.approx(eps * first[i], rel=0.05, abs=1e-7)


@pytest.mark.slow
def test_analysis_changes_nothing_in_training(tmp_path):
    """Two short in-process runs, with and without the callback: identical training metrics and weights."""
    from test_trainer import tiny_test_config  # a sibling test module (tests/ is put on sys.path above)

    overrides = {"sampler.mode": "in_process", "rl.steps": 2, "sft.steps": 4, "rl.num_iterations": 2,
                 "rl.max_staleness": 1, "trust_region.delta": 1e-4, "eval.num_prompts": 4,
                 "eval.samples_per_prompt": 1, "eval.greedy": False}
    cb = AlignmentCallback(full_mu=True, isolated_tokens=2)
    runs = {}
    for name, callbacks in (("plain", []), ("analysed", [cb])):
        wd = str(tmp_path / name)
        summary = Trainer(tiny_test_config(**overrides), wd, callbacks=callbacks).run()
        recs = [r for r in read_metrics(os.path.join(wd, "metrics.jsonl")) if r["phase"] in ("rl", "eval")]
        timing = {"step_seconds", "generate_seconds", "train_seconds", "sampler_tokens_per_second"}
        runs[name] = ([{k: v for k, v in r.items()  # times and compile counts (jit caches are warm) differ
                        if k not in timing and not k.startswith("time_") and "compile" not in k}
                       for r in recs], summary)
    assert runs["plain"][0] == runs["analysed"][0]
    assert runs["plain"][1]["final_accuracy"] == runs["analysed"][1]["final_accuracy"]
    # The callback saw every optimizer step (2 RL steps x 2 mini-batches x 2 iterations) and its "before"
    # logits are the trainer's: same mean top-K KL and outside fraction as the step's own metrics.
    assert len(cb.steps) == 8
    for st in cb.steps:
        assert st["mean_d_before"] == pytest.approx(st["trainer_mean_topk_kl"], rel=1e-4, abs=1e-7)
        assert st["num_outside"] / st["num_valid"] == pytest.approx(st["trainer_frac_outside"], abs=1e-6)
        assert st["behavior_logprob_max_err"] < 1e-3
        assert st["behavior_version_fallbacks"] == 0  # every row's version was kept (staleness <= 1)
    # The batch's weights_version names the sampler's version: with max_staleness 1 the batch of RL
    # step 2 may have been sampled by version 0 (lag 1) or 1 (lag 0), never anything else.
    assert [st["behavior_version_lag"] for st in cb.steps[:4]] == [0] * 4
    assert all(st["behavior_version_lag"] in (0, 1) for st in cb.steps[4:])
    rec = cb.token_records()
    assert len(rec["delta_d"]) > 0 and np.isfinite(rec["delta_d"]).all()
    assert np.isfinite(rec["iso_delta_d"]).any()
    assert cb.fidelity is not None and cb.fidelity["n"].sum() > 0
    # Ḋᵖ along each real update: its jvp saw the trainer's logits (same D), and it is recorded per token.
    assert all(st["param_jvp_d_max_err"] < 1e-5 for st in cb.steps)
    assert np.isfinite(rec["dir_param_jvp"]).all()
    np.testing.assert_array_equal(rec["keep_param_jvp"], rec["dir_param_jvp"] <= 0)
    # First order along a small real step predicts the realized sign well (measured 95.9% on this setting,
    # against 77.6-87.8% for the ratio test and the logit-space estimators); a flipped Δθ would give ~4%.
    rates = al.alignment_rates(al.alignment_counts(rec))
    assert rates["param_jvp"]["sign_agreement"] > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("lever", [{"sampler.temperature": 1.7}, {"sampler.weight_noise": 0.3}])
def test_behavior_logits_at_the_sampler_temperature(tmp_path, lever):
    """With sampler.temperature != rl.temperature the callback rebuilds mu at the rollouts' temperature, and with
    sampler.weight_noise from the same noised copy: its log mu of the sampled tokens matches the sampler's (an f32
    sampler), and pi (rl.temperature) is what the trainer saw."""
    from test_trainer import tiny_test_config  # a sibling test module (tests/ is put on sys.path above)

    overrides = {"sampler.mode": "in_process", "sampler.quantization": "none", "rl.steps": 1, "sft.steps": 4,
                 "rl.temperature": 1.0, "eval.num_prompts": 4, "eval.samples_per_prompt": 1, "eval.greedy": False,
                 **lever}
    cb = AlignmentCallback(full_mu=True, isolated_tokens=0)
    Trainer(tiny_test_config(**overrides), str(tmp_path), callbacks=[cb]).run()
    assert len(cb.steps) == 2  # 2 mini-batches of the one RL step
    for st in cb.steps:
        # 0.21 nats with mu at rl.temperature
        assert st["behavior_logprob_max_err"] < 1e-3, st["behavior_logprob_max_err"]
        assert st["mean_d_before"] == pytest.approx(st["trainer_mean_topk_kl"], rel=1e-4, abs=1e-7)


def test_behavior_logits_follow_weights_version_with_counted_fallback():
    """Rows use the weights version the batch names; a version that is not kept falls back to the
    best log-μ match among the kept ones and is counted."""
    cfg = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    trainer = types.SimpleNamespace(
        model_config=cfg,
        spec=types.SimpleNamespace(
            sampler=types.SimpleNamespace(quantization="none", weight_noise=0.0, weight_noise_seed=0),
            rl=types.SimpleNamespace(max_staleness=1)))
    cb = AlignmentCallback(full_mu=True)
    for version, seed in ((3, 0), (4, 1)):
        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))
        cb._snapshot_version(trainer, version, params)
    rng = np.random.default_rng(0)
    host = StepBatch(prompt_ids=rng.integers(0, 16, (4, 3)).astype(np.int32), prompt_mask=np.ones((4, 3), bool),
                     completion_ids=rng.integers(0, 16, (4, 5)).astype(np.int32),
                     completion_mask=np.ones((4, 5), bool))
    z3, lp3 = cb._version_logits(3, host, 1.0)
    z4, lp4 = cb._version_logits(4, host, 1.0)
    assert np.abs(lp3 - lp4).max() > 1e-3  # the two versions are distinguishable
    # rows 0-1 sampled by version 4, rows 2-3 by version 3
    host = host.replace(weights_version=np.array([4, 4, 3, 3], np.int32),
                        behavior_logprobs=np.concatenate([lp4[:2], lp3[2:]]))
    z, lag, err, fallbacks = cb._behavior_logits(trainer, host, 1.0, rl_step=5)
    np.testing.assert_array_equal(z[:2], z4[:2])
    np.testing.assert_array_equal(z[2:], z3[2:])
    assert (lag, fallbacks) == (1, 0) and err < 1e-6
    # rows 2-3 claim version 1 (not kept): matched to version 3 by log μ, counted
    host = host.replace(weights_version=np.array([4, 4, 1, 1], np.int32))
    z, lag, err, fallbacks = cb._behavior_logits(trainer, host, 1.0, rl_step=5)
    np.testing.assert_array_equal(z[2:], z3[2:])
    assert (lag, fallbacks) == (1, 2) and err < 1e-6
