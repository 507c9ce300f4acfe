"""bench/device_check.py at tiny shapes on CPU (``--tiny``), so the device script does not rot: its figures
follow from its own timings by the formulas its docstring states."""

import dataclasses
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_device_check_tiny_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "bench", "device_check.py"))
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    out = dc.main(["--tiny", "--sizes", "0.6b", "--chip", "H100", "--json", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists() and out["tiny"] and out["chip"] == "H100"
    r = out["sizes"]["0.6b"]
    train, decode = r["train"], r["decode"]
    assert train["tokens_per_s"] == pytest.approx(2 * (8 + 16) / train["step_s"])
    assert 0 < train["mfu"] < 1 and train["dry_run_analytic_gib"] > 0
    cfg = dataclasses.replace(dc.get_preset("qwen3_0p6b"), **dc.TINY)
    from pdm_jax.models.presets import count_params

    # the floor: bf16 weights + a bf16 cache of 4 slots x 24 positions x 2 (k, v) x kv heads x head_dim per layer
    cache = 4 * 24 * 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * 2
    assert decode["floor_bytes"] == pytest.approx(count_params(cfg) * 2 + cache, rel=0.01)
    assert decode["floor_s"] == pytest.approx(decode["floor_bytes"] / 3.35e12)
    assert decode["tokens_per_s"] == pytest.approx(4 / decode["step_s"])
