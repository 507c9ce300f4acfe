"""`pdm_jax.analysis.run`: one seed of the token-level analysis."""

import pytest


def test_run_seed_refuses_an_unfinished_warmstart(tmp_path):
    from pdm_jax.analysis.run import run_seed

    (tmp_path / "warm").mkdir()
    with pytest.raises(ValueError, match="warmstart=.*no summary.json"):
        run_seed(None, str(tmp_path / "wd"), warmstart=str(tmp_path / "warm"))
