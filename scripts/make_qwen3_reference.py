"""Builds tiny random HF Qwen3 checkpoints and reference logits from transformers' PyTorch model.

Output (committed, so CI needs no torch): ``tests/data/qwen3_reference/<case>/``
with the HF ``save_pretrained`` directory (config.json + safetensors; the "sharded" case
uses HF's own sharding with ``model.safetensors.index.json``) and ``reference.npz``:

    input_ids      [B, T] int32
    attention_mask [B, T] int32   row 0 left padded, row 1 right padded, row 2 full
    position_ids   [B, T] int32   row 0 starts at 3, row 1 arange, row 2 = 100 + 2*arange
    logits         [B, T, V] float32 from transformers.Qwen3ForCausalLM (eager attention)

Weights are re-drawn after HF init so the logits are O(1) and attention is far from
uniform (HF's N(0, 0.02) init gives near-constant logits, a weak parity test).

Usage: python scripts/make_qwen3_reference.py [--out tests/data/qwen3_reference]
Requires torch (``pip install torch==2.13.0``) and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers

CASES = {
    # GQA (4 query heads, 2 kv heads), head_dim != hidden/heads, untied, rope_theta 1e4.
    "gqa_untied": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=10_000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
    # MQA (1 kv head), tied embeddings, rope_theta 5e5, larger eps.
    "mqa_tied": dict(vocab_size=80, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                     num_attention_heads=6, num_key_value_heads=1, head_dim=8,
                     rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # MHA, untied, default rope_theta 1e6; saved with HF sharding (index + several files).
    "sharded": dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                    rope_theta=1_000_000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
}
BATCH, LENGTH = 3, 9


def build_model(case: dict, seed: int) -> transformers.Qwen3ForCausalLM:
    """HF model with O(1)-scale random weights (fixed seed)."""
    torch.manual_seed(seed)
    kwargs = dict(case)
    rope_theta = kwargs.pop("rope_theta")
    config = transformers.Qwen3Config(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=512, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2 and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def make_inputs(vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    input_ids = rng.randint(0, vocab_size, size=(BATCH, LENGTH)).astype(np.int32)
    attention_mask = np.ones((BATCH, LENGTH), np.int32)
    attention_mask[0, :3] = 0  # left padding
    attention_mask[1, -2:] = 0  # right padding
    position_ids = np.zeros((BATCH, LENGTH), np.int32)
    position_ids[0, 3:] = 3 + np.arange(LENGTH - 3)
    position_ids[1] = np.arange(LENGTH)
    position_ids[2] = 100 + 2 * np.arange(LENGTH)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def reference_logits(model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(inputs["input_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(inputs["attention_mask"], dtype=torch.long),
                    position_ids=torch.tensor(inputs["position_ids"], dtype=torch.long))
    return out.logits.float().numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(
        os.path.dirname(__file__), "..", "tests", "data", "qwen3_reference"))
    args = parser.parse_args()
    for i, (name, case) in enumerate(CASES.items()):
        out_dir = os.path.join(args.out, name)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        model = build_model(case, seed=1000 + i)
        kwargs = {"max_shard_size": "8KB"} if name == "sharded" else {}
        model.save_pretrained(out_dir, **kwargs)
        gen_cfg = os.path.join(out_dir, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)
        inputs = make_inputs(case["vocab_size"], seed=2000 + i)
        logits = reference_logits(model, inputs)
        np.savez_compressed(os.path.join(out_dir, "reference.npz"), logits=logits, **inputs)
        files = sorted(os.listdir(out_dir))
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
        print(f"{name}: {files} ({size} bytes), |logits| max {np.abs(logits).max():.3f}")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("Tiny random HF Qwen3 checkpoints + reference logits, generated by\n"
                "`scripts/make_qwen3_reference.py` with transformers "
                f"{transformers.__version__} and torch {torch.__version__} (CPU).\n"
                "Used by tests/test_qwen3.py; regenerate with that script.\n")
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
