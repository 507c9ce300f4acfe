"""Qwen3-4B GRPO + PDM on DAPO-Math-17k (paper-family settings; see pdm_jax.config.dapo_config).

Point it at local files (nothing is downloaded at run time)::

  python -m pdm_jax.train --config=configs/qwen3_4b_dapo.py:hf_path=/ckpt/Qwen3-4B-Base,data_path=/data/dapo-math-17k.parquet,eval_path=/data/aime24.parquet --workdir=runs/qwen3_4b

Any field can be overridden in the argument string (delta=0.1,estimator=uniform_tail)
or with --config.<field>=value.
"""

from pdm_jax.config import apply_arg, dapo_config, parse_arg


def get_config(arg=None):
    """Returns the Qwen3-4B DAPO config; hf_path/data_path/eval_path come from the argument string."""
    args = parse_arg(arg)
    c = dapo_config(
        hf_path=args.get("hf_path", "checkpoints/Qwen3-4B-Base"),
        data_path=args.get("data_path", "data/dapo-math-17k.parquet"),
        eval_path=args.get("eval_path", ""),
    )
    return apply_arg(c, arg)
