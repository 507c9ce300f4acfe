"""Qwen3-30B-A3B (mixture of experts) GRPO + PDM on DAPO-Math-17k: the paper's largest setting.

Point it at local files (nothing is downloaded at run time)::

  python -m pdm_jax.train --config=configs/qwen3_30b_a3b_dapo.py:hf_path=/ckpt/Qwen3-30B-A3B-Base,data_path=/data/dapo-math-17k.parquet,eval_path=/data/aime24.parquet --workdir=runs/qwen3_30b_a3b

and plan its memory first (no checkpoint needed: the default ``hf_path`` names the
``qwen3_30b_a3b`` preset)::

  python -m pdm_jax.train --config=configs/qwen3_30b_a3b_dapo.py --dry_run

The recipe is ``configs/qwen3_dapo.py``'s (lr 1e-6, 128 prompts x 8 samples, mini-batches
of 32 prompts, K = 20, top-K KL delta = 0.05, TIS C = 5, 2k + 8k tokens, fp8 sampler) on
the 30B-A3B checkpoint (128 experts, 8 per token; ``pdm_jax.models.presets.qwen3_30b_a3b``)
with the pod sized for it: 64 x v5p (a v5p-128 slice), FSDP over all 64 chips, which also
shards the experts (logical axis ``expert`` -> ``fsdp``: 2 whole experts of each layer per
chip). The router load-balancing loss is not added (RL:
``rl.router_aux_loss_coef`` = 0; the checkpoint's own ``router_aux_loss_coef`` is its pre-training value and is
not used). The sampler's fp8 copy of the expert kernels, routing replay
(``model.moe_routing_replay``) and the trainer's MoE metrics exist and run end to end on the
tiny MoE (``configs/tiny_moe.py``); this config itself has been compiled by XLA:TPU for
v5p:4x4x4 by the dry run (docs/scaling.md), never run on a device or end to end, and has no
stand-in test of its own (``tests/test_recipe.py`` runs ``configs/qwen3_dapo.py``'s).

``slice`` (default ``v5p-128``; `pdm_jax.aot.SLICES`) sets the dry run's target. The 30B-A3B recipe fits only
v5p-128 of those slices (`DOES_NOT_FIT`: the analytic plan's part that does not fit); there it keeps the
recipe's knobs, compiled by XLA:TPU.

Any field can be overridden in the argument string or with --config.<field>=value.
"""

import importlib.util
import os

from pdm_jax.config import apply_arg, parse_arg

DEFAULT_HF_PATH = "checkpoints/Qwen3-30B-A3B-Base"
#: slice -> the part that does not fit (the analytic plan's, per chip; `pdm_jax.dry_run_fit.NothingFits`);
#: the smallest slice of `pdm_jax.aot.SLICES` that fits is v5p-128.
DOES_NOT_FIT = {
    "v5e-8": "weights + AdamW state + gradients need 71.09 GiB of 16",
    "v6e-8": "weights + AdamW state + gradients need 71.09 GiB of 32",
    "v5p-8": "weights + AdamW state + gradients need 142.18 GiB of 95",
    "8xH100": "at the smallest setting the parts need 97.94 GiB of 80 (weights + AdamW state + batch 42.70)",
    "1xH100": "weights + AdamW state + gradients need 568.71 GiB of 80",
}


def _dapo_module():
    """The sibling ``configs/qwen3_dapo.py`` (configs/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_dapo.py")
    spec = importlib.util.spec_from_file_location("qwen3_dapo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_config(arg=None):
    """The Qwen3-30B-A3B DAPO config for ``slice`` (the dry run's target; the recipe's knobs); argument items
    (hf_path, data_path, eval_path, or any field) go through `apply_arg`.

    Raises:
      ValueError: ``slice`` is not one of `pdm_jax.aot.SLICES` (naming ``slice``), or (from `apply_arg`) an
        item names an unknown field or does not parse.
    """
    args = parse_arg(arg)
    dapo = _dapo_module()
    c = dapo.dapo_recipe(
        hf_path=args.get("hf_path", DEFAULT_HF_PATH),
        data_path=args.get("data_path", "data/dapo-math-17k.parquet"),
        eval_path=args.get("eval_path", ""),
    )
    c.dry_run.chip = "v5p"
    c.dry_run.num_devices = 64  # 64 v5p chips (v5p-128): 95 GiB HBM each
    dapo.apply_slice(c, "30b-a3b", args.get("slice", dapo.DEFAULT_SLICE))  # only the target: no SLICE_KNOBS cell
    # megablox on TPU (its grouped matmul does K/E of the dense work by construction; XLA:TPU's cost model counts
    # ragged_dot above the dense reference, pdm_jax.models.moe), blocked on GPUs (XLA:GPU expands ragged_dot E-fold),
    # ragged_dot on CPU.
    c.model.moe_implementation = "auto"
    rest = [item for item in (arg or "").split(",") if item.split("=", 1)[0].strip() != "slice"]
    return apply_arg(c, ",".join(rest))
