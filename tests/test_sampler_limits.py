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
