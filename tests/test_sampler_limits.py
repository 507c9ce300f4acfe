"""pdm_jax.sampler.limits: the bounds the run config checks without loading the engine."""
import pytest

from pdm_jax.sampler import limits


@pytest.mark.parametrize("token, words", [
    ("", "non-empty"), (None, "non-empty"), ("a b", "outside RFC 6750"), ("tök", "outside RFC 6750"),
    ("x\n", "outside RFC 6750"),
])
def test_token_problem_names_why_a_token_cannot_be_sent(token, words):
    problem = limits.token_problem(token)
    assert problem is not None and words in problem
    assert token is None or not token.strip() or token.strip() not in problem  # never echoes the token


def test_good_tokens_and_the_limits():
    assert limits.token_problem("abc-._~+/=XYZ019") is None
    assert limits.MAX_SEED == 2**63 - 1 and limits.MAX_INT32 == 2**31 - 1 and limits.MIN_TEMPERATURE == 1e-3
    assert limits.MAX_STOP_TOKEN_IDS == 8


class _Mesh:
    """A mesh's ``shape`` mapping, all `check_engine_mesh` reads."""

    def __init__(self, **shape):
        self.shape = shape


def test_engine_mesh_check_names_the_field_that_does_not_divide():
    from pdm_jax.models.qwen3 import Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    assert limits.check_engine_mesh(cfg, _Mesh(data=2, fsdp=1, tensor=2), max_batch_size=8, max_slots=4) == 2
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2 is not divisible by the mesh's tensor axis \(4\)"):
        limits.check_engine_mesh(cfg, _Mesh(data=1, fsdp=1, tensor=4), max_batch_size=8, max_slots=4)
    with pytest.raises(ValueError, match=r"max_slots = 6 is not divisible by the mesh's row shards \(data x fsdp"):
        limits.check_engine_mesh(cfg, _Mesh(data=2, fsdp=2, tensor=1), max_batch_size=8, max_slots=6)
    with pytest.raises(ValueError, match=r"lack \['tensor'\]"):
        limits.check_engine_mesh(cfg, _Mesh(data=1, fsdp=1), max_batch_size=8, max_slots=4)


def test_the_config_checks_the_sampler_without_importing_the_engine():
    """config.py's sampler checks come from this module (light: no model, no engine); source read, nothing run."""
    import ast
    import os

    import pdm_jax

    path = os.path.join(os.path.dirname(pdm_jax.__file__), "config.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "pdm_jax.sampler.limits" in imported
    assert not imported & {"pdm_jax.sampler.engine", "pdm_jax.sampler.wire", "pdm_jax.sampler.continuous_batching",
                           "pdm_jax.sampler.static_batching"}, imported
    limits_tree = ast.parse(open(limits.__file__, encoding="utf-8").read())
    top = {a.name if isinstance(n, ast.Import) else n.module for n in limits_tree.body
           if isinstance(n, (ast.Import, ast.ImportFrom)) for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert top <= {"__future__", "string", "typing"}, top  # JAX, the models and the engine: never at import
