"""pdm_jax.models: Flax NNX Qwen3 (dense and MoE), presets, HF safetensors I/O, attention kernels."""
from pdm_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from pdm_jax.models.attention import AttentionOptions, SelfAttentionMask
from pdm_jax.models.hf_io import from_pretrained, load_config, save_pretrained
from pdm_jax.models.presets import PRESETS, count_params, get_preset
from pdm_jax.models.qwen3 import (
    REMAT_POLICIES,
    KVCache,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    default_positions,
    init_model,
)

__all__ = ["ATTENTION_IMPLEMENTATIONS", "PRESETS", "REMAT_POLICIES", "AttentionOptions", "KVCache",
           "Qwen3Config", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SelfAttentionMask", "count_params",
           "default_positions", "from_pretrained", "get_preset", "init_model", "load_config",
           "save_pretrained"]
