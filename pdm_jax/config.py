"""The run config: schema, validation, and the one builder of the typed step configs.

- :func:`get_base_config` is the schema: every field a run reads, with its default
  and units. Configs are Python files with ``get_config(arg)`` (big_vision style);
  variants come from the argument string, e.g.
  ``--config=configs/tiny.py:delta=0.05,estimator=uniform_tail`` (:func:`apply_arg`),
  and every field can be overridden on the command line as ``--config.trust_region.delta=0.1``.
- :func:`validate_config` makes every check that can be made before work starts
  and raises ``ValueError`` naming the field by its dotted path and its value.
- :func:`step_configs` translates the run config into the typed, static configs
  the jitted steps take (trust region, policy loss, optimizers). The trainer, the
  dry run and the analysis all build them here, nowhere else.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import jax
import ml_collections
import numpy as np

from pdm_jax import data as data_sources
from pdm_jax import rewards as reward_functions
from pdm_jax.rl import trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.presets import PRESETS
from pdm_jax.models.tokenizer import char_vocab_size, checkpoint_tokenizer_file
from pdm_jax.sampler import defaults as sampler_defaults
from pdm_jax.sampler.limits import MAX_SEED, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE, check_engine_mesh, token_problem
from pdm_jax.sampler.quantize import COMPUTE_DTYPES, QUANTIZATIONS
from pdm_jax.sampler.spec import EngineSpec
from pdm_jax.sharding import MESH_AXES, MeshConfig
from pdm_jax.rl.train_step import LR_SCHEDULES, OptimizerConfig
from pdm_jax.sections import COLLECTED as _COLLECTED, SECTION_RECORDS, model_config_from_fields, need as _need, \
    read as _read_section

#: ``sampler.mode``: "auto" resolves with `resolve_sampler_mode`; pdm_jax.rollouts.supervisor runs each.
SAMPLER_MODES = ("auto", "subprocess", "remote", "in_process", "colocated")
#: Modes whose sampler reads each weights version from a file under WORKDIR/weights ("colocated": in memory).
SAMPLER_FILE_MODES = ("subprocess", "remote", "in_process")
#: ``eval.engine``: a separate unquantized f32 engine on the trainer's weights, or the rollout sampler itself.
EVAL_ENGINES = ("f32", "rollout")
SAMPLER_BACKENDS = ("native", "vllm")  # who serves rollouts: pdm_jax.sampler.server/engine, or a vLLM server
#: Subtrees whose keys are free-form (passed through to a library), not part of the schema.
OPEN_FIELDS = ("data.task_config",)


def engine_config_fields(section: ml_collections.ConfigDict) -> None:
    """Adds `EngineSpec.config_fields` to the schema's ``sampler`` ``section`` at their EngineSpec defaults (a new
    engine setting that is a run-config field is declared once, in `pdm_jax.sampler.spec`)."""
    for f in EngineSpec.config_fields():
        section[f.name] = f.default


def get_base_config() -> ml_collections.ConfigDict:
    """Returns the base ConfigDict: the schema of a run (see field comments for units).

    Long on purpose (one line per field, grouped by section): it is the one list of
    every field a run reads, and splitting it would scatter the schema.
    """
    c = ml_collections.ConfigDict()
    # Seed of the model's initialisation and of the rollouts' sampling keys.
    c.seed = 0

    # ---- model -------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # local Hugging Face directory (config.json + safetensors); "" = random init
    c.model.preset = ""  # a pdm_jax.models.presets name (qwen3_4b ...) for random init / dry runs
    # Explicit architecture, used when hf_path and preset are empty (vocab_size comes from the tokenizer).
    # Model width d (unit: features).
    c.model.hidden_size = 128
    # Width of the dense SwiGLU MLP (unit: features).
    c.model.intermediate_size = 384
    # Decoder layers (unit: layers).
    c.model.num_hidden_layers = 3
    # Query heads (unit: heads).
    c.model.num_attention_heads = 4
    # Key/value heads (GQA; divides num_attention_heads) (unit: heads).
    c.model.num_key_value_heads = 2
    # Width of one attention head (even: RoPE rotates halves) (unit: features).
    c.model.head_dim = 32
    # RoPE base frequency.
    c.model.rope_theta = 10_000.0
    # Epsilon of every RMSNorm.
    c.model.rms_norm_eps = 1e-6
    # True: the LM head reuses the embedding matrix.
    c.model.tie_word_embeddings = True
    # Longest sequence the model accepts, prompt + completion (tokens).
    c.model.max_position_embeddings = 512
    # Dtype of the trainer's parameters (the optimizer's master copy): "float32" | "bfloat16".
    c.model.param_dtype = "float32"
    c.model.dtype = "float32"  # compute dtype of the trainer
    # Training forward (pdm_jax.models.attention; the sampler's decode is unaffected): "dense" (reference,
    # [T,S] probabilities) | "blockwise" (online softmax, memory linear in T) | "cudnn" (GPU) | "splash" (TPU)
    # | "auto" (dense up to 512 tokens, then splash on TPU, cudnn on GPU, blockwise elsewhere).
    c.model.attention = "dense"
    c.model.attention_block_q = 512  # query / key tile sizes of blockwise and splash attention (tokens)
    # Key / value tile size of blockwise and splash attention (tokens).
    c.model.attention_block_kv = 512
    # Per-layer jax.checkpoint: "none" | "full" | "dots_saveable" | "dots_with_no_batch_dims_saveable".
    c.model.remat = "none"
    # Training forward over the stacked layers: True = jax.lax.scan (one compiled layer body, compile time flat
    # in depth); False = unrolled Python loop (same numbers up to XLA fusion rounding).
    c.model.scan_layers = True
    # Qwen3-MoE checkpoints (config.json model_type "qwen3_moe"): how the experts run (pdm_jax.models.moe):
    # "ragged_dot" (grouped matmuls, every backend) | "megablox" (Pallas TPU kernel; interpret mode elsewhere)
    # | "blocked" (rows in per-expert 128-row blocks, plain XLA ops; made for XLA:GPU, which expands ragged_dot E-fold)
    # | "auto" (megablox when compiled for TPU devices and D, I are multiples of 128, blocked for GPUs, else
    # ragged_dot) | "dense" (every expert on every token: the reference). Unused by dense models.
    c.model.moe_implementation = "ragged_dot"
    # A randomly initialised Qwen3-MoE (hf_path and preset unset): num_experts > 0 makes every layer's MLP
    # num_experts SwiGLU experts of width moe_intermediate_size, top num_experts_per_tok (configs/tiny_moe.py).
    c.model.num_experts = 0  # 0 = dense
    # Experts each token is routed to (top-k) (unit: experts).
    c.model.num_experts_per_tok = 2
    # Width of one expert's SwiGLU MLP (unit: features).
    c.model.moe_intermediate_size = 64
    # True: the top-k routing weights are renormalised to sum to 1.
    c.model.norm_topk_prob = True
    # Routing replay (MoE only; pdm_jax.sampler engine, not the vLLM backend): the sampler returns the experts
    # every layer ran per token, and the training forward runs those experts (weighted by its own router).
    c.model.moe_routing_replay = False

    # ---- tokenizer ---------------------------------------------------------------------
    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.path = ""  # local HF tokenizer directory (kind=path); char and bpe build one into the workdir
    # "char" (one token per character of `symbols`) | "bpe" (byte-level byte-pair encoding trained on the task's text:
    # its training prompts and reference answers, pdm_jax.text.run_tokenizer) | "path" (a Hugging Face directory).
    # A built tokenizer is kept in WORKDIR/tokenizer; a resume whose tokenizer fields or data differ is refused.
    c.tokenizer.kind = "char"
    # Characters of the char tokenizer's vocabulary (besides its special tokens).
    c.tokenizer.symbols = "0123456789+-="
    # kind=bpe: the vocabulary size to train to (unit: tokens), its 2 special tokens and 256 bytes included (fewer
    # when the corpus runs out of pairs that occur twice); at most 2**20.
    c.tokenizer.vocab_size = 1024
    # kind=bpe: how many training examples (prompt and reference answer each) make its corpus; at most 1,000,000.
    c.tokenizer.corpus_prompts = 20000

    # ---- prompts and verifier (pdm_jax.data.make_source). ----------------------------
    # data.kind=reasoning_gym draws prompts from a reasoning-gym task; gsm8k and dapo_math read a local json, jsonl or
    # parquet file (nothing is downloaded). gsm8k rows: {"question": text, "answer": a worked solution ending in a
    # line "#### <number>"} (the number is the reference answer, the solution the warm start's target). dapo_math
    # rows: {"prompt": [{"role": "user", "content": text}, ...] (or the text itself), "reward_model": {"ground_truth":
    # answer}}, optional "extra_info": {"index": id}. A prompt that repeats is kept once; completions are checked with
    # math-verify (the last \boxed{}, else an "Answer:" line, else a "#### N" line). Text prompts need a tokenizer
    # that encodes text: tokenizer.kind=path (a checkpoint's own, with its chat template) or bpe (trained on the
    # prompts; it has no chat template, so data.chat_template=off); the char tokenizer encodes tokenizer.symbols
    # only, and a prompt with another character is refused naming them. Under data.chat_template=auto gsm8k and
    # dapo_math format each prompt with the tokenizer's chat template: a tokenizer without one is refused, naming
    # data.chat_template. Their held-out split: without data.eval_path, a permutation of data.path's distinct rows drawn
    # from data.seed holds out its first data.num_eval rows, at most half of them (more is refused, naming both
    # counts; the run logs the split), and the rest is the training pool; with data.eval_path, data.num_eval rows of
    # that file are held out and every training row with the same prompt text is dropped.
    # Your own prompts: data.kind=file reads data.path (a local json / jsonl / parquet file or a datasets.save_to_disk
    # directory) with the prompt column data.prompt_field (text, or a list of chat messages {role, content}) and any
    # other columns, which reach reward.functions; data.answer_field (optional) is the built-in math verifier's
    # reference answer and the warm start's target. Rows with the same prompt are kept once; data.num_eval of them
    # are held out (or taken from data.eval_path). A missing column, an empty file or a reserved column name
    # (prompts, completions, completion_ids, truncated) stops the run naming the field; prompts longer than
    # sampler.max_prompt_length tokens are dropped at load and counted in the log (as for every kind).
    c.data = ml_collections.ConfigDict()
    c.data.kind = "reasoning_gym"  # "reasoning_gym" | "gsm8k" | "dapo_math" | "file" (your own prompts: data.path)
    # reasoning-gym task name (kind=reasoning_gym).
    c.data.task = "chain_sum"
    # reasoning-gym config keyword arguments of the task (free-form, passed through).
    c.data.task_config = ml_collections.ConfigDict(
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2))
    # "auto": the kind's own format (reasoning_gym "compact", gsm8k / dapo_math "question") | "compact" (e.g. "57+87=",
    # the answer's leading integer is scored; reasoning_gym only) | "question" (the source's question text).
    c.data.prompt_format = "auto"
    # "auto": the source's own choice (gsm8k / dapo_math and reasoning-gym "question" prompts go through the
    # tokenizer's chat template as one user turn + the generation prompt; "compact" prompts stay raw text) | "on" |
    # "off" (raw prompt text: a Base model without chat training)
    c.data.chat_template = "auto"
    c.data.enable_thinking = True  # passed to the chat template (Qwen3: False opens an empty <think></think>)
    # Local json / jsonl / parquet file of the prompts (kind=gsm8k, dapo_math or file; kind=file also takes a
    # datasets.save_to_disk directory).
    c.data.path = ""
    # kind=file: the column holding each prompt: text, or a list of chat messages {role, content} (rendered by the
    # tokenizer's chat template, so data.chat_template must not be "off"). Every other column reaches the reward
    # functions (reward.functions) as a keyword argument.
    c.data.prompt_field = "prompt"
    # kind=file: the column of the reference answer: the built-in math verifier's ground truth and the warm start's
    # target ("" = none: then reward.functions must be set and sft.steps = 0).
    c.data.answer_field = ""
    # Optional separate held-out file in the same schema ("" = held out from data.path).
    c.data.eval_path = ""
    # Held-out prompts set aside from the training stream (unit: prompts).
    c.data.num_eval = 256
    # Seed of the prompt stream and of the held-out split.
    c.data.seed = 1234

    # ---- your own reward functions (pdm_jax.rewards; TRL's reward_funcs convention). ---------
    # Each function is called once per rollout batch (and evaluation batch) as fn(prompts, completions, **columns):
    # one entry per completion, columns = the example's other fields as lists (a file's columns; answer for the
    # built-in kinds) + completion_ids + truncated. It returns one float or None per completion. The reward is the
    # weighted sum over the functions that gave a number (None adds nothing); a row to which every function gives
    # None gets its group's scored mean (advantage 0) and is counted (reward_unscored). With functions set the data
    # source's verifier does not add to the reward unless pdm_jax.rewards:verifier is one of them. A function that
    # raises, hangs past timeout_s, or returns the wrong length, a non-number or NaN stops the run (exit 2) naming
    # it and the row. Logged: reward/NAME, the mean of each function over the rows it scored.
    c.reward = ml_collections.ConfigDict()
    # Comma-separated FILE.py:NAME or importable module:NAME, each fn(prompts, completions, **columns) ->
    # list[float | None] per rollout batch; the reward is their weighted sum and replaces the data source's verifier
    # ("" = the data source's built-in verifier; pdm_jax.rewards:verifier names it among your functions).
    c.reward.functions = ""
    # Comma-separated weights, one per function ("" = 1 each).
    c.reward.weights = ""
    # Longest a function may take on one rollout batch before the run stops naming it (unit: seconds).
    c.reward.timeout_s = 300.0

    # ---- supervised warm start -----------------------------------------------------------
    c.sft = ml_collections.ConfigDict()
    # Supervised warm-start optimizer steps on the reference answers (unit: steps).
    c.sft.steps = 0  # 0 = no warm start
    # Sequences per warm-start optimizer step (unit: sequences).
    c.sft.batch_size = 128
    # Warm-start AdamW learning rate (linear warm-up, then constant).
    c.sft.learning_rate = 1e-3
    # Linear warm-up of the warm-start learning rate (unit: steps).
    c.sft.warmup_steps = 50
    # The warm-start learning rate after the warm-up: "constant" | "cosine" | "linear" (both decay to 0 at the last
    # warm-start step).
    c.sft.lr_schedule = "constant"
    # > 0: the warm start ends early, before sft.steps, once its token accuracy on its own batches, averaged over the
    # last sft.target_window steps, reaches this; a warm start that ends on a target rather than a step count lands
    # where seeds and machines agree (configs/tiny.py); 0 = off (unit: fraction of target tokens).
    c.sft.target_token_accuracy = 0.0
    # Steps averaged for sft.target_token_accuracy (unit: steps).
    c.sft.target_window = 50

    # ---- RL ---------------------------------------------------------------------------
    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 100  # rollout batches (= policy versions pushed to the sampler)
    # Prompts per rollout batch; each is sampled group_size times (unit: prompts).
    c.rl.prompts_per_step = 32
    c.rl.group_size = 8  # samples per prompt (GRPO group)
    c.rl.num_minibatches = 1  # optimizer steps per pass over a rollout batch
    c.rl.num_iterations = 1  # passes over each rollout batch
    c.rl.max_staleness = 0  # versions the sampler may lag behind the trainer (0 = synchronous)
    # The loss's pi is softmax(z / temperature); the rollouts sample at it too unless sampler.temperature is set.
    c.rl.temperature = 1.0
    # Longest completion, its stop token included (tokens).
    c.rl.max_new_tokens = 8
    # K, the size of the sampler's top-K view: for every generated token the K most likely ids under mu and their
    # log mu (unit: ids per token). The top-K TV / KL proximity and the top-K estimators read it, the other V - K ids
    # are one tail bucket; K <= the vocabulary size (configs/tiny.py sets 4 against its 15 ids, so the tail is
    # never empty).
    c.rl.top_k_logprobs = 20
    # RL AdamW learning rate (linear warm-up, then constant).
    c.rl.learning_rate = 1e-4
    # Linear warm-up of the RL learning rate (unit: optimizer steps).
    c.rl.warmup_steps = 0
    # The RL learning rate after the warm-up: "constant" | "cosine" | "linear" (both decay to 0 at the last optimizer
    # step, rl.steps x rl.num_iterations x rl.num_minibatches).
    c.rl.lr_schedule = "constant"
    # AdamW decoupled weight decay.
    c.rl.weight_decay = 0.0
    # AdamW beta1.
    c.rl.adam_b1 = 0.9
    # AdamW beta2.
    c.rl.adam_b2 = 0.999
    # Global-norm gradient clipping, also in the warm start; <= 0 = no clipping.
    c.rl.max_grad_norm = 1.0
    c.rl.policy_loss = "tis"  # "tis" (-A sg(min(r,C)) M log pi) | "ppo_clip"
    # Truncated importance sampling: the ratio pi/mu is capped at this value,
    c.rl.tis_cap = 5.0  # C
    c.rl.dual_clip = 0.0  # PPO dual clip c (>1) for A<0; 0 = off
    # How the per-token losses become the loss ("token_mean": DAPO, over all valid tokens of the mini-batch;
    # "seq_mean_token_mean": GRPO, per sequence then over sequences; "seq_mean_token_sum_norm": Dr. GRPO):
    # "token_mean"
    c.rl.loss_aggregation = "token_mean"  # | "seq_mean_token_mean" | "seq_mean_token_sum_norm"
    # True: group advantages divided by the group's reward std (GRPO); False: mean-centred only.
    c.rl.normalize_advantage_std = False  # DPPO uses none
    # Weight beta of the penalty KL(pi || pi_ref) to the frozen initial policy (DAPO/DPPO: 0), per token.
    c.rl.kl_beta = 0.0
    # Estimator of KL(pi || pi_ref) per sampled token (with kl_beta > 0): "k1" | "k2" | "k3" (Schulman's). It sets
    # the penalty's value (and kl_to_ref); the gradient is always k2's, the reverse KL's in expectation (k1's own is
    # 0, k3's the forward KL's). Each token is weighted by sg(min(pi/mu, rl.tis_cap)): tokens come from the sampler mu.
    c.rl.kl_estimator = "k3"
    # Chunked RL loss for large vocabularies (unit: tokens): > 0 = the loss over chunks of this many positions
    # (pdm_jax.rl.chunked_loss); 0 = all [B,T,V] logits.
    c.rl.logits_chunk_size = 0
    # Sequences per micro-batch (packed rows per micro-batch with rl.pack_sequences); > 0: gradients accumulated
    # exactly over micro-batches; 0 = off (unit: sequences).
    c.rl.micro_batch_size = 0
    # True: each mini-batch's sequences are packed end to end into rows of rl.packed_length tokens (segment ids,
    # per-sequence positions; pdm_jax.rl.packing): the same loss and gradient without the FLOPs of padding;
    # rl.micro_batch_size then counts packed rows per micro-batch.
    c.rl.pack_sequences = False
    # Tokens per packed row; 0 = sampler.max_prompt_length + rl.max_new_tokens, the longest sequence (unit: tokens).
    c.rl.packed_length = 0
    c.rl.router_aux_loss_coef = 0.0  # Qwen3-MoE: weight of the router load-balancing loss in the RL loss (0 = off)
    # DAPO's dynamic sampling (arXiv 2503.14476 §3.2; pdm_jax.rollouts.dynamic_sampling): groups whose rewards are
    # all equal (the rewards the advantages use, the overlong penalty included when it is on; DAPO's paper speaks
    # of accuracy 0 or 1) are dropped and more prompts are sampled, in rounds of rl.prompts_per_step prompts, until
    # the step holds rl.prompts_per_step informative groups or rl.dynamic_sampling_max_rounds rounds are used; at
    # that bound the step trains on the informative groups it has, the rest filled with all-equal groups whose loss
    # is masked (counted: dynamic_sampling_filler_groups in metrics.jsonl). Rounds read the prompts in order and the
    # checkpoint keeps the position, so a resumed run draws the same ones. DAPO's runs use it; configs/qwen3_dapo.py
    # keeps the PDM paper's settings (off), as does every recipe here. Not with per-host rollouts.
    c.rl.dynamic_sampling = False
    # Most sampling rounds per RL step with rl.dynamic_sampling, each of rl.prompts_per_step prompts (verl's
    # max_num_gen_batches), >= 1 (unit: rounds).
    c.rl.dynamic_sampling_max_rounds = 3
    # DAPO's overlong reward shaping (eq. 13, soft overlong punishment; pdm_jax.rl.dapo.length_penalty): L_cache,
    # the buffer of tokens before L_max over which the penalty falls linearly from 0 to -1; 0 = off. A completion
    # of |y| tokens (stop token included) gets 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to
    # L_max, -1 past it, times rl.overlong_penalty_factor, added to its reward before the advantages (the logged
    # reward stays the task's; overlong_penalty is logged). DAPO's runs: L_max = 20480, L_cache = 4096 (verl:
    # reward_model.overlong_buffer.len); configs/qwen3_dapo.py keeps it off (unit: tokens).
    c.rl.overlong_buffer_len = 0
    # L_max of the overlong shaping, <= rl.max_new_tokens; 0 = rl.max_new_tokens (verl's max response length)
    # (unit: tokens).
    c.rl.overlong_max_length = 0
    # Scale of the overlong penalty: R_length x factor (eq. 13: 1; verl: overlong_buffer.penalty_factor), >= 0.
    c.rl.overlong_penalty_factor = 1.0
    # DAPO's overlong filtering (§3.4): a truncated completion (rl.max_new_tokens reached without a stop token)
    # carries no gradient (its loss mask is zeroed) but still counts in its group's advantage baseline. DAPO's
    # ablation (Table 1) applies it before the soft punishment; configs/qwen3_dapo.py keeps it off.
    c.rl.overlong_filtering = False

    # ---- trust region (pdm_jax.rl.trust_region.TrustRegionConfig) ---------------------------
    c.trust_region = ml_collections.ConfigDict()
    # Which out-of-region tokens are masked: none (keep every valid token), ppo (ratio clip, ratio direction), dppo
    # (D > delta, ratio direction) or pdm (D > delta, predictive direction D'):
    c.trust_region.mask = "pdm"  # "none" | "ppo" | "dppo" | "pdm"
    # Proximity D for dppo / pdm: "binary_tv" | "binary_kl" | "topk_tv" | "topk_kl" | "topk_reverse_kl".
    c.trust_region.divergence = "topk_kl"
    # The predictive direction D' of mask=pdm: "aggregated_tail" | "uniform_tail" | "bucket_exact" (closed forms,
    # topk_kl only)
    # | "autodiff" (jax.jvp of any divergence).
    c.trust_region.estimator = "bucket_exact"
    # Radius delta of the trust region (unit: nats for KL, probability for TV).
    c.trust_region.delta = 0.05
    # Radius where the advantage is negative (None = delta) (unit: as delta).
    c.trust_region.delta_low = ml_collections.FieldReference(None, field_type=float)
    # Radius where the advantage is positive (None = delta) (unit: as delta).
    c.trust_region.delta_high = ml_collections.FieldReference(None, field_type=float)
    # mask=ppo keeps r in [1 - clip_eps_low, 1 + clip_eps_high]; also rl.policy_loss=ppo_clip's clip.
    c.trust_region.clip_eps_low = 0.2
    # Upper clip of the ratio (clip-higher: clip_eps_high > clip_eps_low).
    c.trust_region.clip_eps_high = 0.2
    # NaN / inf inputs at a valid token: "mask" (counted in num_nonfinite and masked) | "error" (also raise, naming
    # the position).
    c.trust_region.nonfinite = "mask"
    # Mask direction: "per_token" (ratio for ppo/dppo, the estimator's D' for pdm) | "param_jvp" (pdm only: the
    # first-order change of each token's divergence along the optimizer's update of the unmasked gradient)
    c.trust_region.direction = "per_token"

    # ---- sampler service ------------------------------------------------------------
    c.sampler = ml_collections.ConfigDict()
    # Where rollouts are sampled and how weights reach the sampler (pdm_jax.rollouts.supervisor):
    # "subprocess" (a server process started by the trainer, weights through files) | "remote" (a server at
    # sampler.address, files) | "in_process" (an engine in the trainer's process, files) | "colocated" (an
    # engine on the trainer's first device, weights handed over in memory) | "auto" (subprocess on the CPU
    # backend, colocated on TPU/GPU, where a subprocess cannot open the accelerator the trainer holds).
    c.sampler.mode = "auto"
    c.sampler.address = ""  # http://host:port for mode=remote
    # Shared bearer token of the sampler server (required off loopback); written to config.json redacted.
    c.sampler.token = ""
    # Rollout server: "native" (pdm_jax.sampler.server / engine) | "vllm" (a vLLM or vLLM-TPU OpenAI-compatible
    # server at sampler.address, mode "remote"; pdm_jax.rollouts.vllm_client, docs/sampler.md, "vLLM backend").
    c.sampler.backend = "native"
    c.sampler.vllm_model = ""  # served model name sent with each request ("" = the first of GET /v1/models)
    # Where each weights version is written as a Hugging Face safetensors directory for the vLLM server to
    # reload ("" = WORKDIR/weights_hf); the server must see it under the same path.
    c.sampler.vllm_weights_dir = ""
    # Sampler weights: "none" (f32) | "bf16" | "fp8" (e4m3 weight-only, per channel; native on recent GPUs and
    # TPU7x) | "int8" (weight-only, per channel; native on TPU v5e/v5p/v6e) | "int4" (weight-only, one scale per
    # output channel: a coarse copy, the persistent-mismatch stress lever; docs/sampler.md) | "int2" (four levels per
    # output channel: a stress lever only, coarser than int4).
    c.sampler.quantization = "fp8"
    # The rollouts' own sampling temperature tau_s: mu = softmax(z_q / tau_s) while the loss's pi stays softmax(z /
    # rl.temperature), a persistent behaviour/trainer mismatch that no weight update closes (a stress lever like
    # the paper's FP8 rollouts; docs/sampler.md). None = rl.temperature (no mismatch). Evaluation samples at
    # rl.temperature.
    c.sampler.temperature = ml_collections.FieldReference(None, field_type=float)
    # Relative std of a fixed Gaussian perturbation of the sampler's weight copy (every matmul weight, the embedding and
    # lm_head; each entry gets this times its output channel's RMS, before the quantization): a persistent
    # behaviour/trainer mismatch of a chosen size, the same draws for every weights version (a dialable
    # quantization error; 0.1 is about int4's per-weight error; docs/sampler.md). 0 = none. In [0, 1]. The
    # evaluation engine (eval.engine "f32") is never noised; not available with sampler.backend "vllm".
    c.sampler.weight_noise = 0.0
    # Seed of sampler.weight_noise's draws (an integer in [0, 2**32)); a run resumed keeps the same perturbation.
    c.sampler.weight_noise_seed = 0
    # Dtype the sampler computes in (weights keep their bf16/fp8/int8/int4 values exactly in f32): "auto" (f32 for
    # none, and on the CPU backend; bf16 for the quantized copies on TPU/GPU) | "float32" | "bfloat16".
    c.sampler.compute_dtype = "auto"
    # Token ids that end a rollout or an evaluation sample, comma separated ("151645,151643": Qwen3's
    # <|im_end|> and <|endoftext|>); the tokenizer's eos id is always one of them. "" = with model.hf_path, the
    # checkpoint's own (generation_config.json's eos_token_id and the tokenizer's pad token; pdm_jax.text.
    # checkpoint_stop_ids), else the eos id alone; the run logs the ids chosen.
    c.sampler.stop_token_ids = ""
    # How long the trainer waits for a sampler subprocess to listen.
    c.sampler.startup_timeout_s = 180.0
    # Timeout of one sampler request.
    c.sampler.request_timeout_s = 300.0
    # Extra attempts of a request after a connection error, timeout or 5xx (unit: attempts).
    c.sampler.retries = 3
    # Restarts of a dead or stalled sampler subprocess before the run stops (unit: restarts).
    c.sampler.max_restarts = 3
    # Stall detection while a call is in flight (pdm_jax.rollouts.supervisor): /health probed every
    # interval, each probe given timeout seconds; this many consecutive misses = stalled (kill + restart).
    c.sampler.stall_probe_interval_s = 10.0
    # Timeout of one /health probe.
    c.sampler.stall_probe_timeout_s = 10.0
    # Consecutive unanswered /health probes that count as a stall (unit: probes).
    c.sampler.stall_probe_misses = 3  # 0 = no probing
    c.sampler.max_prompt_length = 64  # tokens; longest accepted prompt (largest prompt bucket)
    # Static batching's chunk (unit: rows).
    c.sampler.max_batch_size = sampler_defaults.MAX_BATCH_SIZE  # largest batch bucket; bigger requests run in chunks
    # How a request's rows are batched (pdm_jax.sampler.engine): "continuous" (max_slots slots of one static KV
    # cache; a slot whose row stops takes the next pending row: the static engine's tokens, log mu within f32
    # rounding; faster on mixed response lengths and on the default run's requests; docs/sampler.md) | "static"
    # (chunks of max_batch_size rows, each run until its longest row stops). One default for the engine, the server
    # and the trainer: pdm_jax.sampler.defaults.
    c.sampler.batching = sampler_defaults.BATCHING
    # Continuous batching's KV-cache slots, rounded up to a power of two; 0 = max_batch_size (unit: slots).
    c.sampler.max_slots = sampler_defaults.MAX_SLOTS
    engine_config_fields(c.sampler)  # EngineSpec's run-config fields: defaults and descriptions in sampler/spec.py
    # Multi-process runs (distributed=True): each process samples only the prompts whose rows its devices hold
    # (whole groups; keyed by their index in the step, so the rollouts equal a single process's) and evaluates
    # its share of the held-out prompts (pdm_jax.per_host). False: every process samples every prompt (old).
    c.sampler.per_host_rollouts = True
    # The sharded engine (pdm_jax.sampler.engine, make_sampler_mesh; the trainer's mesh axis names): rows over data,
    # heads / kv heads / MLP / vocab over tensor, the KV cache sharded the same way. 1 x 1 = one device (default).
    # colocated: the first data*tensor of this process's devices (a sub-mesh of the trainer's, or all of them);
    # subprocess: the server's own devices. Heads, kv heads and the MLP width must divide by tensor and
    # max_batch_size / max_slots by data (the engine names the one that does not).
    c.sampler.mesh = ml_collections.ConfigDict()
    # The sampler mesh's data axis: rows split over this many devices (unit: devices).
    c.sampler.mesh.data = 1
    # The sampler mesh's tensor axis: heads, MLP and vocabulary split over this many devices (unit: devices).
    c.sampler.mesh.tensor = 1

    # ---- evaluation --------------------------------------------------------------------
    c.eval = ml_collections.ConfigDict()
    # Held-out evaluation every this many RL steps, and at the last one (unit: RL steps).
    c.eval.every_steps = 50
    # Held-out prompts evaluated, the first of the held-out set (unit: prompts).
    c.eval.num_prompts = 200
    # Samples per held-out prompt (unit: samples).
    c.eval.samples_per_prompt = 4  # avg@k at the training temperature
    # Also evaluate greedy (temperature 0) accuracy.
    c.eval.greedy = True
    # Which engine evaluates: "f32" (an unquantized f32 engine in the trainer's process on its first device,
    # fed the trainer's weights in memory) | "rollout" (the rollout sampler itself: sampler.quantization,
    # sampler.mode; no second engine, but evaluations then include the quantization gap and sampler.weight_noise).
    c.eval.engine = "f32"

    # ---- mesh ------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    # Trainer mesh's data-parallel axis; -1 = all devices the other axes leave (unit: devices).
    c.mesh.data = -1
    # Trainer mesh's FSDP axis: parameters, optimizer state and batch sharded over it (unit: devices).
    c.mesh.fsdp = 1
    # Trainer mesh's tensor-parallel axis: heads, MLP and vocabulary split over it (unit: devices).
    c.mesh.tensor = 1
    c.distributed = False  # call jax.distributed.initialize() (multi-host)
    # Multi-host runtime (pdm_jax.distributed); empty/sentinel values fall back to the environment
    # (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS), then to
    # JAX's cluster auto-detection (Cloud TPU, SLURM, ...).
    c.multihost = ml_collections.ConfigDict()
    c.multihost.coordinator_address = ""  # "host:port" of process 0
    # Processes of the run (unit: processes).
    c.multihost.num_processes = 0  # 0 = from the environment / auto-detected
    c.multihost.process_id = -1  # -1 = from the environment / auto-detected
    c.multihost.local_device_ids = ""  # e.g. "0,1,2,3"; "" = all local devices
    c.multihost.cpu_collectives = "gloo"  # CPU cross-process collectives: "gloo" | "mpi" | "none"
    # Timeout of jax.distributed.initialize().
    c.multihost.initialization_timeout_s = 300

    # ---- dry run (python -m pdm_jax.train --dry_run; pdm_jax.dry_run) ------------------
    c.dry_run = ml_collections.ConfigDict()
    c.dry_run.chip = "v5p"  # target accelerator: v4 | v5e | v5p | v6e | H100 | H200 (HBM per chip)
    c.dry_run.num_devices = 8  # chips the mesh spans (resolves the mesh's -1 axis)
    # Who compiles the train step and the rollout engine (pdm_jax.aot): "tpu" (XLA:TPU for dry_run.topology, needs
    # pip install -e '.[tpu]') | "gpu" (deviceless XLA:GPU, '.[gpu-aot]') | "cpu" (XLA:CPU on fake devices, an
    # estimate) | "none" (the analytic plan alone) | "auto" (the chip's compiler if installed, else cpu up to
    # max_compile_params parameters, else none).
    c.dry_run.compiler = "auto"
    c.dry_run.topology = ""  # the TPU slice, e.g. "v5p:4x4x4"; "" = from chip and num_devices (aot.default_topology)
    # A limit on the model's size (unit: parameters).
    c.dry_run.max_compile_params = 2_000_000_000  # compiler auto: XLA:CPU compiles only models up to this size
    # With compiler=cpu also compile the sampler's continuous-batching program (minutes on CPU); XLA:TPU / XLA:GPU
    # always compile it.
    c.dry_run.compile_sampler = False
    # XLA:TPU / XLA:GPU: count the step's FLOPs with every loop iteration (two more compiles of the step without
    # loops, with 1 and 2 layers: dry_run.counted_flops); False skips them (a faster plan; the report's
    # counted_tflops line then says "not counted").
    c.dry_run.count_flops = True
    # True: search the memory knobs (micro-batch, loss chunk, remat, the engine's mesh and slots) for dry_run.chip x
    # dry_run.num_devices against the analytic plan, print the settings with the most work per step as --config.
    # overrides, then dry-run the config with them (compiled when the chip's compiler is installed and
    # dry_run.compiler is not none); refuses, naming the part, where nothing fits (pdm_jax.dry_run_fit).
    c.dry_run.fit = False

    # ---- profiling (pdm_jax.profiling) --------------------------------------------------
    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ""  # "a:b": jax.profiler trace of RL steps a..b (1-based, inclusive) into WORKDIR/profile

    # ---- persistent JAX compilation cache (trainer and sampler subprocess; pdm_jax.profiling) ----
    c.compile_cache = ml_collections.ConfigDict()
    # "default" (~/.cache/pdm_jax/jax_cache, or $XDG_CACHE_HOME/pdm_jax/jax_cache) | "workdir"
    # (WORKDIR/jax_cache) | a directory | "" (no persistent cache)
    c.compile_cache.dir = "default"
    c.compile_cache.min_compile_time_s = 0.0  # programs compiling faster than this are not written (s)

    # ---- host memory (pdm_jax.host_memory; trainer and sampler subprocess) ----------------
    c.host_memory = ml_collections.ConfigDict()
    # True: glibc keeps freed large blocks mapped for reuse (XLA:CPU's per-execution temp buffers are not
    # page-faulted in again every step; same numbers); False: the default allocator.
    c.host_memory.reuse_freed = True

    # ---- checkpoints and logging ------------------------------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    # Orbax checkpoint every this many RL steps, and at the last one (unit: RL steps).
    c.checkpoint.every_steps = 50
    # Checkpoints kept in WORKDIR/checkpoints; older ones are deleted (unit: checkpoints).
    c.checkpoint.max_to_keep = 2
    c.log = ml_collections.ConfigDict()
    # Also write TensorBoard events to WORKDIR/tensorboard.
    c.log.tensorboard = True
    # Show tqdm progress bars of the warm start and the RL loop.
    c.log.progress = True
    # Also log to Weights & Biases (pip install -e '.[wandb]'): the metrics.jsonl scalars under their TensorBoard
    # names (phase/name, each phase against its own phase/step), the run config (secrets redacted, as config.json),
    # curves.png and the evaluation table at the end. The run id is kept in WORKDIR/wandb_run_id, so a resumed run
    # continues the same W&B run. A W&B failure is a warning: training and the other sinks go on (pdm_jax.wandb_log).
    c.log.wandb = False
    # The W&B project the run is logged to.
    c.log.wandb_project = "pdm_jax"
    # The W&B run's display name; "" = the workdir's base name.
    c.log.wandb_run_name = ""
    # "online" (needs `wandb login` or WANDB_API_KEY) or "offline" (files under WORKDIR/wandb; `wandb sync` later).
    c.log.wandb_mode = "online"

    # ---- fault injection for the resume / sampler-failure tests (off by default) ---------
    c.debug = ml_collections.ConfigDict()
    # Fault injection (unit: RL step); -1 = off.
    c.debug.kill_after_rl_step = -1  # SIGKILL the trainer itself right after this RL step's checkpoint
    # Fault injection (unit: RL step); -1 = off.
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
    "direction": "trust_region.direction",
    "seed": "seed",
    "steps": "rl.steps",
    "quantization": "sampler.quantization",
    "weight_noise": "sampler.weight_noise",
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


def load_config_file(config_spec: str) -> ml_collections.ConfigDict:
    """Loads ``path.py[:arg]`` as ``--config`` does: the file's ``get_config(arg)`` (None without ``:arg``).

    Raises:
      ValueError: the file does not exist, or what its ``get_config`` raises for a bad argument string (an
        unknown key or a value that does not parse: `apply_arg`).
    """
    import importlib.util

    path, _, arg = config_spec.partition(":")
    if not os.path.exists(path):
        raise ValueError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("_config_file", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg or None)


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


def rollout_temperature(config) -> float:
    """tau_s, the temperature the sampler draws the rollouts at: ``sampler.temperature``, or ``rl.temperature`` when
    that is None. The behaviour log-probabilities log mu come at tau_s; the trainer's pi at ``rl.temperature``."""
    tau = config.sampler.temperature
    return float(config.rl.temperature if tau is None else tau)


# ---- validation --------------------------------------------------------------------------

def _leaves(node, prefix=""):
    """(dotted path, value) of every leaf of a ConfigDict, skipping the free-form OPEN_FIELDS."""
    for key in node.keys():
        path = f"{prefix}{key}"
        value = node[key]
        if path in OPEN_FIELDS:
            continue
        if hasattr(value, "keys"):
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _lookup(config, path: str):
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def unknown_fields(config: ml_collections.ConfigDict) -> list[str]:
    """Dotted paths in ``config`` that the schema (:func:`get_base_config`) does not have."""
    known = set(dict(_leaves(get_base_config())))
    groups = {p.rsplit(".", 1)[0] for p in known if "." in p} | set(OPEN_FIELDS)
    return [p for p, _ in _leaves(config) if p not in known and p not in groups]


def check_field_path(path: str) -> None:
    """Raises ValueError unless ``path`` (e.g. ``rl.delta``) names a field of the schema or lies in OPEN_FIELDS.

    The command line checks every ``--config.<path>=`` override with it before
    ml_collections applies it (which would fail with a bare ``AttributeError``).
    """
    if any(path == p or path.startswith(p + ".") for p in OPEN_FIELDS):
        return
    if path not in dict(_leaves(get_base_config())):
        raise ValueError(f"{path}: unknown config field (not in pdm_jax.config.get_base_config)")


def check_override_value(path: str, raw: str) -> None:
    """Raises ValueError, naming the field and the value, when a ``--config.<path>=<raw>`` override does not parse
    as the schema's kind of that field (bool, int, float), as absl's flag parsers read it; the command line checks
    every override with it before absl would exit 1 with "FATAL Flags parsing error".
    """
    check_field_path(path)
    if any(path == p or path.startswith(p + ".") for p in OPEN_FIELDS):
        return
    from absl import flags  # the parsers ml_collections' config flags use

    default = dict(_leaves(get_base_config()))[path]
    kind = {bool: ("a boolean (true/false, 1/0)", flags.BooleanParser()),
            int: ("an integer", flags.IntegerParser()),
            float: ("a number", flags.FloatParser()),
            # An optional number (None by default): the flag parses a number only; None is set in the argument
            # string (--config=configs/tiny.py:<path>=none) or by leaving the field out.
            type(None): (f"a number (None only in the argument string, --config=<file>:{path}=none)",
                         flags.FloatParser())}.get(type(default))
    if kind is None:
        return
    try:
        kind[1].parse(raw)
    except (ValueError, TypeError):
        raise ValueError(f"{path} must be {kind[0]}, got {raw!r}") from None


def _check_types(config) -> None:
    """Each leaf has the kind of value its schema default has (bool, int, number, str; None = optional number)."""
    for path, default in _leaves(get_base_config()):
        try:
            value = _lookup(config, path)
        except (KeyError, AttributeError):
            raise ValueError(f"{path}: missing from the config (every field of pdm_jax.config.get_base_config "
                             f"must be present; build configs from it)") from None
        if isinstance(default, bool):
            ok, what = isinstance(value, (bool, np.bool_)), "true or false"
        elif isinstance(default, int):
            ok, what = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)), \
                "an integer"
        elif isinstance(default, float) or default is None:
            ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            ok = ok or (default is None and value is None)
            what = "a number" + (" or None" if default is None else "")
        else:
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"{path} = {value!r}: must be {what}")


#: Config fields holding secrets: `redacted` replaces them wherever the config is written or logged.
SECRET_FIELDS = ("sampler.token",)
REDACTED = "<redacted>"


def redacted(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` with every non-empty field of `SECRET_FIELDS` replaced by ``"<redacted>"``
    (the workdir's ``config.json``; the run itself keeps the real values)."""
    out = config.copy_and_resolve_references()
    for path in SECRET_FIELDS:
        *parents, leaf = path.split(".")
        node = out
        for name in parents:
            node = node.get(name) if node is not None else None
        if node is not None and node.get(leaf):
            node[leaf] = REDACTED  # an existing field: allowed on a locked ConfigDict
    return out


def _collect(errors: list, check, *args) -> None:
    """Runs one group of checks, keeping its errors in ``errors``. A check that breaks on a value already
    named there (e.g. a comparison on a refused field) adds nothing; any other failure propagates."""
    before = len(errors)
    try:
        check(*args)
    except ValueError as e:
        errors.append(str(e))
    except Exception:  # noqa: BLE001
        if len(errors) == before:
            raise


def _check_rl(config) -> None:
    """The warm start's checks and the RL phase's that span sections (its own: `pdm_jax.sections.RlSpec`)."""
    rl = config.rl
    for field in ("sft.steps", "sft.warmup_steps"):
        _need(_lookup(config, field) >= 0, field, _lookup(config, field), "must be >= 0")
    value = config.sft.learning_rate
    _need(math.isfinite(value) and value > 0, "sft.learning_rate", value, "must be finite and > 0")
    _need(0.0 <= config.sft.target_token_accuracy <= 1.0, "sft.target_token_accuracy",
          config.sft.target_token_accuracy, "must be a fraction in [0, 1] (0 = off)")
    _need(config.sft.target_window >= 1, "sft.target_window", config.sft.target_window, "must be >= 1")
    _need(config.sft.lr_schedule in LR_SCHEDULES, "sft.lr_schedule", config.sft.lr_schedule,
          f"must be one of {LR_SCHEDULES}")
    _need(config.sft.lr_schedule == "constant" or config.sft.steps > config.sft.warmup_steps, "sft.lr_schedule",
          config.sft.lr_schedule, f"decays after the warm-up: sft.steps = {config.sft.steps} must exceed "
          f"sft.warmup_steps = {config.sft.warmup_steps}")
    longest = config.sampler.max_prompt_length + rl.max_new_tokens
    _need(isinstance(rl.packed_length, int) and (rl.packed_length == 0 or rl.packed_length >= longest),
          "rl.packed_length", rl.packed_length, f"must be 0 (the longest sequence) or at least "
          f"sampler.max_prompt_length + rl.max_new_tokens = {longest} tokens")
    if rl.pack_sequences:
        _need(config.trust_region.direction != "param_jvp", "rl.pack_sequences", True,
              "is not implemented with trust_region.direction = param_jvp (its jvp runs on padded rows)")
        _need(not config.model.moe_routing_replay, "rl.pack_sequences", True,
              "is not implemented with model.moe_routing_replay (the replayed routing is laid out padded)")
    step_configs(config)  # trust region and policy loss: their own checks, named by field


def check_context(config, model_config) -> None:
    """Raises ValueError naming ``rl.max_new_tokens`` when ``sampler.max_prompt_length + rl.max_new_tokens``
    exceeds the resolved model's ``max_position_embeddings`` (a preset's or a checkpoint's). ``config``: the run
    config or its `pdm_jax.run_spec.RunSpec`."""
    context = config.sampler.max_prompt_length + config.rl.max_new_tokens
    _need(context <= model_config.max_position_embeddings, "rl.max_new_tokens", config.rl.max_new_tokens,
          f"sampler.max_prompt_length + rl.max_new_tokens = {context} exceeds the model's "
          f"max_position_embeddings = {model_config.max_position_embeddings}")


def packed_length(config) -> int:
    """L, tokens per packed row (``rl.packed_length``, or 0: ``sampler.max_prompt_length + rl.max_new_tokens``)."""
    return int(config.rl.packed_length or config.sampler.max_prompt_length + config.rl.max_new_tokens)


def resolve_sampler_mode(mode: str, backend: Optional[str] = None) -> str:
    """The sampler mode a run uses: ``mode``, or for ``"auto"`` "subprocess" on the CPU backend and
    "colocated" on TPU/GPU (``backend``, default ``jax.default_backend()``).

    Raises:
      ValueError: naming ``sampler.mode`` and the value when it is not one of `SAMPLER_MODES`.
    """
    _need(mode in SAMPLER_MODES, "sampler.mode", mode, f"must be one of {SAMPLER_MODES}")
    if mode != "auto":
        return mode
    return "subprocess" if (backend or jax.default_backend()) == "cpu" else "colocated"


def check_sampler_workdir(config, workdir: str, backend: Optional[str] = None) -> None:
    """Refuses a sampler mode that passes weights through local files (`SAMPLER_FILE_MODES`, after resolving
    ``auto`` for ``backend``) with a bucket ``workdir`` (``gs://...``): checked by the command line before any work
    starts (on a pod: before the model loads), and again by the sampler's supervisor.

    Raises:
      ValueError: naming ``sampler.mode``, its value and the workdir.
    """
    from pdm_jax.workdir import is_remote  # no JAX, no cycle: pdm_jax.workdir imports nothing of the project

    mode = config.sampler.mode
    if workdir and is_remote(workdir) and resolve_sampler_mode(mode, backend) in SAMPLER_FILE_MODES:
        raise ValueError(f"sampler.mode = {mode!r} (resolved: {resolve_sampler_mode(mode, backend)!r}) reads weights "
                         f"versions from local files, but the workdir {workdir} is a bucket: use "
                         "sampler.mode = 'colocated' with a bucket workdir")


def _check_weight_noise(config) -> None:
    """``sampler.weight_noise`` in [0, MAX_WEIGHT_NOISE] (native backend only) and its seed in [0, 2**32)."""
    sc = config.sampler
    noise, most = sc.weight_noise, sampler_defaults.MAX_WEIGHT_NOISE
    _need(isinstance(noise, (int, float)) and not isinstance(noise, bool) and math.isfinite(noise)
          and 0 <= noise <= most, "sampler.weight_noise", noise, f"must be a finite relative std in [0, {most}]")
    _need(noise == 0 or sc.backend == "native", "sampler.weight_noise", noise,
          "must be 0 with sampler.backend = 'vllm' (the vLLM server loads the exported weights as they are)")
    seed = sc.weight_noise_seed
    _need(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32, "sampler.weight_noise_seed",
          seed, "must be an integer in [0, 2**32)")


def _check_sampler_and_eval(config) -> None:
    sc = config.sampler
    _need(sc.mode in SAMPLER_MODES, "sampler.mode", sc.mode, f"must be one of {SAMPLER_MODES}")
    _need(sc.backend in SAMPLER_BACKENDS, "sampler.backend", sc.backend, f"must be one of {SAMPLER_BACKENDS}")
    if sc.backend == "vllm":
        _need(sc.mode == "remote", "sampler.mode", sc.mode,
              "must be 'remote' when sampler.backend = 'vllm' (the vLLM server runs on its own, at sampler.address)")
    _need(sc.quantization in QUANTIZATIONS, "sampler.quantization", sc.quantization, f"must be one of {QUANTIZATIONS}")
    # The sampler refuses 0 < tau < MIN_TEMPERATURE (logits / tau overflow f32): named here, before any work.
    _need(sc.temperature is None or (math.isfinite(sc.temperature) and sc.temperature >= MIN_TEMPERATURE),
          "sampler.temperature", sc.temperature, f"must be None (= rl.temperature) or finite and >= {MIN_TEMPERATURE}")
    tau = config.rl.temperature
    _need(not 0 < tau < MIN_TEMPERATURE, "rl.temperature", tau, f"must be >= {MIN_TEMPERATURE}: the sampler draws the "
          "evaluation samples (and, with sampler.temperature None, the rollouts) at it")
    _need(config.eval.engine in EVAL_ENGINES, "eval.engine", config.eval.engine, f"must be one of {EVAL_ENGINES}")
    _need(sc.compute_dtype in COMPUTE_DTYPES, "sampler.compute_dtype", sc.compute_dtype,
          f"must be one of {COMPUTE_DTYPES}")
    _need(sc.batching in sampler_defaults.BATCHING_MODES, "sampler.batching", sc.batching,
          f"must be one of {sampler_defaults.BATCHING_MODES}")
    _need(isinstance(sc.max_slots, int) and not isinstance(sc.max_slots, bool) and sc.max_slots >= 0,
          "sampler.max_slots", sc.max_slots, "must be an integer >= 0 (0 = sampler.max_batch_size)")
    for f in EngineSpec.config_fields():  # each checked by EngineSpec, the error named by its config path
        try:
            EngineSpec(**{f.name: sc[f.name]})
        except ValueError as e:
            _need(False, f"sampler.{f.name}", sc[f.name], str(e).replace(f"EngineSpec: {f.name} ", ""))
    for axis in ("data", "tensor"):
        size = sc.mesh[axis]
        _need(isinstance(size, int) and not isinstance(size, bool) and size >= 1, f"sampler.mesh.{axis}", size,
              "must be an integer >= 1 (sampler.mesh 1 x 1 = a single-device engine)")
    if sc.mode == "remote":
        _need(bool(sc.address), "sampler.address", sc.address, "required when sampler.mode = 'remote'")
    if sc.token:  # the value itself is a secret: never in a message
        _need(token_problem(sc.token) is None, "sampler.token", REDACTED, token_problem(sc.token) or "")
    for name in ("startup_timeout_s", "request_timeout_s"):
        _need(math.isfinite(sc[name]) and sc[name] > 0, f"sampler.{name}", sc[name],
              "must be a finite number of seconds > 0")
    for name in ("stall_probe_interval_s", "stall_probe_timeout_s"):
        _need(math.isfinite(sc[name]) and sc[name] > 0, f"sampler.{name}", sc[name],
              "must be a finite number of seconds > 0")
    for name in ("retries", "max_restarts", "stall_probe_misses"):
        _need(sc[name] >= 0, f"sampler.{name}", sc[name], "must be >= 0")
    parse_stop_token_ids(sc.stop_token_ids)
    for field in ("eval.every_steps", "eval.samples_per_prompt", "eval.num_prompts", "sft.batch_size",
                  "sampler.max_prompt_length", "sampler.max_batch_size"):
        _need(_lookup(config, field) >= 1, field, _lookup(config, field), "must be >= 1")


def parse_stop_token_ids(text: str, vocab_size: Optional[int] = None) -> tuple:
    """``sampler.stop_token_ids`` ("151645,151643"; "" = none besides the eos id) as a tuple of ints.

    Raises:
      ValueError: naming ``sampler.stop_token_ids`` and the value for an entry that is not a
        non-negative integer, an id >= ``vocab_size`` (when given), a repeated id, or more than
        ``pdm_jax.sampler.wire.MAX_STOP_TOKEN_IDS`` - 1 ids (the eos id takes one slot of the
        sampler's stop table).
    """
    field = "sampler.stop_token_ids"
    if not isinstance(text, str):
        raise ValueError(f"{field} = {text!r}: must be a string of comma-separated token ids")
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    ids = []
    for p in parts:
        if _need(p.isdigit(), field, text, f"{p!r} is not a non-negative integer token id"):
            ids.append(int(p))
    _need(len(set(ids)) == len(ids), field, text, "repeats a token id")
    _need(len(ids) < MAX_STOP_TOKEN_IDS, field, text,
          f"at most {MAX_STOP_TOKEN_IDS - 1} ids (the eos id takes one of the sampler's {MAX_STOP_TOKEN_IDS} slots)")
    if vocab_size is not None:
        bad = [i for i in ids if i >= vocab_size]
        _need(not bad, field, text, f"ids {bad} are outside the vocabulary of {vocab_size} tokens")
    return tuple(ids)


def _check_routing_replay(config) -> None:
    """``model.moe_routing_replay``: a bool; when on, a MoE model (``model.num_experts`` > 0 or a MoE
    preset; an ``hf_path`` checkpoint is checked once loaded, `check_routing_replay_model`) and the
    pdm_jax sampler (the vLLM backend returns no routing)."""
    mc = config.model
    replay = mc.moe_routing_replay
    _need(isinstance(replay, bool), "model.moe_routing_replay", replay, "must be true or false")
    if not replay:
        return
    _need(config.sampler.backend != "vllm", "model.moe_routing_replay", replay,
          "needs the pdm_jax sampler: the vLLM backend (sampler.backend = 'vllm') cannot return the experts it "
          "routed to")
    if not mc.hf_path:
        moe = PRESETS[mc.preset]().is_moe if mc.preset in PRESETS else mc.num_experts > 0
        _need(moe, "model.moe_routing_replay", replay,
              "needs a mixture-of-experts model (model.num_experts > 0 or a MoE preset); this model is dense")


def check_routing_replay_model(config, model_config) -> None:
    """Raises ValueError naming ``model.moe_routing_replay`` when it is on for a dense ``model_config``
    (e.g. a dense ``model.hf_path`` checkpoint). ``config``: the run config or its `pdm_jax.run_spec.RunSpec`."""
    if config.model.moe_routing_replay:
        _need(model_config.is_moe, "model.moe_routing_replay", True,
              "needs a mixture-of-experts model; the loaded model is dense (num_experts = 0)")


def check_sampler_mesh(sampler, model_config) -> None:
    """Refuses at start-up (before the warm start) a ``sampler.mesh`` the rollout engine could not split.

    The engine's own check (`pdm_jax.sampler.engine.check_engine_mesh`) runs on an abstract
    mesh of ``sampler.mesh.data`` x ``sampler.mesh.tensor``: the tensor axis must divide the
    model's heads, kv heads and MLP widths, the data axis ``sampler.max_batch_size`` and the
    continuous slots (``sampler.max_slots`` or ``max_batch_size``, rounded up to a power of two).
    A colocated engine also needs that many devices in this process. Not checked for a remote or
    vLLM sampler (its server owns its mesh).

    Args:
      sampler: the run's `pdm_jax.rollouts.spec.SamplerSpec`.
      model_config: the resolved ``Qwen3Config``.

    Raises:
      ValueError: ``"sampler.mesh = <data> x <tensor>: <what is wrong>"``.
    """
    sc = sampler
    data, tensor = sc.mesh_data, sc.mesh_tensor
    mode = resolve_sampler_mode(sc.mode)
    if data * tensor == 1 or mode == "remote" or sc.backend == "vllm":
        return
    if mode == "colocated" and data * tensor > jax.local_device_count():
        raise ValueError(f"sampler.mesh = {data} x {tensor}: needs {data * tensor} devices but this process has "
                         f"{jax.local_device_count()} (sampler.mode = colocated samples on the trainer's own devices)")
    slots = sc.max_slots or sc.max_batch_size
    slots = 1 << (slots - 1).bit_length() if slots > 1 else 1  # the engine rounds the slots up to a power of two
    mesh = jax.sharding.AbstractMesh((data, 1, tensor), MESH_AXES)
    try:
        check_engine_mesh(model_config, mesh, max_batch_size=sc.max_batch_size, max_slots=slots)
    except ValueError as e:
        raise ValueError(f"sampler.mesh = {data} x {tensor}: {e}") from None


def _check_model(config, vocab_size: Optional[int]) -> None:
    """The model's checks that span sections (its own: `pdm_jax.sections.ModelSpec`): routing replay, the explicit
    shape with the vocabulary and its context against the prompt and completion lengths."""
    mc = config.model
    _check_routing_replay(config)
    if not mc.hf_path and not mc.preset:
        try:
            model_config_from_fields(mc, vocab_size or 1)
        except ValueError as e:  # names Qwen3Config.<field>: the same names under model.
            raise ValueError(f"model: {e} (set as model.<field> in the run config)") from None
        context = config.sampler.max_prompt_length + config.rl.max_new_tokens
        _need(context <= mc.max_position_embeddings, "rl.max_new_tokens", config.rl.max_new_tokens,
              f"sampler.max_prompt_length + rl.max_new_tokens = {context} exceeds "
              f"model.max_position_embeddings = {mc.max_position_embeddings}")


def _check_mesh(config) -> None:
    m = config.mesh
    try:
        MeshConfig(data=m.data, fsdp=m.fsdp, tensor=m.tensor).axis_sizes(jax.device_count())
    except ValueError as e:
        raise ValueError(f"mesh = (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) on "
                         f"{jax.device_count()} device(s): {e}") from None


def _check_seeds_and_timeouts(config) -> None:
    for name, value in (("seed", config.seed), ("data.seed", config.data.seed)):
        _need(0 <= value <= MAX_SEED, name, value, "must be an integer in [0, 2**63 - 1] (the sampler's seed range)")


def _check_reward(config) -> None:
    """``reward.functions`` / ``weights`` / ``timeout_s``, and what ``data.kind = "file"`` needs of them."""
    rc, dc = config.reward, config.data
    functions = reward_functions.parse_functions(rc.functions)  # a ValueError naming the field
    reward_functions.parse_weights(rc.weights, len(functions))
    _need(math.isfinite(rc.timeout_s) and rc.timeout_s > 0, "reward.timeout_s", rc.timeout_s,
          "must be a finite number of seconds > 0")
    if dc.kind != "file":
        return
    _need(bool(dc.prompt_field), "data.prompt_field", dc.prompt_field, "must name a column when data.kind = 'file'")
    if not dc.answer_field:
        _need(bool(functions), "reward.functions", rc.functions,
              "data.kind = 'file' without data.answer_field has no built-in verifier: name your reward functions "
              "or set data.answer_field (the built-in math verifier's reference answer)")
        _need(reward_functions.BUILTIN_VERIFIER not in functions, "reward.functions", rc.functions,
              f"{reward_functions.BUILTIN_VERIFIER} needs data.answer_field with data.kind = 'file'")
        _need(config.sft.steps == 0, "sft.steps", config.sft.steps,
              "the warm start needs a reference answer: set data.answer_field (data.kind = 'file') or sft.steps=0")


def _check_paths(config, exist: bool = True) -> None:
    """The data source's and the paths' checks (the tokenizer's own: `pdm_jax.sections.TokenizerSpec`)."""
    tc, dc = config.tokenizer, config.data
    if tc.kind == "bpe":
        chat = (dc.kind in data_sources.KINDS and dc.chat_template in data_sources.CHAT_TEMPLATES  # else named below
                and data_sources.applies_chat_template(dc.kind, dc.prompt_format, dc.chat_template))
        _need(not chat, "data.chat_template", dc.chat_template,
              "tokenizer.kind = 'bpe' trains a tokenizer without a chat template, and this data source would apply "
              "one (question prompts, gsm8k and dapo_math do under 'auto'): set data.chat_template=off or use "
              "tokenizer.kind=path")
    _need(dc.kind in data_sources.KINDS, "data.kind", dc.kind, f"must be one of {data_sources.KINDS}")
    if _need(dc.prompt_format in data_sources.PROMPT_FORMATS, "data.prompt_format", dc.prompt_format,
             f"must be one of {data_sources.PROMPT_FORMATS}") and dc.kind in data_sources.KINDS:
        _need(dc.kind not in ("gsm8k", "dapo_math") or dc.prompt_format != "compact", "data.prompt_format",
              dc.prompt_format,
              f"data.kind = {dc.kind!r} has question prompts only: set data.prompt_format=auto (or question)")
    _need(dc.chat_template in data_sources.CHAT_TEMPLATES, "data.chat_template", dc.chat_template,
          f"must be one of {data_sources.CHAT_TEMPLATES}")
    if dc.kind != "reasoning_gym":  # file-backed sources: the path comes first, before any format option
        _need(bool(dc.path), "data.path", dc.path, f"required when data.kind = {dc.kind!r} (a local json/jsonl/"
              "parquet file; nothing is downloaded)")
    for field, path in (("model.hf_path", config.model.hf_path), ("data.path", dc.path),
                        ("data.eval_path", dc.eval_path), ("tokenizer.path", tc.path if tc.kind == "path" else "")):
        if path and exist:
            _need(os.path.exists(path), field, path, "no such file or directory")
    shipped = checkpoint_tokenizer_file(config.model.hf_path)
    _need(shipped is None or tc.kind == "path", "model.hf_path", config.model.hf_path,
          f"ships its own tokenizer ({shipped}), and tokenizer.kind = {tc.kind!r} builds another one, whose ids "
          f"would not mean the checkpoint's tokens: set tokenizer.kind=path, tokenizer.path={config.model.hf_path}")


def validate_config(config: ml_collections.ConfigDict, *, vocab_size: Optional[int] = None,
                    num_held_out: Optional[int] = None, dry_run: bool = False, paths_exist: bool = True) -> None:
    """Checks a run config before any work starts.

    Checked: no unknown field (named by its dotted path); every field has the kind
    of value its schema default has; the trust region and policy loss (through
    :func:`step_configs`); group size >= 2, mini-batches dividing the rollout batch,
    step counts, learning rates, Adam betas; sampler mode, quantization, timeouts and
    retries; evaluation and checkpoint sizes; the model dtypes, preset or shape and
    its context; the mesh against ``jax.device_count()``; the tokenizer kind; the
    data kind and its file (``data.path`` for the file-backed kinds, before any
    format option) and that every configured local path exists. With
    ``vocab_size`` (known without it for a char tokenizer, from ``tokenizer.symbols``):
    K = ``rl.top_k_logprobs`` <= the tokenizer's vocabulary. With
    ``num_held_out`` (the source's held-out prompts): ``eval.num_prompts`` <= it.

    ``dry_run``: the checks of ``--dry_run``, which needs no checkpoint, data or devices: paths are not
    required to exist and the mesh is resolved on ``dry_run.num_devices`` (by the dry run) instead of
    ``jax.device_count()``. ``paths_exist=False``: every check but the existence of the configured paths (the
    documentation's commands, whose checkpoint and data paths are placeholders, are checked this way).

    Every check runs, so that one start names every problem: a single error is raised as
    ``"<dotted.field> = <value>: <what is wrong>"``, several as ``"N config errors: <each>; <each>"``.

    Raises:
      ValueError: as above (unknown fields and wrong value kinds are raised first, alone).
    """
    unknown = unknown_fields(config)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown config field (not in pdm_jax.config.get_base_config)"
                         + (f"; also unknown: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""))
    _check_types(config)
    sections = [(_check_section, (name,)) for name in SECTION_RECORDS]  # each record's own checks
    _run_checks(config, sections[:2] + [(_check_paths, (paths_exist and not dry_run,)), (_check_rl, ()),
                                        (_check_sampler_and_eval, ()), (_check_weight_noise, ()),
                                        (_check_model, (vocab_size,))] + sections[2:]
                + [(_check_seeds_and_timeouts, ()), (_check_reward, ()), (_check_sizes, (vocab_size, num_held_out))]
                + ([] if dry_run else [(_check_mesh, ())]))


def _check_section(config, name: str) -> None:
    """The checks of section ``name``'s record (`pdm_jax.sections.SECTION_RECORDS`), built once from it."""
    _read_section(SECTION_RECORDS[name], config[name])


def _run_checks(config, checks) -> None:
    """Runs every ``(check, args)``, collecting their `_need` errors; raises them as one ValueError."""
    errors: list = []
    token = _COLLECTED.set(errors)
    try:
        for check, args in checks:
            _collect(errors, check, config, *args)
    finally:
        _COLLECTED.reset(token)
    errors = list(dict.fromkeys(errors))  # a value checked twice (stop ids: here and with the vocabulary) once
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} config errors: " + "; ".join(errors))


def _check_sizes(config, vocab_size: Optional[int], num_held_out: Optional[int]) -> None:
    k = config.rl.top_k_logprobs
    if vocab_size is None and config.tokenizer.kind == "char":  # known before the tokenizer is written
        vocab_size = char_vocab_size(config.tokenizer.symbols)
    tv = config.tokenizer.vocab_size
    if vocab_size is None and config.tokenizer.kind == "bpe" and isinstance(tv, int) and tv > 0:
        vocab_size = tv  # its most; the trained size is checked again
    if vocab_size is not None:
        _need(k <= vocab_size, "rl.top_k_logprobs", k, f"K is larger than the vocabulary size {vocab_size}")
        parse_stop_token_ids(config.sampler.stop_token_ids, vocab_size)
    if num_held_out is not None:
        _need(config.eval.num_prompts <= num_held_out, "eval.num_prompts", config.eval.num_prompts,
              f"the data source has only {num_held_out} held-out prompts (data.num_eval / data.eval_path)")


# ---- the typed configs of the jitted steps ------------------------------------------------

class StepConfigs(NamedTuple):
    """The static configs the jitted steps close over, built by :func:`step_configs`."""

    trust_region: trust_region.TrustRegionConfig
    policy_loss: PolicyLossConfig
    rl_optimizer: OptimizerConfig
    sft_optimizer: OptimizerConfig


def _as_float(field: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{field} = {value!r}: must be a number")
    return float(value)


def step_configs(config: ml_collections.ConfigDict, *, max_response_length: Optional[int] = None) -> StepConfigs:
    """The run config's trust region, policy loss and optimizers as typed, static configs.

    Args:
      config: a run config (``pdm_jax.config`` schema).
      max_response_length: tokens, the Dr. GRPO normaliser; default ``rl.max_new_tokens``.

    Raises:
      ValueError: a bad field, named by its dotted path (``trust_region.delta = -1.0: ...``).
    """
    tr, rl, sft = config.trust_region, config.rl, config.sft
    floats = {name: _as_float(f"trust_region.{name}", tr[name])
              for name in ("delta", "delta_low", "delta_high", "clip_eps_low", "clip_eps_high")}
    try:
        tr_config = trust_region.TrustRegionConfig(mask=tr.mask, divergence=tr.divergence, estimator=tr.estimator,
                                                   nonfinite=tr.nonfinite,
                                                   direction=tr.direction, **floats)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("trust_region.") else f"trust_region: {msg}") from None
    loss_config = PolicyLossConfig(
        policy_loss=rl.policy_loss, tis_cap=_as_float("rl.tis_cap", rl.tis_cap), clip_eps_low=floats["clip_eps_low"],
        clip_eps_high=floats["clip_eps_high"], dual_clip=_as_float("rl.dual_clip", rl.dual_clip),
        loss_aggregation=rl.loss_aggregation,
        max_response_length=int(max_response_length or rl.max_new_tokens), kl_beta=_as_float("rl.kl_beta", rl.kl_beta),
        kl_estimator=rl.kl_estimator, temperature=_as_float("rl.temperature", rl.temperature),
        logits_chunk_size=rl.logits_chunk_size, micro_batch_size=rl.micro_batch_size,
        router_aux_loss_coef=_as_float("rl.router_aux_loss_coef", rl.router_aux_loss_coef),
        pack_sequences=rl.pack_sequences)
    rl_opt = OptimizerConfig(learning_rate=rl.learning_rate, weight_decay=rl.weight_decay, b1=rl.adam_b1,
                             b2=rl.adam_b2, max_grad_norm=rl.max_grad_norm, warmup_steps=rl.warmup_steps,
                             lr_schedule=rl.lr_schedule,
                             total_steps=rl.steps * rl.num_iterations * rl.num_minibatches)
    sft_opt = OptimizerConfig(learning_rate=sft.learning_rate, warmup_steps=sft.warmup_steps,
                              max_grad_norm=rl.max_grad_norm, lr_schedule=sft.lr_schedule, total_steps=sft.steps)
    return StepConfigs(tr_config, loss_config, rl_opt, sft_opt)
