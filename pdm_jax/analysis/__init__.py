"""pdm_jax.analysis."""
