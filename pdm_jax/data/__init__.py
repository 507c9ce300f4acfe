"""pdm_jax.data."""
