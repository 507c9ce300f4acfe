"""pdm_jax.sampler."""
