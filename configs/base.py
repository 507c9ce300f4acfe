"""The base config (all defaults of pdm_jax.config), with `arg` overrides applied."""

from pdm_jax.config import apply_arg, get_base_config


def get_config(arg=None):
    """Returns the base ConfigDict with big_vision-style `arg` overrides ("delta=0.1,seed=2")."""
    return apply_arg(get_base_config(), arg)
