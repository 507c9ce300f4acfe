"""The trainer's config schema: every field the trainer reads, with defaults and units.

Configs are Python files with ``get_config(arg)`` (big_vision style); variants
come from the argument string, e.g. ``--config=configs/tiny.py:delta=0.05,estimator=uniform_tail``,
and every field can be overridden on the command line as
``--config.trust_region.delta=0.1``.
"""

from __future__ import annotations

import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
    """Returns the base ConfigDict (see field comments for units)."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    # ---- model -------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # local Hugging Face directory (config.json + safetensors); "" = random init
    c.model.preset = ""  # a pdm_jax.models.presets name (qwen3_4b ...) for random init / dry runs
    # Explicit architecture, used when hf_path and preset are empty (vocab_size comes from the tokenizer).
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.model.num_hidden_layers = 3
    c.model.num_attention_heads = 4
    c.model.num_key_value_heads = 2
    c.model.head_dim = 32
    c.model.rope_theta = 10_000.0
    c.model.rms_norm_eps = 1e-6
    c.model.tie_word_embeddings = True
    c.model.max_position_embeddings = 512
    c.model.param_dtype = "float32"
    c.model.dtype = "float32"  # compute dtype of the trainer

    # ---- tokenizer ---------------------------------------------------------------------
    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.path = ""  # local HF tokenizer directory; "" with kind=char builds one into the workdir
    c.tokenizer.kind = "char"  # "char" (built from `symbols`) | "path"
    c.tokenizer.symbols = "0123456789+-="

    # ---- prompts and verifier (pdm_jax.data.make_source) --------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.kind = "reasoning_gym"  # "reasoning_gym" | "gsm8k" | "dapo_math"
    c.data.task = "chain_sum"
    c.data.task_config = ml_collections.ConfigDict(
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2))
    c.data.prompt_format = "compact"
    c.data.path = ""
    c.data.eval_path = ""
    c.data.num_eval = 256
    c.data.seed = 1234

    # ---- supervised warm start -----------------------------------------------------------
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # 0 = no warm start
    c.sft.batch_size = 128
    c.sft.learning_rate = 1e-3
    c.sft.warmup_steps = 50

    # ---- RL ---------------------------------------------------------------------------
    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 100  # rollout batches (= policy versions pushed to the sampler)
    c.rl.prompts_per_step = 32
    c.rl.group_size = 8  # samples per prompt (GRPO group)
    c.rl.num_minibatches = 1  # optimizer steps per pass over a rollout batch
    c.rl.num_iterations = 1  # passes over each rollout batch
    c.rl.max_staleness = 0  # versions the sampler may lag behind the trainer (0 = synchronous)
    c.rl.temperature = 1.0
    c.rl.max_new_tokens = 8
    c.rl.top_k_logprobs = 20  # K of the sampler's top-K view
    c.rl.learning_rate = 1e-4
    c.rl.warmup_steps = 0
    c.rl.weight_decay = 0.0
    c.rl.adam_b1 = 0.9
    c.rl.adam_b2 = 0.999
    c.rl.max_grad_norm = 1.0
    c.rl.policy_loss = "tis"  # "tis" (-A sg(min(r,C)) M log pi) | "ppo_clip"
    c.rl.tis_cap = 5.0  # C
    c.rl.dual_clip = 0.0  # PPO dual clip c (>1) for A<0; 0 = off
    c.rl.loss_aggregation = "token_mean"  # | "seq_mean_token_mean" | "seq_mean_token_sum_norm"
    c.rl.normalize_advantage_std = False  # DPPO uses none
    c.rl.kl_beta = 0.0  # KL penalty to the frozen initial policy (DAPO/DPPO: 0)
    c.rl.kl_estimator = "k3"
    c.rl.logits_chunk_size = 0  # > 0: loss over chunks of this many positions (pdm_jax.chunked_loss); 0 = all [B,T,V] logits

    # ---- trust region (pdm_jax.trust_region.TrustRegionConfig) ---------------------------
    c.trust_region = ml_collections.ConfigDict()
    c.trust_region.mask = "pdm"  # "none" | "ppo" | "dppo" | "pdm"
    c.trust_region.divergence = "topk_kl"
    c.trust_region.estimator = "bucket_exact"
    c.trust_region.delta = 0.05
    c.trust_region.delta_low = ml_collections.FieldReference(None, field_type=float)
    c.trust_region.delta_high = ml_collections.FieldReference(None, field_type=float)
    c.trust_region.clip_eps_low = 0.2
    c.trust_region.clip_eps_high = 0.2
    c.trust_region.nonfinite = "mask"

    # ---- sampler service ------------------------------------------------------------
    c.sampler = ml_collections.ConfigDict()
    c.sampler.mode = "subprocess"  # "subprocess" (started by the trainer) | "remote" (address) | "in_process"
    c.sampler.address = ""  # http://host:port for mode=remote
    c.sampler.token = ""
    c.sampler.quantization = "fp8"  # "none" | "bf16" | "fp8"
    c.sampler.startup_timeout_s = 180.0
    c.sampler.request_timeout_s = 300.0
    c.sampler.retries = 3
    c.sampler.max_restarts = 3
    c.sampler.max_prompt_length = 64  # tokens; longest accepted prompt (largest prompt bucket)
    c.sampler.max_batch_size = 64  # largest batch bucket; bigger requests run in chunks

    # ---- evaluation --------------------------------------------------------------------
    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 50
    c.eval.num_prompts = 200
    c.eval.samples_per_prompt = 4  # avg@k at the training temperature
    c.eval.greedy = True

    # ---- mesh ------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.distributed = False  # call jax.distributed.initialize() (multi-host)
    # Multi-host runtime (pdm_jax.distributed); empty/sentinel values fall back to the environment
    # (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS), then to
    # JAX's cluster auto-detection (Cloud TPU, SLURM, ...).
    c.multihost = ml_collections.ConfigDict()
    c.multihost.coordinator_address = ""  # "host:port" of process 0
    c.multihost.num_processes = 0  # 0 = from the environment / auto-detected
    c.multihost.process_id = -1  # -1 = from the environment / auto-detected
    c.multihost.local_device_ids = ""  # e.g. "0,1,2,3"; "" = all local devices
    c.multihost.cpu_collectives = "gloo"  # CPU cross-process collectives: "gloo" | "mpi" | "none"
    c.multihost.initialization_timeout_s = 300

    # ---- dry run (python -m pdm_jax.train --dry_run; pdm_jax.dry_run) ------------------
    c.dry_run = ml_collections.ConfigDict()
    c.dry_run.chip = "v5p"  # target accelerator: v4 | v5e | v5p | v6e | H100 | H200 (HBM per chip)
    c.dry_run.num_devices = 8  # chips the mesh spans (resolves the mesh's -1 axis)
    c.dry_run.mode = "auto"  # "compile" (fake CPU devices) | "analytic" | "auto" (compile if small enough)
    c.dry_run.max_compile_params = 2_000_000_000  # auto: compile only models up to this many parameters

    # ---- checkpoints and logging ------------------------------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50
    c.checkpoint.max_to_keep = 2
    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.progress = True

    # ---- fault injection for the resume / sampler-failure tests (off by default) ---------
    c.debug = ml_collections.ConfigDict()
    c.debug.kill_after_rl_step = -1  # SIGKILL the trainer itself right after this RL step's checkpoint
    c.debug.kill_sampler_after_rl_step = -1  # SIGKILL the sampler subprocess after this RL step
    return c


def parse_arg(arg: str | None) -> dict:
    """Parses a big_vision-style config argument "a=1,b=x" into a dict of strings.

    Raises ValueError naming the malformed item.
    """
    out = {}
    if not arg:
        return out
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(
                f"config argument item {item!r} is not of the form key=value (items are separated "
                f"by commas, so a value cannot contain one: set such a field with "
                f"--config.FIELD=VALUE instead)")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


# Short names usable in the config argument string, and the fields they set.
ARG_ALIASES = {
    "delta": "trust_region.delta",
    "estimator": "trust_region.estimator",
    "mask": "trust_region.mask",
    "divergence": "trust_region.divergence",
    "seed": "seed",
    "steps": "rl.steps",
    "quantization": "sampler.quantization",
    "staleness": "rl.max_staleness",
    "hf_path": "model.hf_path",
    "tokenizer_path": "tokenizer.path",
    "data_path": "data.path",
    "eval_path": "data.eval_path",
    "num_eval": "data.num_eval",
}


def _default_is_none(path: str) -> bool:
    """Whether the field at dotted ``path`` defaults to None in ``get_base_config`` (an optional field)."""
    node = get_base_config()
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return node is None


def apply_arg(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
    """Applies "key=value,..." overrides (short aliases or dotted paths) with type coercion.

    Values are coerced to the field's current type (bool: true/false, yes/no, 1/0). An
    optional field (currently None, or None by default such as ``trust_region.delta_low``)
    also takes ``none``/``null`` to set it to None; other fields refuse it. Values cannot
    contain commas (the item separator).

    Raises ValueError naming an unknown key or a value that does not parse.
    """
    for key, raw in parse_arg(arg).items():
        path = ARG_ALIASES.get(key, key)
        node = config
        parts = path.split(".")
        for p in parts[:-1]:
            if p not in node or not hasattr(node[p], "keys"):
                raise ValueError(f"config argument {key!r}: unknown field {path!r} "
                                 f"(short names: {', '.join(sorted(ARG_ALIASES))}; or a dotted field path)")
            node = node[p]
        leaf = parts[-1]
        if leaf not in node:
            raise ValueError(f"config argument {key!r}: unknown field {path!r} "
                             f"(short names: {', '.join(sorted(ARG_ALIASES))}; or a dotted field path)")
        current = node[leaf]
        try:
            if raw.strip().lower() in ("none", "null") and (current is None or _default_is_none(path)):
                value = None
            elif isinstance(current, bool):
                spelled = raw.strip().lower()
                if spelled in ("1", "true", "yes"):
                    value = True
                elif spelled in ("0", "false", "no"):
                    value = False
                else:
                    raise ValueError("expected true/false, yes/no or 1/0")
            elif isinstance(current, int):
                value = int(raw)
            elif isinstance(current, float) or current is None:
                value = float(raw)
            else:
                value = raw
        except ValueError as e:
            raise ValueError(f"config argument {key!r}: cannot set {path} = {raw!r} ({e})") from None
        node[leaf] = value
    return config


def model_config_from_fields(model_fields: ml_collections.ConfigDict, vocab_size: int):
    """The ``Qwen3Config`` of a randomly initialised model described by the run config's ``model.*``.

    Raises:
      ValueError: from ``Qwen3Config`` (naming the field) for bad sizes or head counts.
    """
    from pdm_jax.models import Qwen3Config

    mc = model_fields
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta, tie_word_embeddings=mc.tie_word_embeddings,
        max_position_embeddings=mc.max_position_embeddings)


# ---- recipes used by configs/ ------------------------------------------------------------

def dapo_config(hf_path: str, data_path: str, eval_path: str):
    """The paper-family Qwen3 DAPO-Math run config, pointing at LOCAL checkpoint and data paths.

    Values follow DESIGN.md and the DPPO paper (arXiv 2602.04879) as summarised in
    issue 5: lr 1e-6, 128 prompts x 8 samples per step, mini-batches of 32 prompts
    (4 optimizer steps per rollout batch), K = 20, top-K KL trust region with
    delta = 0.05, truncated IS with C = 5, temperature 1.0, long responses, no KL
    penalty, no std normalisation of advantages, token-mean aggregation (DAPO).
    """
    c = get_base_config()
    c.model.hf_path = hf_path
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.tokenizer.kind = "path"
    c.tokenizer.path = hf_path  # HF checkpoints ship tokenizer.json
    c.data.kind = "dapo_math"
    c.data.prompt_format = "question"
    c.data.path = data_path  # local DAPO-Math-17k parquet/jsonl (schema: prompt, reward_model.ground_truth, ...)
    c.data.eval_path = eval_path
    c.data.num_eval = 256  # at most the number of distinct eval prompts (AIME-24: 30; pass num_eval=30)
    c.sft.steps = 0
    c.rl.steps = 500
    c.rl.prompts_per_step = 128
    c.rl.group_size = 8
    c.rl.num_minibatches = 4  # 32 prompts x 8 samples per optimizer step
    c.rl.max_staleness = 1
    c.rl.temperature = 1.0
    c.rl.max_new_tokens = 8192  # 8k-token responses (the paper family uses long responses)
    c.rl.top_k_logprobs = 20
    c.rl.learning_rate = 1e-6
    c.rl.weight_decay = 0.1
    c.rl.max_grad_norm = 1.0
    c.rl.policy_loss = "tis"
    c.rl.tis_cap = 5.0
    c.rl.loss_aggregation = "token_mean"
    c.trust_region.mask = "pdm"
    c.trust_region.divergence = "topk_kl"
    c.trust_region.estimator = "bucket_exact"
    c.trust_region.delta = 0.05
    c.sampler.quantization = "fp8"
    c.sampler.max_prompt_length = 2048
    c.sampler.max_batch_size = 256
    c.eval.every_steps = 25
    c.eval.num_prompts = 256
    c.eval.samples_per_prompt = 16  # avg@16
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.checkpoint.every_steps = 10
    return c
