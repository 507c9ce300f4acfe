"""pdm_jax.models."""
