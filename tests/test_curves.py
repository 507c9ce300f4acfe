"""curves.png: reward raw + trailing mean, avg@k beside greedy, δ on the divergence panel, the run's mask as title."""

import numpy as np
import pytest

from pdm_jax.config import get_base_config
from pdm_jax.metrics import _trailing_mean, curves_figure, curves_title, plot_curves


def _records():
    rng = np.random.default_rng(0)
    recs = [dict(step=s, phase="eval", eval_accuracy=0.4 + 0.01 * s, eval_greedy_accuracy=0.5 + 0.01 * s,
                 eval_reward=0.3) for s in (0, 10, 20)]
    recs += [dict(step=s, phase="rl", reward=float(rng.random()), frac_masked=0.01, mean_topk_kl=1e-3 * s,
                  mean_divergence=0.02) for s in range(1, 21)]
    recs.append(dict(step=0, phase="sft", loss=1.0))  # other phases are ignored
    return recs


def test_trailing_mean_by_hand():
    np.testing.assert_allclose(_trailing_mean([1.0, 2.0, 3.0, 4.0], 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(_trailing_mean([3.0, 1.0], 1), [3.0, 1.0])


def test_title_names_the_mask_delta_and_estimator():
    c = get_base_config()
    c.trust_region.mask, c.trust_region.delta, c.trust_region.estimator = "pdm", 0.05, "aggregated_tail"
    assert curves_title(c.trust_region) == "mask pdm (top-K KL, δ = 0.05, estimator aggregated_tail)"
    c.trust_region.direction = "param_jvp"
    assert curves_title(c.trust_region) == "mask pdm (top-K KL, δ = 0.05, direction param_jvp)"
    c.trust_region.direction = "per_token"
    c.trust_region.mask, c.trust_region.delta_high = "dppo", 0.15
    assert curves_title(c.trust_region) == "mask dppo (top-K KL, δ = 0.05 (Â < 0) / 0.15 (Â > 0))"
    c.trust_region.mask, c.trust_region.clip_eps_high = "ppo", 0.28
    assert curves_title(c.trust_region) == "mask ppo (ε = 0.2/0.28)"
    c.trust_region.mask = "none"
    assert curves_title(c.trust_region) == "mask none"


def test_figure_has_delta_line_named_k_greedy_and_smoothed_reward(tmp_path):
    c = get_base_config()
    c.trust_region.mask, c.trust_region.delta, c.eval.samples_per_prompt = "pdm", 0.05, 4
    fig = curves_figure(_records(), c)
    try:
        assert "mask pdm" in fig._suptitle.get_text() and "δ = 0.05" in fig._suptitle.get_text()
        reward, acc, _, div = fig.axes
        labels = [ln.get_label() for ln in reward.lines]
        assert labels == ["per step", "mean of last 2"]  # 20 steps -> window 20 // 8 = 2
        assert reward.lines[0].get_alpha() == pytest.approx(0.3)
        raw = np.asarray(reward.lines[0].get_ydata())
        np.testing.assert_allclose(reward.lines[1].get_ydata()[1:], (raw[1:] + raw[:-1]) / 2)
        assert [ln.get_label() for ln in acc.lines] == ["avg@4", "greedy (τ = 0)"]
        assert list(acc.lines[1].get_xdata()) == [0, 10, 20]
        delta = [ln for ln in div.lines if ln.get_label() == "δ = 0.05"]
        assert len(delta) == 1 and list(delta[0].get_ydata()) == [0.05, 0.05]
        assert div.get_yscale() == "log"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    plot_curves(_records(), str(tmp_path / "curves.png"), spec=c)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # no spec: still drawn (no δ line, no title)
    plot_curves(_records(), str(tmp_path / "bare.png"))
    assert (tmp_path / "bare.png").stat().st_size > 10_000
