"""pdm_jax.sampler.sampling: the distribution tokens are drawn from (the engine-level checks of log mu, top-k
and top-p against independent references are in tests/test_sampler_engine.py)."""
import jax
import jax.numpy as jnp
import numpy as np

from pdm_jax.sampler.sampling import bucket, next_pow2, sampling_distribution


def test_buckets():
    """Powers of two, clipped to the bucket's range."""
    assert [next_pow2(x) for x in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert bucket(3, 8, 64) == 8 and bucket(9, 8, 64) == 16 and bucket(100, 8, 64) == 64


def test_sampling_distribution_matches_empirical_frequencies():
    """jax.random.categorical on log mu draws with frequencies mu (chi-square-free bound on 4000 draws)."""
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    lmu = sampling_distribution(logits, jnp.array([0.7]), jnp.array([1.0]), jnp.array([0]))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: jax.random.categorical(k, lmu[0]))(keys))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, np.exp(np.asarray(lmu[0])), atol=0.03)
