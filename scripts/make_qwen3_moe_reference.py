"""Builds tiny random HF Qwen3-MoE checkpoints and reference outputs from transformers' PyTorch
``Qwen3MoeForCausalLM``.

Output (committed, so CI needs no torch): ``tests/data/qwen3_moe_reference/<case>/`` with
the ``save_pretrained`` directory (config.json + model.safetensors) and ``reference.npz``:

    input_ids      [B, T] int32
    attention_mask [B, T] int32   row 0 left padded, row 1 right padded, row 2 full
    position_ids   [B, T] int32   row 0 starts at 3, row 1 arange, row 2 = 100 + 2*arange
    logits         [B, T, V] float32 from transformers.Qwen3MoeForCausalLM (eager attention)
    aux_loss       []  float32   HF's load_balancing_loss_func over the router logits
                                 (output_router_logits=True, with the attention mask)

Cases: "hub_layout" is written by the default ``save_pretrained`` (the hub's per-expert
tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight``); "fused_layout" with
``save_original_format=False`` (transformers 5's fused ``mlp.experts.gate_up_proj`` /
``down_proj``); "sparse_step_2" (``decoder_sparse_step`` = 2) and "mlp_only_layers" mix
sparse and dense-MLP layers. Weights are re-drawn after HF init at O(1) scale so the routing is far
from uniform and the logits are O(1).

Usage: python scripts/make_qwen3_moe_reference.py [--out tests/data/qwen3_moe_reference]
Requires torch (``pip install torch==2.13.0``, in a separate virtualenv) and transformers.
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
    # GQA 4/2, 4 experts top-2 without renormalisation, untied, rope_theta 1e4.
    "hub_layout": dict(config=dict(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=False,
        rope_theta=10_000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
        save=dict()),
    # 6 experts top-2 with norm_topk_prob, MQA, tied, rope_theta 5e5, fused layout.
    "fused_layout": dict(config=dict(
        vocab_size=48, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
        save=dict(save_original_format=False)),
    # Mixed sparse/dense layers (issue 14): decoder_sparse_step = 2 makes layers 1, 3 sparse
    # and 0, 2 dense-MLP (width intermediate_size); hub layout, norm_topk_prob.
    "sparse_step_2": dict(config=dict(
        vocab_size=32, hidden_size=16, intermediate_size=12, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        decoder_sparse_step=2, rope_theta=20_000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6),
        save=dict()),
    # mlp_only_layers = [1]: layers 0, 2 sparse, 1 dense; fused layout, no renormalisation.
    "mlp_only_layers": dict(config=dict(
        vocab_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=False,
        mlp_only_layers=[1], rope_theta=10_000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-6),
        save=dict(save_original_format=False)),
}
BATCH, LENGTH = 3, 9


def build_model(case: dict, seed: int) -> transformers.Qwen3MoeForCausalLM:
    """HF model with O(1)-scale random weights (fixed seed)."""
    torch.manual_seed(seed)
    kwargs = dict(case)
    rope_theta = kwargs.pop("rope_theta")
    config = transformers.Qwen3MoeConfig(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=512, attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2 and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
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


def reference_outputs(model, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B,T,V] f32, aux_loss [] f32) of the HF model."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(inputs["input_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(inputs["attention_mask"], dtype=torch.long),
                    position_ids=torch.tensor(inputs["position_ids"], dtype=torch.long),
                    output_router_logits=True)
    return out.logits.float().numpy(), np.float32(out.aux_loss.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(
        os.path.dirname(__file__), "..", "tests", "data", "qwen3_moe_reference"))
    args = parser.parse_args()
    for i, (name, case) in enumerate(CASES.items()):
        out_dir = os.path.join(args.out, name)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        model = build_model(case["config"], seed=3000 + i)
        model.save_pretrained(out_dir, **case["save"])
        gen_cfg = os.path.join(out_dir, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)
        inputs = make_inputs(case["config"]["vocab_size"], seed=4000 + i)
        logits, aux_loss = reference_outputs(model, inputs)
        np.savez_compressed(os.path.join(out_dir, "reference.npz"), logits=logits,
                            aux_loss=aux_loss, **inputs)
        files = sorted(os.listdir(out_dir))
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
        print(f"{name}: {files} ({size} bytes), |logits| max {np.abs(logits).max():.3f}, "
              f"aux_loss {aux_loss:.6f}")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("Tiny random HF Qwen3-MoE checkpoints + reference logits and router aux loss,\n"
                "generated by `scripts/make_qwen3_moe_reference.py` with transformers "
                f"{transformers.__version__} and torch {torch.__version__} (CPU).\n"
                "hub_layout: per-expert tensors (default save_pretrained); fused_layout: "
                "save_original_format=False; sparse_step_2 (hub layout) and mlp_only_layers "
                "(fused layout): mixed sparse and dense-MLP layers.\nUsed by tests/test_models_moe.py; regenerate "
                "with that script.\n")
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
