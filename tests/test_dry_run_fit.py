"""dry_run.fit (pdm_jax.dry_run_fit): the slice presets of configs/qwen3_dapo.py and configs/qwen3_30b_a3b_dapo.py
are the fit's proposals (analytic only), refusals name the part, and the step-time estimate's arithmetic."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from pdm_jax import aot, dry_run, dry_run_fit
from pdm_jax.run_spec import run_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3


def _module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DAPO = _module("qwen3_dapo")
MOE = _module("qwen3_30b_a3b_dapo")


def _need(reason: str) -> str:
    """"... need 19.08 GiB ..." of a DOES_NOT_FIT entry: the figure the fit's refusal must name."""
    return re.search(r"need [0-9.]+ GiB", reason).group(0)


@pytest.mark.parametrize("size", sorted(DAPO.DEFAULT_HF_PATHS))
def test_slice_presets_are_the_fits_proposals(size):
    for name, (chip, n) in aot.SLICES.items():
        c = DAPO.get_config(f"size={size},slice={name}")
        assert (c.dry_run.chip, c.dry_run.num_devices) == (chip, n)
        if (size, name) in DAPO.DOES_NOT_FIT:
            assert (size, name) not in DAPO.SLICE_KNOBS
            with pytest.raises(dry_run_fit.NothingFits, match="nothing fits") as e:
                dry_run_fit.propose(c)
            assert _need(DAPO.DOES_NOT_FIT[(size, name)]) in str(e.value)
            continue
        p = dry_run_fit.propose(c)
        assert p.total <= dry_run_fit.HEADROOM * aot.CHIP_HBM_GIB[chip] * GIB
        if name == "v5p-128":  # the recipe as written (compiled by XLA:TPU): it fits, the fit proposes at least as much
            assert (size, name) not in DAPO.SLICE_KNOBS
            assert p.overrides["sampler.max_batch_size"] == c.sampler.max_batch_size == 64
            assert p.overrides["rl.micro_batch_size"] in (0, 128, 256)  # >= the recipe's 64
            assert dry_run.plan(c, compiler="none")["verdict"]["fits"]
            continue
        micro, chunk, remat, tensor, slots, prefill = DAPO.SLICE_KNOBS[(size, name)]
        assert p.overrides == {"rl.micro_batch_size": micro, "rl.logits_chunk_size": chunk, "model.remat": remat,
                               "sampler.mesh.data": 1, "sampler.mesh.tensor": tensor,
                               "sampler.max_batch_size": slots, "sampler.max_slots": 0, "sampler.park_rows": 0,
                               "sampler.prefill_chunk": prefill}
        report = dry_run.plan(c, compiler="none")  # the preset, dry-run as a user would: fits
        assert report["verdict"]["fits"] and report["verdict"]["total"] <= p.total + 1


def test_30b_a3b_fits_only_v5p_128_and_refusals_name_the_part():
    for name in aot.SLICES:
        c = MOE.get_config(f"slice={name}")
        if name == "v5p-128":
            assert dry_run_fit.propose(c).total <= 0.9 * 95 * GIB
            continue
        with pytest.raises(dry_run_fit.NothingFits) as e:
            dry_run_fit.propose(c)
        assert _need(MOE.DOES_NOT_FIT[name]) in str(e.value)
    with pytest.raises(ValueError, match=r"weights \+ AdamW state \+ gradients need 19.08 GiB"):
        dry_run_fit.propose(DAPO.get_config("size=8b,slice=v5e-8"))
    assert dry_run_fit.smallest_fitting_slice(DAPO.get_config("size=8b,slice=v5e-8")) == "v5p-8"


def test_bad_slice_names_the_argument_and_values():
    for mod in (DAPO, MOE):
        with pytest.raises(ValueError, match=r"slice = 'v5e-9': must be one of \['v5e-8', 'v6e-8', 'v5p-8', "
                                             r"'v5p-128', '8xH100', '1xH100'\]"):
            mod.get_config("slice=v5e-9")
    assert DAPO.get_config().to_dict() == DAPO.get_config("slice=v5p-128").to_dict()


def test_engine_transient_counts_the_compaction():
    """weights + 1.5 x cache + the rollouts in and out: the 8B engine on v5p:4x4x4 (docs/scaling.md: XLA:TPU's gather
    37.97 GiB)."""
    c = DAPO.get_config("size=8b")
    spec = run_spec(c, dry_run=True)
    sp = dry_run.sampler_plan(spec, dry_run.resolve_model_config(spec), 64, "v5p")
    assert sp["kv_cache"] == 64 * 10240 * 36 * 2 * 8 * 128 * 2 // 4  # 22.50 GiB
    assert sp["transient"] == sp["kv_cache"] * 3 // 2 + 2 * sp["outputs"]  # the compaction is the engine's peak
    got = sp["total"] / GIB
    assert abs(got - 37.97) / 37.97 < 0.02, got


def test_step_time_estimate_arithmetic():
    """The estimate by hand for the 1.7B preset on 8 x H100: FLOPs at 989 TFLOP/s, decode bytes at 3.35 TB/s."""
    c = DAPO.get_config("size=1.7b,slice=8xH100")
    r = dry_run.plan(c, compiler="none")
    e, mf, sp = r["estimate"], r["model_flops"], r["sampler"]
    assert e["train_s"] == pytest.approx((mf["flops"] + mf["attention_flops"]) * 4 / 989e12)
    rows = 128 * 8  # one host: the whole step's request
    assert sp["slots"] == 256 and e["decode_steps"] == math.ceil(rows / 256) * 8192
    step_bytes = sp["weights"] + sp["kv_cache"] * (2048 + 4096) / 10240
    prefill = 2 * mf["active_params"] * 2048 * 128 / 8 / 989e12
    assert e["sample_s"] == pytest.approx(e["decode_steps"] * step_bytes / 3.35e12 + prefill)
    assert e["tokens_per_s_per_chip"] == pytest.approx(128 * 8 * 10240 / (e["train_s"] + e["sample_s"]) / 8)
    text = dry_run.format_report(r)
    assert "a LOWER BOUND, never measured" in text and "tokens/s per chip at most" in text


@pytest.mark.slow
def test_cli_fit_prints_overrides_and_refuses():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    flags = ["--dry_run", "--config.dry_run.fit=true", "--config.dry_run.compiler=none"]
    base = [sys.executable, "-m", "pdm_jax.train"]
    out = subprocess.run(base + ["--config=configs/qwen3_dapo.py:size=1.7b,slice=v5e-8"] + flags, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("--config.rl.micro_batch_size=16 --config.rl.logits_chunk_size=512 --config.model.remat=full "
            "--config.sampler.mesh.data=1 --config.sampler.mesh.tensor=4 --config.sampler.max_batch_size=16") \
        in out.stdout
    assert out.stdout.rstrip().endswith("fits")
    out = subprocess.run(base + ["--config=configs/qwen3_dapo.py:size=8b,slice=v6e-8"] + flags, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "nothing fits 8 x v6e" in out.stderr and "smallest slice that fits: v5p-8" \
        in out.stderr
