"""Weight-sync format (safetensors + meta JSON; older orbax directories still read) and the engine's version rules."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import weights as wts
from pdm_jax.rollouts.in_process import InProcessSampler
from pdm_jax.sampler.engine import SamplingEngine, StaleWeightsError

CFG = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_save_load_roundtrip_exact(tmp_path):
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1))
    path = wts.save_weights(model, str(tmp_path / "weights" / "7"), version=7)
    meta = json.load(open(os.path.join(path, wts.META_FILE)))
    assert meta["version"] == 7 and meta["format"] == wts.FORMAT
    assert meta["num_params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    restored = wts.load_weights(path, CFG, version=7)
    ref = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(restored) == jax.tree.structure(ref)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, ref)


def test_missing_incomplete_and_wrong_version(tmp_path):
    with pytest.raises(wts.WeightsError, match="does not exist"):
        wts.load_weights(str(tmp_path / "nope"), CFG)
    os.makedirs(tmp_path / "half")
    with pytest.raises(wts.WeightsError, match="incomplete"):
        wts.load_weights(str(tmp_path / "half"), CFG)
    path = wts.save_weights(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)), str(tmp_path / "w1"), version=1)
    with pytest.raises(wts.WeightsError, match="holds version 1"):
        wts.load_weights(path, CFG, version=2)
    other = Qwen3Config(**{**CFG.__dict__, "intermediate_size": 48})
    with pytest.raises(wts.WeightsError, match="does not match"):
        wts.load_weights(path, other)
    with pytest.raises(ValueError, match="version"):
        wts.save_weights({"a": np.zeros(2)}, str(tmp_path / "neg"), version=-1)
    with pytest.raises(ValueError, match="not an integer"):
        wts.save_weights({"a": np.zeros(2)}, str(tmp_path / "latest"))
    # the trainer's call: save_weights(model, f"{root}/weights/{version}") infers the version
    inferred = wts.save_weights({"a": np.arange(3.0)}, str(tmp_path / "weights" / "12"))
    assert wts.read_meta(inferred)["version"] == 12


def test_engine_version_rules(tmp_path):
    m0, m1 = (Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(s)) for s in (0, 1))
    p0 = wts.save_weights(m0, str(tmp_path / "weights" / "0"), version=0)
    p1 = wts.save_weights(m1, str(tmp_path / "weights" / "1"), version=1)
    eng = SamplingEngine(CFG, wts.load_weights(p0, CFG), version=0, weights_path=p0,
                         max_prompt_length=16, max_new_tokens=16)
    s = InProcessSampler(eng, checkpoint_root=str(tmp_path))
    info = s.load_weights("weights/1", 1)  # relative to the root
    assert info["version"] == 1 and not info["reloaded"] and eng.version == 1
    ref = nnx.to_pure_dict(nnx.state(m1, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), eng.params, ref)
    assert s.load_weights(p1, 1)["reloaded"]  # same version, same path: idempotent
    with pytest.raises(StaleWeightsError, match="stale"):
        s.load_weights(p0, 0)
    with pytest.raises(StaleWeightsError):
        s.load_weights(p0, 1)  # same version, other path
    with pytest.raises(wts.WeightsError, match="does not exist"):
        s.load_weights("weights/2", 2)
    with pytest.raises(wts.WeightsError, match="holds version 0"):
        s.load_weights(p0, 5)
    with pytest.raises(wts.WeightsError, match=r"'\.\.'"):
        s.load_weights("weights/../weights/1", 3)
    with pytest.raises(wts.WeightsError, match="outside"):
        s.load_weights("/tmp", 3)
    assert eng.version == 1
