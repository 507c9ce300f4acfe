"""`RunSpec`: a validated run config read once into typed, frozen records, one per section.

`run_spec(config)` validates the ConfigDict and reads it with no fallbacks (defaults live in the schema,
`pdm_jax.config.get_base_config`); it is the only reader of the ConfigDict besides the command line, the schema and
the reference generator (tests/test_structure.py). The components take its records (`pdm_jax.sections` and theirs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import ml_collections

from pdm_jax import distributed, host_memory
from pdm_jax.config import (StepConfigs, check_context, check_routing_replay_model, parse_stop_token_ids, redacted,
                            rollout_temperature, step_configs, validate_config)
from pdm_jax.data import DataSpec
from pdm_jax.evaluation import EvalSpec
from pdm_jax.rewards import RewardSpec
from pdm_jax.rl.dapo import DapoSpec
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.sections import (CheckpointSpec, CompileCacheSpec, DebugSpec, DryRunSpec, HostMemorySpec, LogSpec,
                              ModelSpec, MultihostSpec, ProfileSpec, RlSpec, TokenizerSpec, read)
from pdm_jax.sharding import MeshConfig
from pdm_jax.wandb_log import WandbSpec

__all__ = ["CheckpointSpec", "CompileCacheSpec", "ConfigRecord", "DebugSpec", "DryRunSpec", "HostMemorySpec",
           "LogSpec", "ModelSpec", "MultihostSpec", "ProfileSpec", "RlSpec", "RolloutSpec", "RunSpec", "SftSpec",
           "TokenizerSpec", "as_run_spec", "dapo_spec", "initialize_distributed", "multihost_spec", "run_spec"]

class RolloutSpec(NamedTuple):
    """The ``sampler.*`` fields the trainer's side of rollouts reads beyond `SamplerSpec`, resolved.

    Attributes:
      temperature: tau_s, the rollouts' sampling temperature (``sampler.temperature``, None = ``rl.temperature``).
      stop_token_ids: ``sampler.stop_token_ids`` parsed (() = the checkpoint's own, or the eos id alone).
      per_host_rollouts: ``sampler.per_host_rollouts`` (multi-process runs: each process samples its prompts).
    """

    temperature: float
    stop_token_ids: tuple
    per_host_rollouts: bool


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
    def from_config(cls, sft) -> "SftSpec":
        """The spec of a validated config's ``sft`` section."""
        return cls(steps=int(sft.steps), batch_size=int(sft.batch_size),
                   target_token_accuracy=float(sft.target_token_accuracy), target_window=int(sft.target_window))

    def target_reached(self, token_accuracies: Sequence[float]) -> bool:
        """True when the target is on and the mean of the last ``target_window`` of ``token_accuracies`` (one per
        step so far, fractions) reaches it; False before ``target_window`` steps."""
        window = token_accuracies[-self.target_window:]
        return (self.target_token_accuracy > 0 and len(window) == self.target_window
                and sum(window) / len(window) >= self.target_token_accuracy)


class ConfigRecord(NamedTuple):
    """The run config as written down (secrets redacted, `pdm_jax.config.redacted`): ``json``, the text of the
    workdir's ``config.json`` (a ConfigDict dump, the format a resume compares), and ``tree``, the same as plain
    nested dicts (W&B's run config, summary.json's ``trust_region``). A record of the run, never read for behaviour."""

    json: str
    tree: Mapping[str, Any]


class RunSpec(NamedTuple):
    """The typed records of a validated run config (built once by :func:`run_spec`), one per schema section."""

    seed: int
    distributed: bool
    model: ModelSpec
    tokenizer: TokenizerSpec
    data: DataSpec
    reward: RewardSpec
    sft: SftSpec
    rl: RlSpec
    step: StepConfigs
    dapo: DapoSpec
    sampler: SamplerSpec
    rollout: RolloutSpec
    eval: EvalSpec
    mesh: MeshConfig
    multihost: MultihostSpec
    dry_run: DryRunSpec
    profile: ProfileSpec
    compile_cache: CompileCacheSpec
    host_memory: HostMemorySpec
    checkpoint: CheckpointSpec
    log: LogSpec
    wandb: WandbSpec
    debug: DebugSpec
    record: ConfigRecord

    @property
    def trust_region(self):
        """The trust region's typed config (``StepConfigs.trust_region``: ``trust_region.*``)."""
        return self.step.trust_region

    @property
    def packed_length(self) -> int:
        """L, tokens per packed row (``rl.packed_length``, or 0: ``sampler.max_prompt_length + rl.max_new_tokens``)."""
        return self.rl.packed_length or self.sampler.max_prompt_length + self.rl.max_new_tokens

    def check_model(self, model_config) -> None:
        """The checks of the resolved ``Qwen3Config`` (a preset's or a checkpoint's): routing replay needs a MoE
        model, and ``sampler.max_prompt_length + rl.max_new_tokens`` fits its context.

        Raises:
          ValueError: naming ``model.moe_routing_replay`` or ``rl.max_new_tokens``.
        """
        check_routing_replay_model(self, model_config)
        check_context(self, model_config)

    def check_against_data(self, *, vocab_size: int, num_held_out: int) -> None:
        """The checks that need the tokenizer and the prompt source, run once they exist: the explicit model shape
        with ``vocab_size`` tokens, K = ``rl.top_k_logprobs`` and ``sampler.stop_token_ids`` within the vocabulary,
        ``eval.num_prompts`` <= the source's ``num_held_out`` prompts.

        Raises:
          ValueError: ``"<dotted.field> = <value>: <what is wrong>"`` (several: ``"N config errors: ..."``).
        """
        errors = []
        if not self.model.hf_path and not self.model.preset:
            try:
                self.model.qwen3_config(vocab_size)
            except ValueError as e:  # names Qwen3Config.<field>: the same names under model.
                errors.append(f"model: {e} (set as model.<field> in the run config)")
        k = self.rl.top_k_logprobs
        if k > vocab_size:
            errors.append(f"rl.top_k_logprobs = {k}: K is larger than the vocabulary size {vocab_size}")
        bad = [i for i in self.rollout.stop_token_ids if i >= vocab_size]
        if bad:
            text = ",".join(map(str, self.rollout.stop_token_ids))
            errors.append(f"sampler.stop_token_ids = {text!r}: ids {bad} are outside the vocabulary of {vocab_size} "
                          "tokens")
        if self.eval.num_prompts > num_held_out:
            errors.append(f"eval.num_prompts = {self.eval.num_prompts}: the data source has only {num_held_out} "
                          "held-out prompts (data.num_eval / data.eval_path)")
        if errors:
            raise ValueError(errors[0] if len(errors) == 1 else f"{len(errors)} config errors: " + "; ".join(errors))


def dapo_spec(rl) -> DapoSpec:
    """The `DapoSpec` of a validated config's ``rl`` section (L_max resolved: 0 -> ``rl.max_new_tokens``)."""
    return DapoSpec(dynamic_sampling=bool(rl.dynamic_sampling), max_rounds=int(rl.dynamic_sampling_max_rounds),
                    overlong_max_length=int(rl.overlong_max_length or rl.max_new_tokens),
                    overlong_buffer_len=int(rl.overlong_buffer_len),
                    overlong_penalty_factor=float(rl.overlong_penalty_factor),
                    overlong_filtering=bool(rl.overlong_filtering))


def config_record(config: ml_collections.ConfigDict) -> ConfigRecord:
    """The `ConfigRecord` of ``config`` (secrets redacted)."""
    shown = redacted(config)
    return ConfigRecord(json=shown.to_json_best_effort(indent=2), tree=shown.to_dict())


def run_spec(config: ml_collections.ConfigDict, *, dry_run: bool = False) -> RunSpec:
    """Validates ``config`` (`validate_config`, once) and reads it into a `RunSpec`.

    ``dry_run``: validated as ``--dry_run`` does (`validate_config`'s ``dry_run``: no path needs to exist, the mesh is
    resolved on ``dry_run.num_devices`` by the dry run).

    Raises:
      ValueError: a bad config, naming the field (`validate_config`).
    """
    validate_config(config, dry_run=dry_run)
    sc, log = config.sampler, read(LogSpec, config.log)
    return RunSpec(
        seed=int(config.seed), distributed=bool(config.distributed), model=read(ModelSpec, config.model),
        tokenizer=read(TokenizerSpec, config.tokenizer), data=DataSpec.from_config(config.data),
        reward=RewardSpec.from_config(config.reward), sft=SftSpec.from_config(config.sft),
        rl=read(RlSpec, config.rl), step=step_configs(config), dapo=dapo_spec(config.rl),
        sampler=SamplerSpec.from_config(sc),
        rollout=RolloutSpec(temperature=rollout_temperature(config), stop_token_ids=parse_stop_token_ids(
            sc.stop_token_ids), per_host_rollouts=bool(sc.per_host_rollouts)),
        eval=EvalSpec.from_config(config.eval), mesh=read(MeshConfig, config.mesh),
        multihost=read(MultihostSpec, config.multihost), dry_run=read(DryRunSpec, config.dry_run),
        profile=read(ProfileSpec, config.profile), compile_cache=read(CompileCacheSpec, config.compile_cache),
        host_memory=read(HostMemorySpec, config.host_memory), checkpoint=read(CheckpointSpec, config.checkpoint),
        log=log, wandb=log.wandb_spec(),
        debug=read(DebugSpec, config.debug), record=config_record(config))



def as_run_spec(spec_or_config) -> RunSpec:
    """``spec_or_config`` if it is a `RunSpec`; a run ConfigDict read by :func:`run_spec`, its
    ``host_memory.reuse_freed`` applied first (`pdm_jax.host_memory`: before validation starts JAX's backend).

    Raises:
      ValueError: a bad config, naming the field.
    """
    if isinstance(spec_or_config, RunSpec):
        return spec_or_config
    if spec_or_config.host_memory.reuse_freed:
        host_memory.reuse_freed_host_memory()
    return run_spec(spec_or_config)


def multihost_spec(config: ml_collections.ConfigDict) -> MultihostSpec:
    """The ``multihost`` section as it stands, before validation (JAX's distributed runtime starts before
    `validate_config` can count the devices); `pdm_jax.distributed.settings_from` checks its timeout."""
    return MultihostSpec(**{f.name: getattr(config.multihost, f.name) for f in dataclasses.fields(MultihostSpec)})


def initialize_distributed(config: ml_collections.ConfigDict) -> bool:
    """Starts JAX's distributed runtime when ``distributed`` is true (``multihost.*``, then the ``JAX_*`` environment,
    then JAX's cluster auto-detection: `pdm_jax.distributed.settings_from`); returns whether it did.

    Raises:
      ValueError: a bad ``multihost`` field or environment variable, named.
    """
    if not config.distributed:
        return False
    distributed.initialize(distributed.settings_from(multihost_spec(config)))
    return True


def with_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """A copy of ``config`` with ``{"section.field": value}`` set (e.g. `pdm_jax.dry_run_fit`'s proposal, which it
    prints as ``--config.`` flags); validated when read by :func:`run_spec`."""
    c = config.copy_and_resolve_references()
    for field, value in overrides.items():
        section, _, name = field.rpartition(".")
        node = c
        for part in section.split("."):
            node = node[part]
        node[name] = value
    return c
