"""`pdm_jax.rollouts.in_process.InProcessSampler`: the sampler calls answered by an engine in this process, over a
recording stand-in engine: the server's weights-path rule applied before the engine is asked, and in-memory
versions checked (an integer in [0, 2**31), newer than the engine's) before any weights are installed. (Over a
real engine: tests/test_sampler_engine.py, test_sampler_weights.py, test_colocated.py.)"""

import os

import numpy as np
import pytest

from pdm_jax.rollout import GenerateParams
from pdm_jax.rollouts.in_process import InProcessSampler
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler.engine import StaleWeightsError


class _Engine:
    def __init__(self, version):
        self.version, self.calls = version, []

    def health(self):
        return {"status": "ok", "version": self.version}

    def generate(self, prompts, params):
        self.calls.append(("generate", prompts, params))
        return "rollouts"

    def load_weights(self, path, version, root=None):
        self.calls.append(("load_weights", path, version, root))
        return {"version": version}

    def set_params(self, params, version):
        self.calls.append(("set_params", params, version))
        self.version = version


def test_calls_reach_the_engine_and_weights_paths_are_resolved_under_the_root(tmp_path):
    engine = _Engine(3)
    s = InProcessSampler(engine)
    assert s.health() == {"status": "ok", "version": 3} and s.version == 3
    assert s.generate([[1, 2]], n=2, seed=7) == "rollouts"
    assert s.load_weights("anywhere/v4", 4) == {"version": 4}  # no root: the engine's own checks only
    assert engine.calls == [("generate", [[1, 2]], GenerateParams(n=2, seed=7)),
                            ("load_weights", "anywhere/v4", 4, None)]
    root = tmp_path / "ckpt"
    root.mkdir()
    engine.calls.clear()
    s = InProcessSampler(engine, checkpoint_root=str(root))
    s.load_weights("weights/5", 5)  # relative to the root, resolved
    assert engine.calls == [("load_weights", os.path.realpath(root / "weights" / "5"), 5, str(root))]
    for bad, match in (("weights/../../etc", "'..'"), (str(tmp_path / "other"), "outside the checkpoint root"),
                       ("", "non-empty string")):
        with pytest.raises(wts.WeightsError, match=match):
            s.load_weights(bad, 6)
    assert len(engine.calls) == 1  # refused before the engine was asked


def test_in_memory_versions_are_checked_before_the_weights_are_installed():
    engine = _Engine(3)
    s = InProcessSampler(engine)
    for bad in (True, 4.0, "4", -1, wts.MAX_VERSION + 1):
        with pytest.raises(wts.WeightsError, match=r"version must be an integer in \[0, 2\*\*31\)"):
            s.set_params({"w": 0}, bad)
    with pytest.raises(StaleWeightsError, match="stale weights version 3: the sampler holds version 3"):
        s.set_params({"w": 0}, 3)
    assert engine.calls == [] and s.version == 3
    info = s.set_params({"w": 1}, np.int64(4))
    assert info["version"] == 4 and type(info["version"]) is int and info["seconds"] >= 0
    assert engine.calls == [("set_params", {"w": 1}, 4)] and s.version == 4
