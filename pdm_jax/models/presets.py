"""Published Qwen3 dense configurations (tunix-style names) and an allocation-free parameter count.

Values are those of the ``config.json`` files of the post-trained checkpoints ``Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}``
on the Hugging Face Hub (transformers 4.51 layout; all use ``vocab_size`` 151936, ``head_dim`` 128, 8 KV heads,
``rope_theta`` 1e6, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 40960; embeddings tied for 0.6B/1.7B/4B only),
cross-checked with Table 1 of the Qwen3 Technical Report (arXiv 2505.09388). The published totals on the model cards
(0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B; non-embedding 0.44B, 1.4B, 3.6B, 6.95B, 13.2B, 31.2B) are checked by
``tests/test_models_presets.py`` against ``count_params``.

Mixture-of-experts (Qwen3-MoE) presets, from the ``config.json`` of ``Qwen/Qwen3-30B-A3B`` and ``Qwen/Qwen3-235B-A22B``
(128 experts, 8 per token, ``norm_topk_prob`` true, every layer sparse, 4 KV heads, head_dim 128, untied): the model
cards' totals (30.5B total / 3.3B activated / 29.9B non-embedding; 235B / 22B) are checked by
``tests/test_models_presets.py`` against ``count_params`` (``active=True`` for the activated count). The 235B preset is
for shapes (dry runs, parameter counts) only: nothing here was run at that size.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

_COMMON = dict(vocab_size=151_936, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
               rope_theta=1_000_000.0, max_position_embeddings=40_960)


def qwen3_0p6b() -> Qwen3Config:
    """Qwen/Qwen3-0.6B: 28 layers, d=1024, ffn 3072, 16 q heads, tied embeddings."""
    return Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True, **_COMMON)


def qwen3_1p7b() -> Qwen3Config:
    """Qwen/Qwen3-1.7B: 28 layers, d=2048, ffn 6144, 16 q heads, tied embeddings."""
    return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True, **_COMMON)


def qwen3_4b() -> Qwen3Config:
    """Qwen/Qwen3-4B: 36 layers, d=2560, ffn 9728, 32 q heads, tied embeddings."""
    return Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, tie_word_embeddings=True, **_COMMON)


def qwen3_8b() -> Qwen3Config:
    """Qwen/Qwen3-8B: 36 layers, d=4096, ffn 12288, 32 q heads, untied."""
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, tie_word_embeddings=False, **_COMMON)


def qwen3_14b() -> Qwen3Config:
    """Qwen/Qwen3-14B: 40 layers, d=5120, ffn 17408, 40 q heads, untied."""
    return Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                       num_attention_heads=40, tie_word_embeddings=False, **_COMMON)


def qwen3_32b() -> Qwen3Config:
    """Qwen/Qwen3-32B: 64 layers, d=5120, ffn 25600, 64 q heads, untied."""
    return Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                       num_attention_heads=64, tie_word_embeddings=False, **_COMMON)


_MOE_COMMON = dict(_COMMON, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                   router_aux_loss_coef=0.001, tie_word_embeddings=False)


def qwen3_30b_a3b() -> Qwen3Config:
    """Qwen/Qwen3-30B-A3B: 48 layers, d=2048, 32 q heads, 128 experts of width 768, top-8."""
    return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                       num_attention_heads=32, moe_intermediate_size=768, **_MOE_COMMON)


def qwen3_235b_a22b() -> Qwen3Config:
    """Qwen/Qwen3-235B-A22B (shapes only): 94 layers, d=4096, 64 q heads, 128 experts of width 1536, top-8."""
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                       num_attention_heads=64, moe_intermediate_size=1536, **_MOE_COMMON)


PRESETS: dict[str, Callable[[], Qwen3Config]] = {
    "qwen3_0p6b": qwen3_0p6b,
    "qwen3_1p7b": qwen3_1p7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_8b": qwen3_8b,
    "qwen3_14b": qwen3_14b,
    "qwen3_32b": qwen3_32b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
}


def get_preset(name: str) -> Qwen3Config:
    """The preset config called ``name`` (e.g. "qwen3_8b"); ValueError listing valid names."""
    if name not in PRESETS:
        raise ValueError(f"unknown Qwen3 preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]()


def count_params(config: Qwen3Config, *, non_embedding: bool = False,
                 active: bool = False) -> int:
    """Number of parameters of ``Qwen3ForCausalLM(config)`` from abstract shapes.

    Uses ``nnx.eval_shape`` (no allocation). ``non_embedding=True`` excludes the input embedding table and the (untied)
    LM head, the convention of the Qwen3 model cards. ``active=True`` counts, of a MoE model's experts, only the
    ``num_experts_per_tok`` a token uses (the "activated" parameters of the Qwen3-MoE cards); same as the total for a
    dense model.
    """
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0),
                                                       dtype=jnp.bfloat16,
                                                       param_dtype=jnp.bfloat16))
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        if non_embedding and path[0] in ("embed_tokens", "lm_head"):
            continue
        n = math.prod(var.get_value().shape)
        if active and "experts" in path:
            n = n // config.num_experts * config.num_experts_per_tok
        total += n
    return int(total)


__all__ = ["PRESETS", "count_params", "get_preset", "qwen3_0p6b", "qwen3_1p7b", "qwen3_4b",
           "qwen3_8b", "qwen3_14b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b"]
