"""The sampler serves Qwen3-MoE: quantized experts scaled per (layer, expert, output channel)
against an independent per-expert numpy reference, and the MoE engine's decode logprobs ==
a teacher-forced forward of the same (dequantized) weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import quantize as q
from pdm_jax.sampler.engine import SamplingEngine
from conftest import TINY_MOE
from quant_reference import fp8_reference, int_matches

CFG = TINY_MOE
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
GEN = dict(n=2, max_new_tokens=12, top_k_logprobs=5)


@pytest.fixture(scope="module")
def params():
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # std ~0.5: peaked distributions; each expert a different magnitude, so a scale shared over
    # experts (the bug this guards against) would differ from the per-expert one
    def scale(path, x):
        if path[-1] == "scale":
            return x
        x = x * 25.0
        if "experts" in path:  # [L, E, ...]
            x = x * jnp.asarray([0.25, 1.0, 4.0, 0.5]).reshape(1, 4, *([1] * (x.ndim - 2)))
        return x
    return q._map_with_path(scale, pure)


def test_expert_output_axes():
    assert q.default_output_axes(("layers", "mlp", "experts", "gate_proj", "kernel"), (2, 4, 32, 16)) == (0, 1, 3)
    assert q.default_output_axes(("layers", "mlp", "experts", "down_proj", "kernel"), (2, 4, 16, 32)) == (0, 1, 3)
    assert q.default_output_axes(("layers", "mlp", "gate", "kernel"), (2, 32, 4)) == (0, 2)


@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_quantized_experts_equal_per_expert_quantization(params, mode):
    """Every (layer, expert) [in, out] matrix quantized on its own with per-output-channel absmax
    scales (tests/quant_reference.py: numpy + ml_dtypes) == the stacked [L, E, in, out] copy."""
    got = q.prepare_sampler_params(params, mode, compute_dtype=jnp.float32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = np.asarray(params["layers"]["mlp"]["experts"][name]["kernel"], np.float32)
        out = np.asarray(got["layers"]["mlp"]["experts"][name]["kernel"])
        L, E = w.shape[:2]
        for layer in range(L):
            for e in range(E):
                m = w[layer, e]  # [in, out]
                if mode == "fp8":
                    qv, s = fp8_reference(m, (1,))
                    want = qv.astype(np.float32) * s
                    np.testing.assert_allclose(out[layer, e], want, rtol=1e-6, atol=0, err_msg=f"{name} {layer} {e}")
                else:
                    assert int_matches(out[layer, e], m, (1,), mode).all(), (name, layer, e)
    router = np.asarray(params["layers"]["mlp"]["gate"]["kernel"], np.float32)  # [L, D, E]
    r_out = np.asarray(got["layers"]["mlp"]["gate"]["kernel"])
    assert r_out.shape == router.shape and not np.array_equal(r_out, router)
    assert np.abs(r_out - router).max() < 0.1 * np.abs(router).max()  # int4: at most max|W| / 15


def _full_logits(params, b, cfg=CFG):
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    st = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    nnx.update(model, st)
    ids = np.concatenate([b.prompt_ids, b.completion_ids], axis=1)
    mask = np.concatenate([b.prompt_mask, b.completion_mask], axis=1)
    logits = jax.jit(lambda i, m: model(i, attention_mask=m))(jnp.asarray(ids), jnp.asarray(mask))
    p = b.prompt_ids.shape[1]
    z = np.asarray(logits[:, p - 1:-1], np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.slow
def test_moe_engine_decode_equals_forward_of_dequantized_model(params, quantization):
    eng = SamplingEngine(CFG, params, max_prompt_length=16, max_new_tokens=16,
                         quantization=quantization, compute_dtype=jnp.float32)
    b = eng.generate(PROMPTS, temperature=1.0, seed=5, **GEN)
    logp = _full_logits(eng.params, b)
    tf = np.take_along_axis(logp, b.completion_ids[..., None], -1)[..., 0]
    m = b.completion_mask
    assert m.sum() > 10
    np.testing.assert_allclose(b.behavior_logprobs[m], tf[m], atol=1e-5)
    if quantization == "fp8":  # ... and it is not the f32 policy
        pi = np.take_along_axis(_full_logits(params, b), b.completion_ids[..., None], -1)[..., 0]
        assert 1e-4 < np.abs(pi[m] - b.behavior_logprobs[m]).mean() < 1.0


@pytest.mark.slow
def test_mixed_moe_engine_fp8_decode_and_routing():
    """A mixed sparse/dense-MLP model (layer 0 dense, 1 sparse) served fp8: decode logprobs ==
    a teacher-forced forward of the dequantized weights; the returned routing is -1 at the dense
    layer and the model's own top-k (recomputed on the sampled tokens) at the sparse one."""
    cfg = Qwen3Config(**{**CFG.__dict__, "mlp_only_layers": (0,)})
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    pure = q._map_with_path(lambda path, x: x if path[-1] == "scale" else x * 25.0,
                            nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    eng = SamplingEngine(cfg, pure, max_prompt_length=16, max_new_tokens=16, quantization="fp8",
                         compute_dtype=jnp.float32)
    b = eng.generate(PROMPTS, temperature=1.0, seed=5, return_routing=True, **GEN)
    logp = _full_logits(eng.params, b, cfg)
    tf = np.take_along_axis(logp, b.completion_ids[..., None], -1)[..., 0]
    m = b.completion_mask
    np.testing.assert_allclose(b.behavior_logprobs[m], tf[m], atol=1e-5)
    r = b.routed_experts  # [N, P+T, L, k]
    assert np.all(r[:, :, 0] == -1)
    fed = np.concatenate([b.prompt_mask, np.cumsum(m, 1) < m.sum(1, keepdims=True)], axis=1)
    assert np.all(r[:, :, 1][fed] >= 0)


def test_engine_runs_its_experts_with_auto(monkeypatch):
    """The engine's model (and the dry run's copy of it) resolves its MoE kernel by the target platform."""
    from pdm_jax import sharding as shd
    from pdm_jax.models import moe
    from pdm_jax.sampler import engine as eng

    model = eng.abstract_engine_model(CFG, jnp.float32)
    assert model.moe_implementation == "auto"
    monkeypatch.setattr(shd, "target_platform", lambda: "gpu")
    assert moe.resolve_implementation(model.moe_implementation, hidden_size=CFG.hidden_size,
                                      moe_intermediate_size=CFG.moe_intermediate_size) == "blocked"
