"""`pdm_jax.rl.loss`: the per-token policy loss and the trainer's aggregated loss and ratio metrics.

The objectives it combines (TIS, PPO-clip, KL, aggregation) are checked in tests/test_objectives.py.
"""

import jax.numpy as jnp
import numpy as np

from pdm_jax.rl import loss as pl


def test_policy_loss_and_metrics_values():
    """The trainer's aggregated loss and its ratio metrics (pdm_jax.rl.loss) against hand-computed values."""
    logp = jnp.log(jnp.asarray([[0.5, 0.5, 0.2]]))
    blp = jnp.log(jnp.asarray([[0.25, 0.5, 0.4]]))  # r = 2, 1, 0.5
    adv = jnp.asarray([1.0])
    trust = jnp.asarray([[True, False, True]])
    valid = jnp.ones((1, 3), bool)

    def loss_and_metrics(policy_loss, mask, **kw):
        config = pl.PolicyLossConfig(policy_loss=policy_loss, tis_cap=1.5, **kw)
        per_token, kl = pl.per_token_policy_loss(logp, blp, adv, mask, valid, config)
        terms = dict(per_token=per_token, logprobs=logp, kl=kl, entropy=jnp.zeros_like(logp),
                     stats=dict(mean_divergence=jnp.float32(0.0)))
        return pl.loss_and_metrics(terms, valid, blp, adv, config)

    loss, m = loss_and_metrics("tis", trust)
    expected = -(1.5 * np.log(0.5) + 0.5 * np.log(0.2)) / 3  # token mean over 3 valid tokens
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(m["frac_tis_capped"], 1 / 3, rtol=1e-6)  # r = 2 > C = 1.5
    np.testing.assert_allclose(m["mean_ratio"], 3.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["mean_abs_log_ratio"], (2 * np.log(2)) / 3, rtol=1e-6)
    _, m = loss_and_metrics("ppo_clip", valid, clip_eps_low=0.2, clip_eps_high=0.28)
    np.testing.assert_allclose(m["frac_clipped"], 1 / 3, rtol=1e-6)  # r=2 with A>0
