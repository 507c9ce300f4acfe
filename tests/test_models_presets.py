"""`pdm_jax.models.presets`: the Qwen3 and Qwen3-MoE presets against their model cards, and `count_params` in
closed form."""

import dataclasses

import pytest

from pdm_jax.models import presets
from conftest import TINY_DENSE


# Published totals / non-embedding counts (model cards of Qwen/Qwen3-*), in billions.
PUBLISHED = {
    "qwen3_0p6b": (0.6, 0.44), "qwen3_1p7b": (1.7, 1.4), "qwen3_4b": (4.0, 3.6),
    "qwen3_8b": (8.2, 6.95), "qwen3_14b": (14.8, 13.2), "qwen3_32b": (32.8, 31.2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_param_counts(name):
    config = presets.get_preset(name)
    total, non_emb = PUBLISHED[name]
    got_total = presets.count_params(config) / 1e9
    got_non_emb = presets.count_params(config, non_embedding=True) / 1e9
    # Model cards round to 2 significant digits ("1.7B" is 1.72B).
    assert abs(got_total - total) <= 0.03 * total, got_total
    assert abs(got_non_emb - non_emb) <= 0.03 * non_emb, got_non_emb


def test_count_params_closed_form():
    c = TINY_DENSE  # any config: the closed form holds for every shape
    D, F, N, K, H, V, L = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                           c.num_key_value_heads, c.head_dim, c.vocab_size, c.num_hidden_layers)
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F + 2 * D + 2 * H
    assert presets.count_params(c) == 2 * V * D + L * per_layer + D
    tied = dataclasses.replace(c, tie_word_embeddings=True)
    assert presets.count_params(tied) == V * D + L * per_layer + D
    assert presets.count_params(c, non_embedding=True) == L * per_layer + D


def test_get_preset_unknown():
    with pytest.raises(ValueError, match="qwen3_8b"):
        presets.get_preset("qwen3_7b")


@pytest.mark.parametrize("name,total,active,non_emb", [
    ("qwen3_30b_a3b", 30.5, 3.3, 29.9),     # Qwen/Qwen3-30B-A3B model card
    ("qwen3_235b_a22b", 235.0, 22.0, 234.0),  # Qwen/Qwen3-235B-A22B model card
])
def test_moe_preset_param_counts(name, total, active, non_emb):
    cfg = presets.get_preset(name)
    assert cfg.is_moe and cfg.num_experts == 128 and cfg.num_experts_per_tok == 8
    assert abs(presets.count_params(cfg) / 1e9 - total) / total < 0.01
    assert abs(presets.count_params(cfg, active=True) / 1e9 - active) / active < 0.03
    assert abs(presets.count_params(cfg, non_embedding=True) / 1e9 - non_emb) / non_emb < 0.01
    # Closed form for the 30B: per layer attention + router + 128 experts of 3 D x I kernels.
    if name == "qwen3_30b_a3b":
        D, I, L, V = 2048, 768, 48, 151_936  # noqa: E741 (I: the MLP's intermediate size)
        attn = D * 32 * 128 * 2 + D * 4 * 128 * 2 + 2 * 128
        per_layer = attn + D * 128 + 128 * 3 * D * I + 2 * D
        assert presets.count_params(cfg) == 2 * V * D + L * per_layer + D
