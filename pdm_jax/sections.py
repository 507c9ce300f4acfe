"""Typed, frozen records of the run config's sections, field for field as in the schema, each checking itself.

A failed check raises ``ValueError`` ``"<section>.<field> = <value>: <what is wrong>"``, or, while
`pdm_jax.config.validate_config` runs, is collected with the others (`need`); checks that span sections stay there.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math

import jax.numpy as jnp

from pdm_jax import aot
from pdm_jax.models import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES
from pdm_jax.models.moe import IMPLEMENTATIONS as MOE_IMPLEMENTATIONS
from pdm_jax.models.presets import PRESETS
from pdm_jax.models.qwen3 import Qwen3Config
from pdm_jax.models.tokenizer import MAX_BPE_VOCAB_SIZE
from pdm_jax.profiling import parse_steps
from pdm_jax.rl.train_step import LR_SCHEDULES
from pdm_jax.wandb_log import WandbSpec

TOKENIZER_KINDS = ("char", "bpe", "path")
#: tokenizer.corpus_prompts' limit (1M examples: about 40 s and 3 GB of host memory to train on).
MAX_CORPUS_PROMPTS = 1_000_000
#: W&B's run modes that ``log.wandb_mode`` may name; characters W&B refuses in a project name.
WANDB_MODES = ("online", "offline")
_WANDB_PROJECT_BAD = set("/\\#?%:")

#: While `pdm_jax.config.validate_config` runs: the errors found so far (every check runs; one ValueError names all).
COLLECTED: contextvars.ContextVar = contextvars.ContextVar("pdm_jax_config_errors", default=None)


def need(cond, field, value, what) -> bool:
    """Refuses ``field = value`` unless ``cond``: raises, or inside `validate_config` records the error and
    returns False (so that a check depending on the value can skip itself); True when it holds."""
    if not cond:
        message = f"{field} = {value!r}: {what}"
        errors = COLLECTED.get()
        if errors is None:
            raise ValueError(message)
        errors.append(message)
        return False
    return True


_CASTS = {"int": int, "float": float, "bool": bool, "str": str}


def read(cls, section):
    """``cls`` (a record of this module, or any dataclass mirroring a section) with each field read from ``section``
    by name and cast to its annotated type (``Optional[float]`` keeps None); the record's checks run.

    Raises:
      AttributeError: naming a field the section lacks.
      ValueError: a record's check, naming the field (outside `validate_config`).
    """
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(section, f.name)
        cast = _CASTS.get(f.type)
        values[f.name] = value if cast is None or value is None else cast(value)
    return cls(**values)


def compute_options(model_fields) -> dict:
    """The training forward's options of ``model.*`` (attention kernel, its tiles, remat, layer scan, MoE experts), as
    keyword arguments of ``Qwen3ForCausalLM`` / ``set_compute_options``. ``model_fields``: the ``model`` section or
    its `ModelSpec`."""
    return dict(attention=model_fields.attention, remat=model_fields.remat,
                attention_block_q=int(model_fields.attention_block_q),
                attention_block_kv=int(model_fields.attention_block_kv),
                scan_layers=bool(model_fields.scan_layers), moe_implementation=model_fields.moe_implementation)


def model_config_from_fields(model_fields, vocab_size: int):
    """The ``Qwen3Config`` of a randomly initialised model described by the run config's ``model.*`` (the section or
    its `ModelSpec`).

    Raises:
      ValueError: from ``Qwen3Config`` (naming the field) for bad sizes or head counts.
    """
    mc = model_fields
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta, tie_word_embeddings=mc.tie_word_embeddings,
        max_position_embeddings=mc.max_position_embeddings, **_moe_fields(mc))


def _moe_fields(mc) -> dict:
    """The Qwen3-MoE fields of ``model.*`` (none when ``model.num_experts`` is 0: dense)."""
    if not mc.num_experts:
        return {}
    return dict(num_experts=mc.num_experts, num_experts_per_tok=mc.num_experts_per_tok,
                moe_intermediate_size=mc.moe_intermediate_size, norm_topk_prob=mc.norm_topk_prob)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``model.*``: the weights' source (``hf_path``, ``preset`` or the shape below), dtypes and forward options.
    Checks: floating dtypes, known kernel / remat / MoE implementation / preset, tiles >= 1 token."""

    hf_path: str
    preset: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    param_dtype: str
    dtype: str
    attention: str
    attention_block_q: int
    attention_block_kv: int
    remat: str
    scan_layers: bool
    moe_implementation: str
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_routing_replay: bool

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            try:
                ok = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
            except TypeError:
                ok = False
            need(ok, f"model.{name}", getattr(self, name), "must be a floating dtype name (float32, bfloat16, ...)")
        need(self.attention in ATTENTION_IMPLEMENTATIONS, "model.attention", self.attention,
             f"must be one of {tuple(ATTENTION_IMPLEMENTATIONS)}")
        need(self.remat in REMAT_POLICIES, "model.remat", self.remat, f"must be one of {tuple(REMAT_POLICIES)}")
        need(isinstance(self.scan_layers, bool), "model.scan_layers", self.scan_layers, "must be true or false")
        need(self.moe_implementation in MOE_IMPLEMENTATIONS, "model.moe_implementation", self.moe_implementation,
             f"must be one of {MOE_IMPLEMENTATIONS}")
        for name in ("attention_block_q", "attention_block_kv"):
            need(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1 (tokens)")
        if self.preset and not self.hf_path:
            need(self.preset in PRESETS, "model.preset", self.preset, f"must be one of {sorted(PRESETS)}")

    def compute_options(self) -> dict:
        """The training forward's options, as keyword arguments of ``Qwen3ForCausalLM`` / ``set_compute_options``."""
        return compute_options(self)

    def qwen3_config(self, vocab_size: int):
        """The ``Qwen3Config`` of the explicit shape with ``vocab_size`` tokens (a random init without a preset).

        Raises:
          ValueError: from ``Qwen3Config``, naming the field.
        """
        return model_config_from_fields(self, vocab_size)


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """``tokenizer.*`` (read by `pdm_jax.text`). Checks: a known kind; ``path`` set exactly for kind=path; for
    kind=bpe, ``vocab_size`` in [259, 2**20] tokens and ``corpus_prompts`` in [1, `MAX_CORPUS_PROMPTS`]."""

    path: str
    kind: str
    symbols: str
    vocab_size: int
    corpus_prompts: int

    def __post_init__(self):
        need(self.kind in TOKENIZER_KINDS, "tokenizer.kind", self.kind, f"must be one of {TOKENIZER_KINDS}")
        if self.kind == "path":
            need(bool(self.path), "tokenizer.path", self.path, "required when tokenizer.kind = 'path'")
        else:
            need(not self.path, "tokenizer.path", self.path, f"is ignored when tokenizer.kind = {self.kind!r} (which "
                 "builds its own); set tokenizer.kind=path to use it")
        if self.kind == "bpe":  # byte level: 2 special tokens + 256 bytes, then the merges
            limits = (("vocab_size", 259, MAX_BPE_VOCAB_SIZE), ("corpus_prompts", 1, MAX_CORPUS_PROMPTS))
            for field, low, high in limits:
                value = getattr(self, field)
                need(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                     f"tokenizer.{field}", value, f"must be an int in [{low}, {high}]")


@dataclasses.dataclass(frozen=True)
class RlSpec:
    """``rl.*``: the RL phase's sizes (prompts, group size G, mini-batches, passes, staleness in weights versions),
    lengths (tokens), the loss's settings and DAPO's (docs/configuration.md, section ``rl``). The jitted steps take
    their typed part, `pdm_jax.config.StepConfigs`; DAPO's data-side pieces `pdm_jax.rl.dapo.DapoSpec`. Checks here:
    sizes, counts, the learning rate and its schedule, Adam, clipping, micro-batches, DAPO's fields (1 <= L_cache <=
    L_max <= max_new_tokens when on); those spanning sections run in `pdm_jax.config.validate_config`."""

    steps: int
    prompts_per_step: int
    group_size: int
    num_minibatches: int
    num_iterations: int
    max_staleness: int
    temperature: float
    max_new_tokens: int
    top_k_logprobs: int
    learning_rate: float
    warmup_steps: int
    lr_schedule: str
    weight_decay: float
    adam_b1: float
    adam_b2: float
    max_grad_norm: float
    policy_loss: str
    tis_cap: float
    dual_clip: float
    loss_aggregation: str
    normalize_advantage_std: bool
    kl_beta: float
    kl_estimator: str
    logits_chunk_size: int
    micro_batch_size: int
    pack_sequences: bool
    packed_length: int
    router_aux_loss_coef: float
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    overlong_buffer_len: int
    overlong_max_length: int
    overlong_penalty_factor: float
    overlong_filtering: bool

    def __post_init__(self):
        need(self.group_size >= 2, "rl.group_size", self.group_size, "GRPO needs at least 2 samples per prompt")
        need(self.prompts_per_step >= 1, "rl.prompts_per_step", self.prompts_per_step, "must be >= 1")
        n = self.prompts_per_step * self.group_size
        need(self.num_minibatches >= 1 and n % self.num_minibatches == 0, "rl.num_minibatches",
             self.num_minibatches, f"must divide the rollout batch of prompts_per_step x group_size = {n} sequences")
        for name in ("num_iterations", "max_new_tokens", "top_k_logprobs"):
            need(getattr(self, name) >= 1, f"rl.{name}", getattr(self, name), "must be >= 1")
        for name in ("max_staleness", "steps", "weight_decay", "warmup_steps"):
            need(getattr(self, name) >= 0, f"rl.{name}", getattr(self, name), "must be >= 0")
        lr = self.learning_rate
        need(math.isfinite(lr) and lr > 0, "rl.learning_rate", lr, "must be finite and > 0")
        need(self.lr_schedule in LR_SCHEDULES, "rl.lr_schedule", self.lr_schedule, f"must be one of {LR_SCHEDULES}")
        opt_steps = self.steps * self.num_iterations * self.num_minibatches
        need(self.lr_schedule == "constant" or opt_steps > self.warmup_steps, "rl.lr_schedule", self.lr_schedule,
             f"decays after the warm-up: the RL optimizer steps (rl.steps x rl.num_iterations x rl.num_minibatches "
             f"= {opt_steps}) must exceed rl.warmup_steps = {self.warmup_steps}")
        for name in ("adam_b1", "adam_b2"):
            need(0.0 <= getattr(self, name) < 1.0, f"rl.{name}", getattr(self, name), "must be in [0, 1)")
        need(math.isfinite(self.max_grad_norm), "rl.max_grad_norm", self.max_grad_norm,
             "must be finite (<= 0: no clipping)")
        mb_rows = n // max(self.num_minibatches, 1)
        if not self.pack_sequences:  # packed: micro_batch_size counts packed rows, whatever the mini-batch
            m = self.micro_batch_size
            need(m == 0 or (m > 0 and mb_rows % m == 0), "rl.micro_batch_size", m,
                 f"must be 0 (off) or divide the optimizer mini-batch of {mb_rows} sequences")
        self._check_dapo()

    def _check_dapo(self):
        """DAPO's fields (dynamic_sampling*, overlong_*): 1 <= L_cache <= L_max <= max_new_tokens when on."""
        need(self.dynamic_sampling_max_rounds >= 1, "rl.dynamic_sampling_max_rounds",
             self.dynamic_sampling_max_rounds, "must be >= 1 (sampling rounds per RL step)")
        buffer, l_max, new = self.overlong_buffer_len, self.overlong_max_length, self.max_new_tokens
        need(buffer >= 0, "rl.overlong_buffer_len", buffer, "must be >= 0 (0 = off)")
        if need(0 <= l_max <= new, "rl.overlong_max_length", l_max,
                f"must be in [0, rl.max_new_tokens = {new}] (0 = rl.max_new_tokens)"):
            need(buffer <= (l_max or new), "rl.overlong_buffer_len", buffer,
                 f"L_cache must be <= L_max = {l_max or new} (rl.overlong_max_length, 0 = rl.max_new_tokens)")
        need(l_max == 0 or buffer > 0, "rl.overlong_max_length", l_max, "sets L_max of the overlong shaping, which "
             "is off: set rl.overlong_buffer_len (L_cache) > 0 too")
        factor = self.overlong_penalty_factor
        need(math.isfinite(factor) and factor >= 0, "rl.overlong_penalty_factor", factor, "must be finite and >= 0")


@dataclasses.dataclass(frozen=True)
class MultihostSpec:
    """``multihost.*`` as configured ("" / 0 / -1 = from the environment or auto-detected; resolved by
    `pdm_jax.distributed.settings_from`). Checks: ``initialization_timeout_s`` a finite number of seconds > 0 (read
    before validation too, so the check takes any value)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: str
    cpu_collectives: str
    initialization_timeout_s: int

    def __post_init__(self):
        t = self.initialization_timeout_s
        need(not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t) and t > 0,
             "multihost.initialization_timeout_s", t, "must be a finite number of seconds > 0")


@dataclasses.dataclass(frozen=True)
class DryRunSpec:
    """``dry_run.*`` (`pdm_jax.dry_run`). Checks: a known chip and a compiler for it, >= 1 device, a limit >= 0
    parameters, a topology of the chip's kind."""

    chip: str
    num_devices: int
    compiler: str
    topology: str
    max_compile_params: int
    compile_sampler: bool
    count_flops: bool
    fit: bool

    def __post_init__(self):
        chip_ok = need(self.chip in aot.CHIP_HBM_GIB, "dry_run.chip", self.chip,
                       f"must be one of {sorted(aot.CHIP_HBM_GIB)}")
        if need(self.compiler in aot.COMPILERS, "dry_run.compiler", self.compiler,
                f"must be one of {aot.COMPILERS}") and chip_ok:
            aot.resolve_compiler(self.compiler, self.chip)  # tpu for an H100, gpu for a v5p: named
        need(self.num_devices >= 1, "dry_run.num_devices", self.num_devices, "must be >= 1")
        need(self.max_compile_params >= 0, "dry_run.max_compile_params", self.max_compile_params, "must be >= 0")
        need(isinstance(self.fit, bool), "dry_run.fit", self.fit, "must be true or false")
        if self.topology and chip_ok:
            aot.check_topology(self.topology, self.chip)


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    """``profile.steps``: "a:b", the RL steps traced by ``jax.profiler`` ("" = none; `pdm_jax.profiling`); checked
    by `pdm_jax.profiling.parse_steps`."""

    steps: str

    def __post_init__(self):
        parse_steps(self.steps)


@dataclasses.dataclass(frozen=True)
class CompileCacheSpec:
    """``compile_cache.*``: the persistent compilation cache's directory ("default" | "workdir" | a path | "" = none)
    and the shortest compile it keeps (seconds, finite and >= 0)."""

    dir: str
    min_compile_time_s: float

    def __post_init__(self):
        t = self.min_compile_time_s
        need(math.isfinite(t) and t >= 0, "compile_cache.min_compile_time_s", t,
             "must be a finite number of seconds >= 0")


@dataclasses.dataclass(frozen=True)
class HostMemorySpec:
    """``host_memory.reuse_freed``: glibc keeps freed large blocks mapped (`pdm_jax.host_memory`)."""

    reuse_freed: bool


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """``checkpoint.*``: a checkpoint every ``every_steps`` RL steps (and at the last); ``max_to_keep`` kept (both
    >= 1)."""

    every_steps: int
    max_to_keep: int

    def __post_init__(self):
        for name in ("every_steps", "max_to_keep"):
            need(getattr(self, name) >= 1, f"checkpoint.{name}", getattr(self, name), "must be >= 1")


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """``log.*``: TensorBoard events, progress bars and Weights & Biases (``wandb*``; `wandb_spec`).

    Checks: ``wandb_mode`` one of `WANDB_MODES`; ``wandb_project`` 1-128 characters without ``/\\#?%:``;
    ``wandb_run_name`` at most 128 characters.
    """

    tensorboard: bool
    progress: bool
    wandb: bool
    wandb_project: str
    wandb_run_name: str
    wandb_mode: str

    def __post_init__(self):
        need(self.wandb_mode in WANDB_MODES, "log.wandb_mode", self.wandb_mode, f"must be one of {WANDB_MODES}")
        project = self.wandb_project
        need(0 < len(project) <= 128 and not set(project) & _WANDB_PROJECT_BAD, "log.wandb_project", project,
             "must be 1-128 characters, none of / \\ # ? % :")
        need(len(self.wandb_run_name) <= 128, "log.wandb_run_name", self.wandb_run_name,
             "must be at most 128 characters")

    def wandb_spec(self) -> WandbSpec:
        """The W&B fields as `pdm_jax.wandb_log.WandbSpec`."""
        return WandbSpec(enabled=self.wandb, project=self.wandb_project, run_name=self.wandb_run_name,
                         mode=self.wandb_mode)


@dataclasses.dataclass(frozen=True)
class DebugSpec:
    """``debug.*``: fault injection after an RL step (-1 = off) for the resume and sampler-failure tests."""

    kill_after_rl_step: int
    kill_sampler_after_rl_step: int


#: The records that mirror a schema section, by section name (`pdm_jax.config.validate_config` builds each once to
#: run its checks; tests/test_run_spec.py holds their fields to the schema's).
SECTION_RECORDS = {"model": ModelSpec, "tokenizer": TokenizerSpec, "rl": RlSpec, "multihost": MultihostSpec,
                   "dry_run": DryRunSpec, "profile": ProfileSpec, "compile_cache": CompileCacheSpec,
                   "host_memory": HostMemorySpec, "checkpoint": CheckpointSpec, "log": LogSpec, "debug": DebugSpec}
