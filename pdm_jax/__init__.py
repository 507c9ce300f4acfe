"""pdm_jax: predictive divergence masks for LLM RL (arXiv 2607.10848) in JAX/Flax NNX."""

__version__ = "0.1.0"
