"""`RunSpec`: a validated run config as the typed pieces its components take, read once.

`run_spec(config)` validates the ConfigDict (`pdm_jax.config.validate_config`) and reads it, field by field and
with no fallbacks (every default lives once, in the schema: `pdm_jax.config.get_base_config`,
docs/configuration.md), into the pieces the components take instead of the ConfigDict: the prompt source's
`DataSpec` (`pdm_jax.data.make_source`), the sampler's `SamplerSpec` (`pdm_jax.rollouts.SamplerSupervisor`), the
evaluation's `EvalSpec` (`pdm_jax.evaluation.evaluate`), the jitted steps' `StepConfigs` (trust region, policy
loss, optimizers), DAPO's data-side pieces' `DapoSpec` (`pdm_jax.rl.dapo`) and the reward functions' `RewardSpec`
(`pdm_jax.rewards.with_reward_functions`). The model's `Qwen3Config` needs the tokenizer's vocabulary and is built
with it (`pdm_jax.config.model_config_from_fields`, a preset or a checkpoint's config). It sits above the config and
the trainer's side of rollouts (docs/DESIGN.md §3), beside the trainer that calls it.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_collections

from pdm_jax.config import StepConfigs, step_configs, validate_config
from pdm_jax.data import DataSpec
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rewards import RewardSpec
from pdm_jax.rl.dapo import DapoSpec
from pdm_jax.rollouts.spec import SamplerSpec


class RunSpec(NamedTuple):
    """The typed pieces of a validated run config (built once by :func:`run_spec`)."""

    data: DataSpec
    sampler: SamplerSpec
    eval: EvalSpec
    step: StepConfigs
    dapo: DapoSpec
    reward: RewardSpec


def dapo_spec(rl: ml_collections.ConfigDict) -> DapoSpec:
    """The `DapoSpec` of a validated config's ``rl`` section (L_max resolved: 0 -> ``rl.max_new_tokens``)."""
    return DapoSpec(dynamic_sampling=bool(rl.dynamic_sampling), max_rounds=int(rl.dynamic_sampling_max_rounds),
                    overlong_max_length=int(rl.overlong_max_length or rl.max_new_tokens),
                    overlong_buffer_len=int(rl.overlong_buffer_len),
                    overlong_penalty_factor=float(rl.overlong_penalty_factor),
                    overlong_filtering=bool(rl.overlong_filtering))


def run_spec(config: ml_collections.ConfigDict) -> RunSpec:
    """Validates ``config`` (`validate_config`, once) and reads it into a `RunSpec`.

    Raises:
      ValueError: a bad config, naming the field (`validate_config`).
    """
    validate_config(config)
    return RunSpec(data=DataSpec.from_config(config.data), sampler=SamplerSpec.from_config(config.sampler),
                   eval=EvalSpec.from_config(config.eval), step=step_configs(config),
                   dapo=dapo_spec(config.rl), reward=RewardSpec.from_config(config.reward))
