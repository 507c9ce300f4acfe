"""pdm_jax.run_spec: the config validated once and read into the typed pieces the components take."""
import dataclasses
import os

import pytest

from pdm_jax.analysis.run import load_config
from pdm_jax.config import get_base_config, step_configs, validate_against_data
from pdm_jax.data import DataSpec
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.run_spec import RunSpec, run_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny():
    return load_config(os.path.join(REPO, "configs", "tiny.py"))


def test_run_spec_is_each_piece_read_from_the_validated_config():
    c = _tiny()
    got = run_spec(c)
    assert isinstance(got, RunSpec)
    assert got.data == DataSpec.from_config(c.data) and got.sampler == SamplerSpec.from_config(c.sampler)
    assert got.eval == EvalSpec.from_config(c.eval) and got.step == step_configs(c)
    assert (got.step.trust_region.delta, got.data.task, got.eval.samples_per_prompt) == (
        c.trust_region.delta, c.data.task, c.eval.samples_per_prompt)
    assert dataclasses.replace(got.data, seed=7).seed == 7  # frozen, changed by replace only
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.data.seed = 7


def test_a_bad_config_is_named_before_any_piece_is_built():
    c = _tiny()
    c.trust_region.delta = -1.0
    with pytest.raises(ValueError, match=r"trust_region: TrustRegionConfig\.delta must be a finite float > 0"):
        run_spec(c)


def test_the_checks_that_need_the_tokenizer_and_the_source():
    c = get_base_config()
    c.eval.num_prompts = 50
    with pytest.raises(ValueError, match=r"eval\.num_prompts = 50: the data source has only 10 held-out"):
        validate_against_data(c, vocab_size=10_000, num_held_out=10)
    c.eval.num_prompts = 10
    c.rl.top_k_logprobs = 20
    with pytest.raises(ValueError, match=r"rl\.top_k_logprobs = 20: K is larger than the vocabulary size 16"):
        validate_against_data(c, vocab_size=16, num_held_out=10)
    validate_against_data(c, vocab_size=10_000, num_held_out=10)
