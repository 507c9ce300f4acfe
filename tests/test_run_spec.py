"""pdm_jax.run_spec: the config validated once and read into the typed pieces the components take."""
import dataclasses
import os

import pytest

from pdm_jax.config import load_config_file, step_configs
from pdm_jax.data import DataSpec
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.run_spec import RunSpec, SftSpec, run_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny():
    return load_config_file(os.path.join(REPO, "configs", "tiny.py"))


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


def test_the_warm_start_target_is_the_mean_of_its_last_window():
    spec = SftSpec(steps=100, batch_size=8, target_token_accuracy=0.9, target_window=3)
    assert not spec.target_reached([0.95, 0.95])  # fewer steps than the window
    assert not spec.target_reached([0.95, 0.95, 0.79])  # mean 0.8967
    assert spec.target_reached([0.5, 0.95, 0.95, 0.8])  # the last 3: mean 0.9 exactly
    assert not SftSpec(steps=100, batch_size=8).target_reached([1.0] * 60)  # 0 = off
    c = _tiny()
    c.sft.target_token_accuracy, c.sft.target_window = 0.9, 20
    assert run_spec(c).sft == SftSpec(steps=c.sft.steps, batch_size=c.sft.batch_size, target_token_accuracy=0.9,
                                      target_window=20)
    c.sft.target_token_accuracy = 1.5
    with pytest.raises(ValueError, match=r"sft.target_token_accuracy = 1.5: must be a fraction in \[0, 1\]"):
        run_spec(c)


def test_a_bad_config_is_named_before_any_piece_is_built():
    c = _tiny()
    c.trust_region.delta = -1.0
    with pytest.raises(ValueError, match=r"trust_region: TrustRegionConfig\.delta must be a finite float > 0"):
        run_spec(c)


def test_the_checks_that_need_the_tokenizer_and_the_source():
    c = _tiny()
    c.eval.num_prompts, c.sampler.stop_token_ids = 50, "3, 12"
    spec = run_spec(c)
    with pytest.raises(ValueError, match=r"eval\.num_prompts = 50: the data source has only 10 held-out"):
        spec.check_against_data(vocab_size=10_000, num_held_out=10)
    with pytest.raises(ValueError, match=r"^3 config errors: rl\.top_k_logprobs = 4: K is larger than the vocabulary "
                                         r"size 3; sampler\.stop_token_ids = '3,12': ids \[3, 12\] are outside the "
                                         r"vocabulary of 3 tokens; eval\.num_prompts = 50"):
        spec.check_against_data(vocab_size=3, num_held_out=10)
    spec.check_against_data(vocab_size=10_000, num_held_out=50)
