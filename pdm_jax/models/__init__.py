"""pdm_jax.models: Flax NNX Qwen3, presets, HF safetensors I/O."""
from pdm_jax.models.hf_io import from_pretrained, load_config, save_pretrained
from pdm_jax.models.presets import PRESETS, count_params, get_preset
from pdm_jax.models.qwen3 import (KVCache, Qwen3Config, Qwen3ForCausalLM, default_positions,
                                   init_model)

__all__ = ["KVCache", "PRESETS", "Qwen3Config", "Qwen3ForCausalLM", "count_params",
           "default_positions", "from_pretrained", "get_preset", "init_model", "load_config",
           "save_pretrained"]
