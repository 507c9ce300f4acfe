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

import dataclasses
from typing import NamedTuple, Sequence

import ml_collections

from pdm_jax.config import StepConfigs, step_configs, validate_config
from pdm_jax.data import DataSpec
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rewards import RewardSpec
from pdm_jax.rl.dapo import DapoSpec
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.wandb_log import WandbSpec


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """The supervised warm start (``sft.*``; its optimizer is ``StepConfigs.sft_optimizer``).

    Attributes:
      steps: the most warm-start optimizer steps (0 = no warm start).
      batch_size: sequences per warm-start step.
      target_token_accuracy: fraction in (0, 1], or 0 = off: the warm start ends early, after step n, once the mean
        token accuracy of steps n - target_window + 1 ... n (each step's own batch, before its update) reaches it.
      target_window: steps averaged for the target (unit: steps).
    """

    steps: int
    batch_size: int
    target_token_accuracy: float = 0.0
    target_window: int = 50

    @classmethod
    def from_config(cls, sft: ml_collections.ConfigDict) -> "SftSpec":
        """The spec of a validated config's ``sft`` section."""
        return cls(steps=int(sft.steps), batch_size=int(sft.batch_size),
                   target_token_accuracy=float(sft.target_token_accuracy), target_window=int(sft.target_window))

    def target_reached(self, token_accuracies: Sequence[float]) -> bool:
        """True when the target is on and the mean of the last ``target_window`` of ``token_accuracies`` (one per
        step so far, fractions) reaches it; False before ``target_window`` steps."""
        window = token_accuracies[-self.target_window:]
        return (self.target_token_accuracy > 0 and len(window) == self.target_window
                and sum(window) / len(window) >= self.target_token_accuracy)


class RunSpec(NamedTuple):
    """The typed pieces of a validated run config (built once by :func:`run_spec`)."""

    data: DataSpec
    sampler: SamplerSpec
    eval: EvalSpec
    step: StepConfigs
    dapo: DapoSpec
    reward: RewardSpec
    sft: SftSpec
    wandb: WandbSpec


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
                   dapo=dapo_spec(config.rl), reward=RewardSpec.from_config(config.reward),
                   sft=SftSpec.from_config(config.sft),
                   wandb=WandbSpec(enabled=config.log.wandb, project=config.log.wandb_project,
                                   run_name=config.log.wandb_run_name, mode=config.log.wandb_mode))

