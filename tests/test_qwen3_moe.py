"""Qwen3-MoE: config, the sparse MoE block (ragged_dot vs dense one-hot reference), the
router load-balancing loss (vs a numpy re-implementation of transformers'
``load_balancing_loss_func`` and, with torch, that function itself), HF I/O and parity
with the committed transformers reference (``scripts/make_qwen3_moe_reference.py``)."""
import dataclasses

import numpy as np
import pytest

from pdm_jax.models.qwen3 import Qwen3Config

TINY_MOE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12)


def _hf_moe_dict(**overrides):
    d = Qwen3Config(**TINY_MOE).to_hf_dict()
    d.update(overrides)
    return d


# ------------------------------------------------------------------------------ config


def test_config_round_trip_and_hf_names():
    cfg = Qwen3Config(**TINY_MOE, norm_topk_prob=True, router_aux_loss_coef=0.01)
    d = cfg.to_hf_dict()
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert Qwen3Config.from_hf_dict(d) == cfg and cfg.is_moe
    # transformers 5 writes the expert count as num_local_experts (its attribute_map).
    d2 = dict(d)
    d2["num_local_experts"] = d2.pop("num_experts")
    assert Qwen3Config.from_hf_dict(d2) == cfg
    # Absent MoE fields take Qwen3MoeConfig's defaults.
    d3 = {k: v for k, v in d.items() if k not in ("router_aux_loss_coef", "norm_topk_prob",
                                                   "mlp_only_layers", "decoder_sparse_step")}
    got = Qwen3Config.from_hf_dict(d3)
    assert (got.router_aux_loss_coef, got.norm_topk_prob, got.mlp_only_layers,
            got.decoder_sparse_step) == (0.001, False, (), 1)
    # The dense model is unchanged: num_experts 0, model_type qwen3.
    dense = Qwen3Config(**{**TINY_MOE, "num_experts": 0})
    assert not dense.is_moe and dense.to_hf_dict()["model_type"] == "qwen3"
    assert "num_experts" not in dense.to_hf_dict()


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", -1, "num_experts"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
    ("num_experts_per_tok", 5, "num_experts_per_tok must be <= num_experts = 4"),
    ("moe_intermediate_size", 0, "moe_intermediate_size"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
    ("norm_topk_prob", 1, "norm_topk_prob"),
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef"),
    ("router_aux_loss_coef", float("nan"), "router_aux_loss_coef"),
    ("mlp_only_layers", [2], "mlp_only_layers"),
    ("mlp_only_layers", [0, 0], "mlp_only_layers"),
    ("mlp_only_layers", [0], r"layers \[0\] dense and \[1\] sparse"),
    ("decoder_sparse_step", 2, r"layers \[0\] dense and \[1\] sparse"),
])
def test_config_bad_moe_fields_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf_dict(_hf_moe_dict(**{field: value}))


def test_config_all_dense_moe_family_and_errors():
    # Every layer in mlp_only_layers: a dense model (the MoE fields unused).
    cfg = Qwen3Config.from_hf_dict(_hf_moe_dict(mlp_only_layers=[0, 1]))
    assert not cfg.is_moe and not any(cfg.is_sparse_layer(i) for i in range(2))
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(model_type="qwen3"))
    with pytest.raises(ValueError, match="num_local_experts"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(num_local_experts=8))
    with pytest.raises(ValueError, match="model_type"):
        Qwen3Config.from_hf_dict(_hf_moe_dict(model_type="qwen2_moe"))
    assert dataclasses.replace(Qwen3Config(**TINY_MOE), mlp_only_layers=[]).mlp_only_layers == ()
