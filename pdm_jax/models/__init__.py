"""pdm_jax.models: Flax NNX Qwen3, presets, HF safetensors I/O."""
from pdm_jax.models.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM, default_positions

__all__ = ["KVCache", "Qwen3Config", "Qwen3ForCausalLM", "default_positions"]
