"""`pdm_jax.analysis.run`: one seed of the token-level analysis."""

import pytest


def test_run_seed_refuses_an_unfinished_warmstart(tmp_path):
    from pdm_jax.analysis.run import run_seed

    (tmp_path / "warm").mkdir()
    with pytest.raises(ValueError, match="warmstart=.*no summary.json"):
        run_seed(None, str(tmp_path / "wd"), warmstart=str(tmp_path / "warm"))


def test_saved_seeds_read_back_whole_and_a_flipped_bit_is_refused_by_name(tmp_path):
    """`load_seeds` gives back what `save_seed` wrote; one bit flipped in the arrays is refused naming the file
    (the zip's CRC-32), not read as other token figures nor raised as a bare BadZipFile."""
    import numpy as np

    from pdm_jax.analysis.run import load_seeds, save_seed

    rng = np.random.default_rng(0)
    records = {"mu_tail": rng.standard_normal(4096).astype(np.float32), "step": np.arange(4096, dtype=np.int32)}
    save_seed(str(tmp_path), 3, dict(records=records, steps=[], fidelity={}, summary={}, seconds=1.0), {})
    [got] = load_seeds(str(tmp_path))
    assert got["seed"] == 3 and all(np.array_equal(got["records"][k], v) for k, v in records.items())
    npz = tmp_path / "seed_003.npz"
    data = bytearray(npz.read_bytes())
    data[len(data) // 3] ^= 0x10
    npz.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"saved seed \S*seed_003.json / seed_003.npz: unreadable or corrupted "
                                         r"\(BadZipFile: Bad CRC-32"):
        load_seeds(str(tmp_path))
