"""Dry-run memory planner: analytic numbers vs XLA's compiled memory_analysis; Qwen3-4B/8B tables
(``configs/qwen3_dapo.py`` with size=4b / size=8b); Qwen3-30B-A3B (``configs/qwen3_30b_a3b_dapo.py``) and the
MoE activation model."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from pdm_jax import dry_run
from pdm_jax.models import presets
from pdm_jax.models.presets import count_params, get_preset
from pdm_jax.run_spec import run_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name, arg=None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def _tiny_variants():
    plain = _config("tiny")  # data-parallel mesh over the 8 test devices, V = 15
    wide = _config("tiny")  # FSDP x tensor mesh, a 2048-token vocabulary, chunked loss
    wide.tokenizer.symbols = "".join(chr(0x4E00 + i) for i in range(2046))
    wide.sampler.max_prompt_length = 16
    wide.rl.max_new_tokens = 64
    wide.rl.prompts_per_step = 8
    wide.rl.logits_chunk_size = 16
    wide.mesh.data, wide.mesh.fsdp, wide.mesh.tensor = 1, 4, 2
    micro = _config("tiny")  # 128-sequence mini-batches in micro-batches of 32 (4 per device)
    micro.rl.micro_batch_size = 32
    for c in (plain, wide, micro):  # the analytic constants are calibrated on unrolled programs
        c.model.scan_layers = False
    # layers under lax.scan (the base default; configs/tiny.py unrolls), with and without remat
    scanned = _config("tiny")
    scanned_remat = _config("tiny")
    scanned_remat.model.remat = "full"
    for c in (scanned, scanned_remat):
        c.model.scan_layers = True
    return [("data_parallel", plain), ("fsdp_tensor_chunked", wide), ("micro_batched", micro),
            ("scanned", scanned), ("scanned_remat", scanned_remat)]


@pytest.mark.parametrize("name,config", _tiny_variants(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.slow
def test_planner_matches_compiled_memory_within_20_percent(name, config):
    report = dry_run.plan(config, compiler="cpu", num_devices=8)
    a, c = report["analytic"], report["compiled"]
    assert c is not None, report["compiled_note"]
    # Arguments = sharded params + AdamW moments + the batch: exact up to a few scalars.
    args = a["params"] + a["optimizer"] + a["batch"]
    assert abs(args - c["argument"]) <= 0.01 * c["argument"], (args, c)
    # Temporaries = gradients, gathered params, activations and the loss buffers.
    temp = a["gradients"] + a["gathered"] + a["activations"] + a["loss"]
    assert 0.8 * c["temp"] <= temp <= 1.2 * c["temp"], (temp, c)
    assert 0.8 * c["total"] <= a["total"] <= 1.2 * c["total"], (a, c)
    text = dry_run.format_report(report)
    assert "COMPILED" in text and "ANALYTIC" in text and "v5p" in text


def test_micro_batches_shrink_the_activations():
    plain, micro = _config("tiny"), _config("tiny")
    micro.rl.micro_batch_size = 32
    a = dry_run.plan(plain, compiler="none", num_devices=8)["analytic"]
    b = dry_run.plan(micro, compiler="none", num_devices=8)["analytic"]
    assert b["activations"] < 0.3 * a["activations"] and b["loss"] == a["loss"] // 4
    assert b["gradients"] == 2 * a["gradients"]  # the micro-batch scan's gradient accumulator


def test_qwen3_8b_cli_dry_run_prints_memory_table():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "pdm_jax.train", "--config=configs/qwen3_dapo.py:size=8b", "--dry_run",
         "--config.dry_run.chip=H200", "--config.dry_run.num_devices=64", "--config.rl.logits_chunk_size=512"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "8.191B-parameter" in text and "fsdp=64" in text and "H200 (141 GiB HBM each)" in text
    for row in ("params", "optimizer", "gradients", "activations", "loss", "total", "fits in HBM?"):
        assert row in text
    assert "not compiled" in text and "max_compile_params" in text  # says that it is analytic


def _without_memory_savers(config):
    """The DAPO config as it was before scan-free memory savers: dense attention, no remat, one-shot loss."""
    c = config.copy_and_resolve_references()
    c.model.attention, c.model.remat = "dense", "none"
    c.rl.logits_chunk_size = c.rl.micro_batch_size = 0
    return c


def test_qwen3_4b_and_8b_analytic_plans():
    for size, preset in (("4b", "qwen3_4b"), ("8b", "qwen3_8b")):
        config = _without_memory_savers(_config("qwen3_dapo", f"size={size}"))
        report = dry_run.plan(config, compiler="none", chip="v5p", num_devices=16)
        a = report["analytic"]
        n = count_params(dry_run.resolve_model_config(run_spec(config, dry_run=True)))
        assert report["num_params"] == n
        assert report["model"] == get_preset(preset)
        # fp32 params over fsdp = 16: all matrices split 16 ways, only the tiny norm vectors replicated.
        assert n * 4 / 16 <= a["params"] <= n * 4 / 16 * 1.001
        assert a["optimizer"] == 2 * a["params"]
        # 256 sequences x 10240 tokens with full attention probabilities and no remat: does not fit.
        assert a["activations"] > report["hbm_bytes"]
        chunked = dry_run.plan(_with_chunk(config, 256), compiler="none", chip="v5p", num_devices=16)["analytic"]
        assert chunked["loss"] < a["loss"] / 10  # chunking bounds the loss buffers
        assert "fits in HBM?" in dry_run.format_report(report)


def test_qwen3_8b_dapo_defaults_fit_64_v5p():
    """The issue's command: 128 prompts x 8 samples, 2,048 + 8,192 tokens on 64 x v5p (the config's defaults)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/qwen3_dapo.py:size=8b", "--dry_run",
                          "--config.dry_run.compiler=none"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "256 sequences x (2048 prompt + 8192 completion) tokens" in out.stdout and "on 64 x v5p" in out.stdout
    assert "attention=splash, remat=full" in out.stdout
    assert lines[-1].startswith("per-device total ") and lines[-1].endswith(
        "GiB of 95 GiB HBM (analytic plan, train step + colocated sampler (analytic)): fits"), lines[-1]
    before = dry_run.plan(_without_memory_savers(_config("qwen3_dapo", "size=8b")), compiler="none")
    after = dry_run.plan(_config("qwen3_dapo", "size=8b"), compiler="none")
    assert before["analytic"]["total"] > 20 * before["hbm_bytes"] and after["analytic"]["total"] < after["hbm_bytes"]


def test_remat_and_blockwise_attention_in_the_analytic_plan():
    base = _config("tiny")
    base.rl.max_new_tokens = 448  # 512-token sequences
    base.model.max_position_embeddings = 1024
    base.model.scan_layers = False  # the relative sizes below are those of the unrolled layers
    plans = {}
    for attention in ("dense", "blockwise"):
        for remat in ("none", "full"):
            c = base.copy_and_resolve_references()
            c.model.attention, c.model.remat = attention, remat
            plans[attention, remat] = dry_run.plan(c, compiler="none", num_devices=8)["analytic"]["activations"]
    assert plans["blockwise", "none"] < 0.5 * plans["dense", "none"]  # no [T,T] probabilities per layer
    assert plans["dense", "full"] < 0.6 * plans["dense", "none"]  # 3 layers: inputs + one recomputed layer
    assert plans["blockwise", "full"] < plans["blockwise", "none"]


def test_qwen3_dapo_size_argument():
    """size picks the default checkpoint (8b by default); it is consumed, every other item applies as usual."""
    assert _config("qwen3_dapo").to_dict() == _config("qwen3_dapo", "size=8b").to_dict()
    assert _config("qwen3_dapo", "size=4b").model.hf_path == "checkpoints/Qwen3-4B-Base"
    assert _config("qwen3_dapo", "size=8b").tokenizer.path == "checkpoints/Qwen3-8B-Base"
    c = _config("qwen3_dapo", "hf_path=/ckpt/Q,size=4b,delta=0.1,num_eval=30")
    assert (c.model.hf_path, c.tokenizer.path, c.trust_region.delta, c.data.num_eval) == ("/ckpt/Q", "/ckpt/Q", 0.1, 30)
    with pytest.raises(ValueError, match=r"'size' must be one of \['0.6b', '1.7b', '4b', '8b'\], got '14b'"):
        _config("qwen3_dapo", "size=14b")
    with pytest.raises(ValueError, match="unknown field"):
        _config("qwen3_dapo", "size=4b,bogus=1")


def _with_chunk(config, chunk):
    c = config.copy_and_resolve_references()
    c.rl.logits_chunk_size = chunk
    return c


def test_bad_chip_and_unknown_checkpoint_name():
    config = _config("tiny")
    with pytest.raises(ValueError, match="dry_run.chip"):
        dry_run.plan(config, chip="A100", compiler="none")
    with pytest.raises(ValueError, match="dry_run.compiler"):
        dry_run.plan(config, compiler="fast")
    config.model.hf_path = "/nonexistent/MyModel"
    with pytest.raises(ValueError, match="model.hf_path"):
        dry_run.resolve_model_config(run_spec(config, dry_run=True))


def test_qwen3_30b_a3b_dapo_dry_run_fits_64_v5p():
    import importlib.util

    from pdm_jax import dry_run
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "qwen3_30b_a3b_dapo", os.path.join(root, "configs", "qwen3_30b_a3b_dapo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config()
    # No checkpoint on disk: the directory name Qwen3-30B-A3B-Base names the preset.
    assert dry_run.resolve_model_config(run_spec(config, dry_run=True)) == presets.qwen3_30b_a3b()
    report = dry_run.plan(config, compiler="none")
    a, n = report["analytic"], report["num_params"]
    assert report["mesh"] == {"data": 1, "fsdp": 64, "tensor": 1} and report["chip"] == "v5p"
    # f32 params over 64 chips: the experts split by expert (2 of 128 per chip), the rest by embed.
    assert n * 4 / 64 <= a["params"] <= n * 4 / 64 * 1.001
    assert a["total"] < report["hbm_bytes"]
    text = dry_run.format_report(report)
    assert "Qwen3-MoE, 128 experts top-8 of width 768" in text and "on 64 x v5p" in text
    assert text.splitlines()[-1].endswith(
        "GiB of 95 GiB HBM (analytic plan, train step + colocated sampler (analytic)): fits")
    # The MoE activation model: k = 8 assignments of width 768 per token cost more than one
    # dense MLP of width 768 would.
    dense_like = dataclasses.replace(presets.qwen3_30b_a3b(), num_experts=0,
                                     intermediate_size=768)
    shape = dry_run.step_shape(run_spec(config, dry_run=True))
    moe_act = dry_run.analytic_plan(presets.qwen3_30b_a3b(), shape, report["mesh"])["activations"]
    dense_act = dry_run.analytic_plan(dense_like, shape, report["mesh"])["activations"]
    assert moe_act > dense_act


@pytest.mark.parametrize("remat", ["none", "full"])
def test_mixed_moe_activations_count_each_layer_by_its_mlp(remat):
    """30B-A3B with decoder_sparse_step 2 (24 sparse + 24 dense-MLP layers, run unrolled): the activation
    estimate is the mean of the all-sparse and the all-dense (intermediate_size 6144) unscanned models' (remat
    none: per-layer sums), or their larger recomputed layer on top of 48 kept inputs (remat full)."""
    from pdm_jax import dry_run

    sparse = dataclasses.replace(presets.qwen3_30b_a3b(), intermediate_size=6144)
    mixed = dataclasses.replace(sparse, decoder_sparse_step=2)
    dense = dataclasses.replace(sparse, num_experts=0)
    assert mixed.is_mixed and sum(map(mixed.is_sparse_layer, range(48))) == 24
    shape = dry_run.StepShape(batch=64, prompt_len=256, completion_len=1024, top_k=20, logits_chunk_size=512,
                              remat=remat, scan_layers=True)  # mixed models ignore scan_layers
    unscanned = dataclasses.replace(shape, scan_layers=False)
    mesh = {"data": 1, "fsdp": 64, "tensor": 1}
    act = {name: dry_run.analytic_plan(cfg, unscanned if name != "mixed" else shape, mesh)["activations"]
           for name, cfg in (("mixed", mixed), ("sparse", sparse), ("dense", dense))}
    if remat == "none":
        assert act["mixed"] == (act["sparse"] + act["dense"]) // 2
    else:  # every layer keeps its input; the larger of the two layers' buffers is live once
        assert act["mixed"] == max(act["sparse"], act["dense"])
    assert act["dense"] != act["sparse"]
