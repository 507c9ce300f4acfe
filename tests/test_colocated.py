"""sampler.mode=colocated: the engine in the trainer's process, weights handed over in memory.

* the in-memory sampler copy (params sharded over an 8-device FSDP x tensor mesh, or replicated)
  equals, bit for bit, the copy a file-fed engine builds from the same weights, for every
  quantization, and shares no buffer with the trainer's arrays (deleting them -- what the
  next optimizer step's donation does -- leaves the sampler working, with the same rollouts);
* sync refuses NaN and stale versions (the previous version keeps serving), no file written;
* ``sampler.mode=auto`` / ``eval.engine`` resolve and validate by field;
* a colocated run == a subprocess run for the same seed: the same rollouts (tokens,
  behaviour log-probabilities, top-K) in every optimizer step and the same losses and
  evaluations (slow: the subprocess sampler starts in ~15 s).
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdm_jax.config import get_base_config, resolve_sampler_mode, validate_config
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler.engine import SamplingEngine, StaleWeightsError
from pdm_jax.rollouts.supervisor import SamplerRejected, SamplerSpec, SamplerSupervisor
from pdm_jax.sharding import make_mesh, param_shardings
from conftest import TINY_DENSE

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import DETERMINISTIC_KEYS, tiny_test_config  # noqa: E402

CFG = TINY_DENSE
LIMITS = dict(max_prompt_length=16, max_new_tokens=16)
GEN = dict(n=2, max_new_tokens=4, top_k_logprobs=5, temperature=0.7, seed=3)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


_HOST_STATE = []


def _trainer_params(mesh_shape):
    """Random model parameters (pure dict) on a (data, fsdp, tensor) mesh of the 8 test devices."""
    if not _HOST_STATE:  # random host weights, std 0.5 (an eager model init costs ~20 s on 8 fake devices)
        rng = np.random.default_rng(0)
        _HOST_STATE.append(jax.tree_util.tree_map_with_path(
            lambda path, x: np.ones(x.shape, np.float32) if jax.tree_util.keystr(path).endswith("['scale']")
            else (0.5 * rng.standard_normal(x.shape)).astype(np.float32), wts.abstract_params(CFG)))
    abstract = nnx.state(nnx.eval_shape(lambda: Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    return jax.device_put(_HOST_STATE[0], nnx.to_pure_dict(param_shardings(abstract, make_mesh(*mesh_shape))))


def _file_engine(tmp_path, state, quantization):
    path = wts.save_weights(state, str(tmp_path / f"w_{quantization}" / "v000000"), version=0)
    return SamplingEngine(CFG, wts.load_weights(path, CFG), quantization=quantization, **LIMITS)


def _leaves(tree):
    return jax.tree.leaves(tree)


@pytest.mark.parametrize("quantization, mesh_shape", [("fp8", (1, 4, 2)), ("int8", (1, 4, 2)), ("none", (1, 4, 2)),
                                                      ("bf16", (8, 1, 1)), ("fp8", (8, 1, 1))])
@pytest.mark.slow
def test_in_memory_copy_equals_the_file_copy_and_survives_donation(tmp_path, mesh_shape, quantization):
    """(1, 4, 2): FSDP x tensor sharded parameters, gathered in the program; (8, 1, 1): data-parallel
    (replicated) parameters, whose replica on the sampling device is used."""
    state = _trainer_params(mesh_shape)
    assert any(not x.sharding.is_fully_replicated for x in _leaves(state)) == (mesh_shape != (8, 1, 1))
    device = jax.local_devices()[0]
    colocated = SamplingEngine(CFG, state, quantization=quantization, device=device, **LIMITS)
    ref = _file_engine(tmp_path, state, quantization)
    got, want = colocated.params, ref.params
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(_leaves(got), _leaves(want)):
        assert a.sharding.device_set == {device} and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainer_buffers = {s.data.unsafe_buffer_pointer() for x in _leaves(state) for s in x.addressable_shards}
    assert not trainer_buffers & {x.unsafe_buffer_pointer() for x in _leaves(got)}
    before = colocated.generate(PROMPTS, **GEN)
    for x in _leaves(state):  # what donating the parameters to the next optimizer step does
        x.delete()
    after = colocated.generate(PROMPTS, **GEN)
    want_rb = ref.generate(PROMPTS, **GEN)
    for rb in (before, after):
        np.testing.assert_array_equal(rb.completion_ids, want_rb.completion_ids)
        np.testing.assert_array_equal(rb.behavior_logprobs, want_rb.behavior_logprobs)
        np.testing.assert_array_equal(rb.topk_logprobs, want_rb.topk_logprobs)


def _sampler_config(**over):
    c = get_base_config().sampler
    c.mode = "colocated"
    c.max_prompt_length = 16
    c.max_batch_size = 8
    for k, v in over.items():
        c[k] = v
    return SamplerSpec.from_config(c)


@pytest.mark.slow
def test_colocated_sync_in_memory_refuses_nan_and_stale_versions(tmp_path):
    state = _trainer_params((1, 8, 1))
    sup = SamplerSupervisor(_sampler_config(), workdir=str(tmp_path), model_config=CFG, max_new_tokens=16)
    assert sup.mode == "colocated" and not sup.writes_files and not sup.started
    with pytest.raises(ValueError, match="colocated' needs the parameters"):
        sup.start(0)
    sup.start(0, params=state)
    assert sup.started and sup.version == 0
    v0 = sup.generate(PROMPTS, **GEN)
    new = jax.tree.map(lambda x: x * 1.5, state)
    sup.sync(new, 1)
    assert sup.version == 1 and sup.last_sync_seconds["save"] == 0.0 and sup.last_sync_seconds["load"] > 0
    v1 = sup.generate(PROMPTS, **GEN)
    assert (v1.weights_version == 1).all() and not np.array_equal(v1.behavior_logprobs, v0.behavior_logprobs)
    with pytest.raises(SamplerRejected, match="stale weights version 1"):
        sup.sync(new, 1)
    bad = jax.tree.map(lambda x: x, new)
    bad["layers"]["mlp"]["up_proj"]["kernel"] = bad["layers"]["mlp"]["up_proj"]["kernel"].at[0, 0, 0].set(jnp.nan)
    with pytest.raises(SamplerRejected, match=r"weights version 2 \(in memory\).*layers/mlp/up_proj/kernel holds 1 "
                                              r"NaN/inf"):
        sup.sync(bad, 2)
    assert sup.version == 1  # the previous version keeps serving
    again = sup.generate(PROMPTS, **GEN)
    np.testing.assert_array_equal(again.behavior_logprobs, v1.behavior_logprobs)
    assert not os.path.exists(tmp_path / "weights")
    sup.stop()
    assert not sup.started


def test_stale_in_memory_version_is_refused_by_the_engine():
    from pdm_jax.rollouts.in_process import InProcessSampler
    state = _trainer_params((8, 1, 1))
    s = InProcessSampler(SamplingEngine(CFG, state, version=3, device=jax.local_devices()[0], **LIMITS))
    with pytest.raises(StaleWeightsError, match="stale weights version 2: the sampler holds version 3"):
        s.set_params(state, 2)
    assert s.set_params(state, 4)["version"] == 4 and s.version == 4


def test_auto_mode_and_eval_engine_settings():
    assert resolve_sampler_mode("auto", "cpu") == "subprocess"
    assert resolve_sampler_mode("auto", "tpu") == "colocated" and resolve_sampler_mode("auto", "gpu") == "colocated"
    assert resolve_sampler_mode("in_process", "tpu") == "in_process"
    assert get_base_config().sampler.mode == "auto" and resolve_sampler_mode("auto") == "subprocess"  # tests: CPU
    with pytest.raises(ValueError, match="sampler.mode = 'colocate'"):
        resolve_sampler_mode("colocate")
    for field, value in (("sampler.mode", "colocate"), ("eval.engine", "int8")):
        c = tiny_test_config(**{field: value})
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            validate_config(c)


@pytest.mark.slow
def test_eval_on_the_rollout_engine_equals_the_f32_engine_when_unquantized(tmp_path):
    """eval.engine: the rollout sampler (quantization none) == the in-memory f32 engine == the f32 engine
    fed through the weights file (what evaluation used before it was fed in memory): same evaluation
    records and the same samples (tokens, log mu) for the held-out prompts."""
    from pdm_jax.trainer import Trainer
    got, samples = {}, {}
    for engine in ("f32", "rollout"):
        c = tiny_test_config(**{"sampler.mode": "colocated", "sampler.quantization": "none", "eval.engine": engine})
        t = Trainer(c, str(tmp_path / engine))
        try:
            got[engine] = t.evaluate(0)
            assert t.sampler.started == (engine == "rollout")
            prompts = [t.codec.encode_prompt(e.prompt) for e in t.source.eval_examples()[:8]]
            engines = {"rollout": t.sampler} if engine == "rollout" else {"f32": t._eval_engine}
            if engine == "f32":
                t.sampler.push_weights(t.params, 0)
                engines["file"] = t.sampler.local_engine(0, "none")
            for name, e in engines.items():
                rb = e.generate(prompts, n=2, temperature=1.0, max_new_tokens=5, top_k_logprobs=2, seed=5)
                samples[name] = (rb.completion_ids, rb.behavior_logprobs)
        finally:
            t.close()
    assert got["f32"] == got["rollout"]
    for name in ("rollout", "file"):
        np.testing.assert_array_equal(samples[name][0], samples["f32"][0])
        np.testing.assert_array_equal(samples[name][1], samples["f32"][1])


class _RecordRollouts:
    """A TrainerCallback keeping every optimizer step's rollout fields (host copies)."""

    def __init__(self):
        self.batches = []

    def before_update(self, trainer, rl_step, batch, state):
        self.batches.append({k: np.asarray(getattr(batch, k)) for k in
                             ("completion_ids", "completion_mask", "behavior_logprobs", "topk_ids", "topk_logprobs")})

    def after_update(self, trainer, rl_step, batch, state, metrics):
        pass


@pytest.mark.slow
def test_colocated_run_equals_subprocess_run(tmp_path):
    from pdm_jax.trainer import Trainer
    runs = {}
    for mode in ("subprocess", "colocated"):
        c = tiny_test_config(**{"sampler.mode": mode, "rl.steps": 2, "eval.every_steps": 1})
        rec = _RecordRollouts()
        Trainer(c, str(tmp_path / mode), callbacks=[rec]).run()
        recs = [json.loads(line) for line in open(tmp_path / mode / "metrics.jsonl") if line.strip()]
        runs[mode] = (rec.batches, recs)
    (sub_batches, sub_recs), (col_batches, col_recs) = runs["subprocess"], runs["colocated"]
    assert len(sub_batches) == len(col_batches) == 2 * 2  # 2 RL steps x 2 mini-batches
    for a, b in zip(sub_batches, col_batches):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert [(r["phase"], r["step"]) for r in sub_recs] == [(r["phase"], r["step"]) for r in col_recs]
    for a, b in zip(sub_recs, col_recs):
        keys = DETERMINISTIC_KEYS if a["phase"] == "rl" else [k for k in a if k.startswith("eval_")]
        for k in keys:
            if k in a:
                assert a[k] == b[k], (a["phase"], a["step"], k)
    rl = [r for r in col_recs if r["phase"] == "rl"]
    assert all(r["time_weight_save"] == 0.0 and r["time_weight_load"] > 0 for r in rl)
    assert os.path.isdir(tmp_path / "subprocess" / "weights") and not os.path.exists(tmp_path / "colocated" / "weights")


@pytest.mark.slow
def test_colocated_run_resumes_exactly(tmp_path, monkeypatch):
    """A colocated run stopped after RL step 2 of 3 and re-run resumes from its checkpoint (the engine rebuilt
    in memory from the restored parameters at the checkpoint's version) to the uninterrupted run's step 3."""
    from pdm_jax.trainer import Trainer
    c = tiny_test_config(**{"sampler.mode": "colocated", "rl.steps": 3, "sft.steps": 4})
    Trainer(c, str(tmp_path / "whole")).run()

    def stop_after_2(self, rl_step):
        if rl_step == 2:
            raise RuntimeError("stopped")

    monkeypatch.setattr(Trainer, "_fault_injection", stop_after_2)
    with pytest.raises(RuntimeError, match="stopped"):
        Trainer(c, str(tmp_path / "resumed")).run()
    monkeypatch.undo()
    Trainer(c, str(tmp_path / "resumed")).run()

    def rl(d):
        return {r["step"]: r for r in map(json.loads, open(tmp_path / d / "metrics.jsonl")) if r["phase"] == "rl"}
    whole, resumed = rl("whole"), rl("resumed")
    assert sorted(resumed) == [1, 2, 3]
    for k in DETERMINISTIC_KEYS:
        assert resumed[3][k] == whole[3][k], k
