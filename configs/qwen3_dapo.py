"""Qwen3-0.6B/1.7B/4B/8B GRPO + PDM on DAPO-Math-17k (paper-family settings), for the slice you rent.

Point it at local files (nothing is downloaded at run time)::

  python -m pdm_jax.train --config=configs/qwen3_dapo.py:size=8b,hf_path=/ckpt/Qwen3-8B-Base,data_path=/data/dapo-math-17k.parquet,eval_path=/data/aime24.parquet --workdir=runs/qwen3_8b

``size`` (``0.6b`` | ``1.7b`` | ``4b`` | ``8b``, default ``8b``) picks the model size: it sets the
default ``hf_path`` (``checkpoints/Qwen3-8B-Base``, ...), which also names the architecture for
``--dry_run`` when the directory does not exist. The recipe is the same for every size.

``slice`` (``v5e-8`` | ``v6e-8`` | ``v5p-8`` | ``v5p-128`` | ``8xH100`` | ``1xH100``, default ``v5p-128``;
`pdm_jax.aot.SLICES`) sets the dry run's target (``dry_run.chip``, ``dry_run.num_devices``) and the memory
knobs for it (`SLICE_KNOBS`: micro-batch, loss chunk, remat, the rollout engine's mesh, slots and prefill chunk;
nothing parked): what ``--dry_run --config.dry_run.fit=true`` proposes for that slice (tests/test_dry_run_fit.py keeps
them in step). What a step means (128 prompts x 8 samples, 2k + 8k tokens, delta, K, lr) is the recipe's on
every slice: no slice changes it. Where the recipe does not fit a slice at all (`DOES_NOT_FIT`) the config
keeps the recipe's knobs and the dry run says which part does not fit; docs/scaling.md has the grid.

Any field can be overridden in the argument string (delta=0.1,estimator=uniform_tail)
or with --config.<field>=value.

``smoke=True`` runs the recipe at a size one host runs in minutes, CPU included (`one_host_smoke`): one
device's sampler, 2 RL steps of 4 prompts x 4 samples, 16-token responses, the repository's DAPO-Math fixture
as the default data. With the stand-in checkpoint (the real architecture and tokenizer at toy size)::

  python -m pdm_jax.models.stand_in --out=runs/qwen3_stand_in
  python -m pdm_jax.train --config=configs/qwen3_dapo.py:smoke=True,hf_path=runs/qwen3_stand_in \\
    --workdir=runs/qwen3_smoke
"""

import os

from pdm_jax.aot import chips_per_host, slice_target
from pdm_jax.config import apply_arg, get_base_config, parse_arg

#: ``size`` argument -> default local Hugging Face checkpoint directory.
DEFAULT_HF_PATHS = {"0.6b": "checkpoints/Qwen3-0.6B-Base", "1.7b": "checkpoints/Qwen3-1.7B-Base",
                    "4b": "checkpoints/Qwen3-4B-Base", "8b": "checkpoints/Qwen3-8B-Base"}
DEFAULT_SIZE = "8b"
DEFAULT_SLICE = "v5p-128"  # the recipe as written: 64 x v5p, compiled by XLA:TPU (docs/scaling.md)

#: (size, slice) -> (rl.micro_batch_size, rl.logits_chunk_size, model.remat, sampler.mesh.tensor,
#: sampler.max_batch_size, sampler.prefill_chunk) with sampler.mesh.data 1, sampler.max_slots 0 and sampler.park_rows 0:
#: the settings with the most work per step that fit the slice by the dry run's analytic plan within 90% of HBM
#: (`pdm_jax.dry_run_fit.propose`; the per-device GiB it counts in the comments). v5p-128 is the recipe as
#: written (micro-batches of 64, the configuration XLA:TPU compiled); there the fit proposes the whole mini-batch
#: at once (0), which the analytic plan fits as well but no compiler has checked.
SLICE_KNOBS = {
    ("0.6b", "v5e-8"): (32, 512, "full", 4, 16, 16),  # 13.68 GiB of 16
    ("0.6b", "v6e-8"): (64, 512, "full", 4, 64, 16),  # 28.72 of 32
    ("0.6b", "v5p-8"): (128, 256, "full", 4, 128, 0),  # 77.34 of 95
    ("0.6b", "8xH100"): (0, 128, "full", 8, 256, 0),  # 64.11 of 80; XLA:GPU: 56.14, fits
    ("0.6b", "1xH100"): (16, 512, "full", 1, 16, 16),  # 70.92 of 80
    ("1.7b", "v5e-8"): (16, 512, "full", 4, 16, 8),  # 13.78 of 16; XLA:TPU: 14.68, fits (docs/scaling.md)
    ("1.7b", "v6e-8"): (32, 512, "full", 4, 32, 32),  # 24.15 of 32
    ("1.7b", "v5p-8"): (64, 512, "full", 4, 128, 0),  # 81.01 of 95
    ("1.7b", "8xH100"): (128, 512, "full", 8, 256, 0),  # 70.99 of 80; XLA:GPU: 57.98, fits
    ("1.7b", "1xH100"): (8, 512, "full", 1, 16, 2),  # 71.58 of 80
    ("4b", "v6e-8"): (16, 512, "full", 4, 32, 8),  # 27.94 of 32; XLA:TPU: 27.45, fits
    ("4b", "v5p-8"): (32, 512, "full", 4, 128, 32),  # 84.51 of 95
    ("4b", "8xH100"): (64, 512, "full", 8, 128, 0),  # 66.91 of 80; XLA:GPU: 48.17, fits
    ("8b", "v5p-8"): (16, 512, "full", 4, 64, 32),  # 75.60 of 95
    ("8b", "8xH100"): (32, 512, "full", 8, 128, 64),  # 57.71 of 80; XLA:GPU: 49.77, fits
}
#: (size, slice) -> the part that does not fit (the analytic plan's, per chip; `dry_run_fit.NothingFits`).
DOES_NOT_FIT = {
    ("4b", "v5e-8"): "at the smallest setting the parts need 17.18 GiB of 16 (the train step's transient "
                     "buffers 9.64); smallest slice that fits: v6e-8",
    ("4b", "1xH100"): "weights + AdamW state + gradients need 74.92 GiB of 80 (72 with the fit's headroom); "
                      "smallest slice that fits: v6e-8",
    ("8b", "v5e-8"): "weights + AdamW state + gradients need 19.08 GiB of 16; smallest slice that fits: v5p-8",
    ("8b", "v6e-8"): "at the smallest setting the parts need 31.87 GiB of 32 (28.8 with the fit's "
                     "headroom); smallest slice that fits: v5p-8",
    ("8b", "1xH100"): "weights + AdamW state + gradients need 152.56 GiB of 80; smallest slice that fits: v5p-8",
}


def apply_slice(c, size: str, slice_name: str):
    """Sets ``c``'s dry-run target to the slice and its memory knobs to `SLICE_KNOBS` (in place; returns ``c``).

    ``v5p-128`` and the cells of `DOES_NOT_FIT` keep the recipe's knobs (the latter's dry run says which
    part does not fit), the engine's tensor axis at most a host's chips.

    Raises:
      ValueError: ``slice_name`` is not a slice of `pdm_jax.aot.SLICES` (naming ``slice`` and the valid values).
    """
    chip, n = c.dry_run.chip, c.dry_run.num_devices = slice_target(slice_name)
    # a colocated engine's mesh on one host's chips (the 1-GPU slice has 1): the dry run can then say what does not fit
    c.sampler.mesh.tensor = min(c.sampler.mesh.tensor, chips_per_host(chip, n))
    knobs = SLICE_KNOBS.get((size, slice_name))
    if knobs is not None:
        micro, chunk, remat, tensor, slots, prefill = knobs
        c.rl.micro_batch_size, c.rl.logits_chunk_size, c.model.remat = micro, chunk, remat
        c.sampler.mesh.data, c.sampler.mesh.tensor = 1, tensor
        c.sampler.max_batch_size, c.sampler.max_slots, c.sampler.park_rows = slots, 0, 0
        c.sampler.prefill_chunk = prefill
    return c


def dapo_recipe(hf_path: str, data_path: str, eval_path: str):
    """The paper-family Qwen3 DAPO-Math run config, pointing at LOCAL checkpoint and data paths.

    Values follow DESIGN.md and the DPPO paper (arXiv 2602.04879) as summarised in
    issue 5: lr 1e-6, 128 prompts x 8 samples per step, mini-batches of 32 prompts
    (4 optimizer steps per rollout batch), K = 20, top-K KL trust region with
    delta = 0.05, truncated IS with C = 5, temperature 1.0, long responses, no KL
    penalty, no std normalisation of advantages, token-mean aggregation (DAPO).
    Fields that equal a base default are still written out: they are the recipe.
    """
    c = get_base_config()
    c.model.hf_path = hf_path
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    # Memory for 2k + 8k-token sequences on a pod (python -m pdm_jax.train --config=configs/qwen3_dapo.py --dry_run):
    c.model.attention = "auto"  # splash on TPU, cuDNN on GPU: no [T,T] probabilities
    c.model.remat = "full"  # each layer keeps only its input for the backward pass
    c.tokenizer.kind = "path"
    c.tokenizer.path = hf_path  # HF checkpoints ship tokenizer.json
    c.data.kind = "dapo_math"
    c.data.prompt_format = "question"
    c.data.path = data_path  # local DAPO-Math-17k parquet/jsonl (schema: prompt, reward_model.ground_truth, ...)
    c.data.eval_path = eval_path
    c.data.num_eval = 30  # AIME-24's 30 problems (at most the eval file's distinct prompts)
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
    c.rl.logits_chunk_size = 512  # never all [B,T,V] logits (V = 151,936)
    c.rl.micro_batch_size = 64  # 256-sequence mini-batches in 4 micro-batches (1 sequence per chip on 64 chips)
    c.trust_region.mask = "pdm"
    c.trust_region.divergence = "topk_kl"
    c.trust_region.estimator = "bucket_exact"
    c.trust_region.delta = 0.05
    c.sampler.quantization = "fp8"
    c.sampler.stop_token_ids = "151645,151643"  # <|im_end|>, <|endoftext|>: Qwen3 ends a turn on either
    c.sampler.max_prompt_length = 2048
    # The colocated rollout engine, per host (`--dry_run --config.dry_run.compiler=tpu` checks it):
    # each of the slice's 16 hosts samples the groups its chips train on (sampler.per_host_rollouts: 128 prompts x 8
    # samples / 16 = 64 rows), on its own 4 chips (a host's local devices, as the trainer requires), heads and
    # the KV cache split 4 ways (tensor 4 divides Qwen3's 8 / 4 kv heads); 64 slots hold a host's whole request,
    # so no row waits and nothing is parked (park_rows 0 keeps the park's cache out of HBM).
    c.sampler.mesh.data = 1
    c.sampler.mesh.tensor = 4
    c.sampler.max_batch_size = 64
    c.sampler.park_rows = 0
    c.eval.every_steps = 25
    c.eval.num_prompts = 30  # AIME-24
    c.eval.samples_per_prompt = 16  # avg@16
    # Evaluation samples with the rollout engine (the fp8 copy the dry run plans), not a second f32 copy of the
    # model on every chip (eval.engine = f32 would add one; the dry run counts it, docs/scaling.md).
    c.eval.engine = "rollout"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.dry_run.num_devices = 64  # the pod the defaults are sized for: 64 x v5p (dry_run.chip)
    c.checkpoint.every_steps = 10
    return c


#: ``smoke=True``'s default data_path and eval_path: the repository's 6-problem DAPO-Math fixture.
SMOKE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "fixtures",
                          "dapo_math_tiny.parquet")


def one_host_smoke(c):
    """The recipe `c` at a size one host runs in minutes (a CPU included), everything else kept (chat prompts,
    bf16 compute over f32 masters, the chunked loss, micro-batches, the fp8 sampler, the PDM mask, evaluation with
    the rollout engine): a smoke test of a checkpoint, its tokenizer and the data before a pod run, not training.

    The knobs that tie the recipe to a 64-chip pod are set for one host: the sampler on one device
    (``sampler.mesh`` 1 x 1, whatever the model's kv heads), colocated with the trainer, whose FSDP spans the
    host's devices; 2 RL steps of 4 prompts x 4 samples in 2 mini-batches of 2 micro-batches; 16-token responses
    and prompts up to 256 tokens; 2 held-out prompts x 2 samples, evaluated and checkpointed every step.
    """
    c.rl.steps = 2
    c.rl.prompts_per_step, c.rl.group_size, c.rl.num_minibatches = 4, 4, 2  # 8 rows per optimizer step
    c.rl.micro_batch_size = 4
    c.rl.max_new_tokens = 16
    c.rl.logits_chunk_size = 8
    c.sampler.max_prompt_length = 256
    c.sampler.max_batch_size = 16
    c.sampler.mode = "colocated"
    c.sampler.mesh.data = 1
    c.sampler.mesh.tensor = 1
    c.data.num_eval = c.eval.num_prompts = 2
    c.eval.samples_per_prompt = 2
    c.eval.every_steps = 1
    c.checkpoint.every_steps = 1
    c.dry_run.num_devices = 1
    return c


def get_config(arg=None):
    """Returns the Qwen3 DAPO config of ``size`` (`DEFAULT_HF_PATHS`) for ``slice`` (`apply_slice`); other
    argument items go through `apply_arg`.

    ``smoke=True`` (this file's own argument, as ``size``): `one_host_smoke`, with `SMOKE_DATA` as the default
    data_path and eval_path.

    Raises:
      ValueError: ``size`` is not one of `DEFAULT_HF_PATHS`, ``slice`` not one of `pdm_jax.aot.SLICES`, ``smoke``
        is not a boolean, or (from `apply_arg`) an item names an unknown field or does not parse.
    """
    args = parse_arg(arg)
    size = args.get("size", DEFAULT_SIZE)
    if size not in DEFAULT_HF_PATHS:
        raise ValueError(f"config argument 'size' must be one of {sorted(DEFAULT_HF_PATHS)}, got {size!r}")
    smoke = args.get("smoke", "false").strip().lower()
    if smoke not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"config argument 'smoke' must be true or false, got {args['smoke']!r}")
    smoke = smoke in ("true", "1", "yes")
    c = dapo_recipe(
        hf_path=args.get("hf_path", DEFAULT_HF_PATHS[size]),
        data_path=args.get("data_path", SMOKE_DATA if smoke else "data/dapo-math-17k.parquet"),
        eval_path=args.get("eval_path", SMOKE_DATA if smoke else ""),
    )
    apply_slice(c, size, args.get("slice", DEFAULT_SLICE))
    if smoke:  # after the slice: one host, whatever the slice
        one_host_smoke(c)
    # `size`, `slice` and `smoke` are this file's own arguments (not config fields): every other item, unchanged and
    # in order.
    rest = [item for item in (arg or "").split(",") if item.split("=", 1)[0].strip() not in ("size", "slice", "smoke")]
    return apply_arg(c, ",".join(rest))
