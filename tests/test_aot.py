"""Ahead-of-time compiles for a TPU slice on this CPU host (`pdm_jax.aot`, `dry_run.compiler=tpu`).

XLA:TPU comes from libtpu (``pip install -e '.[tpu]'``, which ``.ci/run`` installs); the compile
tests skip, saying so, where it is absent. Nothing runs on a TPU: the tests compile the tiny
model's programs for ``v5p:2x2x1`` (4 chips) and read XLA:TPU's own memory plan.
"""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

from pdm_jax import aot, dry_run
from pdm_jax.run_spec import run_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(not aot.compiler_available("tpu"),
                                  reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu]'")


def _cli_dry_run(*flags):
    """``python -m pdm_jax.train --config=configs/tiny.py --dry_run <flags>`` in a subprocess."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", "--dry_run", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _config(name, arg=None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


@pytest.mark.parametrize("chip,n,name", [
    ("v5p", 64, "v5p:4x4x4"), ("v5p", 4, "v5p:2x2x1"), ("v5p", 8, "v5p:2x2x2"), ("v5p", 128, "v5p:4x4x8"),
    ("v5p", 16, "v5p:2x2x4"), ("v6e", 16, "v6e:4x4"), ("v6e", 8, "v6e:2x4"), ("v5e", 256, "v5e:16x16"),
    ("v4", 16, "v4:2x2x2"), ("H100", 64, "8x8"), ("H200", 4, "1x4"),
])
def test_default_topology(chip, n, name):
    assert aot.default_topology(chip, n) == name


def test_bad_targets_name_the_field():
    with pytest.raises(ValueError, match=r"dry_run.num_devices must be a power of two .* got 12"):
        aot.default_topology("v5p", 12)
    with pytest.raises(ValueError, match=r"dry_run.chip must be one of .* got 'A100'"):
        aot.chip_platform("A100")
    with pytest.raises(ValueError, match=r"dry_run.compiler = 'gpu' cannot compile for dry_run.chip = 'v5p'"):
        aot.resolve_compiler("gpu", "v5p")
    with pytest.raises(ValueError, match=r"dry_run.compiler must be one of .* got 'xla'"):
        aot.resolve_compiler("xla", "v5p")


def test_missing_compiler_says_how_to_install(monkeypatch):
    monkeypatch.setattr(aot, "compiler_available", lambda compiler: compiler == "cpu")
    with pytest.raises(aot.CompilerUnavailable, match=r"XLA:TPU is not installed .*pip install -e '.\[tpu\]'"):
        aot.target_devices("tpu", "v5p", 4)
    assert aot.resolve_compiler("auto", "v5p") == "cpu"
    with pytest.raises(aot.CompilerUnavailable, match=r"pip install -e '.\[gpu-aot\]'"):
        dry_run.plan(_config("tiny"), compiler="gpu", chip="H100", num_devices=8)


def test_cli_exits_2_without_the_compiler(tmp_path):
    """`--config.dry_run.compiler=gpu` on a host without the CUDA plugin: exit 2 and the install command."""
    if aot.compiler_available("gpu"):
        pytest.skip("the CUDA PJRT plugin is installed here")
    out = _cli_dry_run("--config.dry_run.compiler=gpu", "--config.dry_run.chip=H100")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pip install -e '.[gpu-aot]'" in out.stderr


def test_verdict_counts_the_colocated_sampler():
    """The last line adds up everything that shares a chip: a train step that fits beside a sampler that does
    not is 'does not fit' (the 8B config with a 1 x 1 sampler mesh, analytic plan)."""
    c = _config("qwen3_dapo", "size=8b")
    c.sampler.mesh.data, c.sampler.mesh.tensor = 1, 1
    c.sampler.max_slots, c.sampler.park_rows = 256, 2
    report = dry_run.plan(c, compiler="none")
    assert report["analytic"]["total"] < report["hbm_bytes"] < report["sampler"]["total"]
    assert not report["verdict"]["fits"]
    last = dry_run.format_report(report).splitlines()[-1]
    assert last.startswith("per-device total") and last.endswith("train step + colocated sampler (analytic)): "
                                                                  "does not fit"), last


def test_colocated_sampler_mesh_must_fit_a_host():
    """What the trainer checks: a colocated engine runs on one host's chips (4 per v5p host), its tensor axis
    must divide the kv heads (the engine's own check)."""
    c = _config("qwen3_dapo", "size=8b")
    c.sampler.mesh.data, c.sampler.mesh.tensor = 8, 8
    with pytest.raises(ValueError, match=r"sampler.mesh = data 8 x tensor 8 needs 64 devices; a colocated sampler "
                                         r"runs on one host's own chips \(4 of v5p per host"):
        dry_run.plan(c, compiler="none")
    c = _config("qwen3_30b_a3b_dapo")
    c.sampler.mesh.data, c.sampler.mesh.tensor = 1, 8
    c.dry_run.chip = "H100"
    with pytest.raises(ValueError, match=r"num_key_value_heads = 4 is not divisible by the mesh's tensor axis \(8\)"):
        dry_run.plan(c, compiler="none")


@needs_libtpu
def test_tpu_devices_of_a_slice():
    devices = aot.target_devices("tpu", "v5p", 64)
    assert len(devices) == 64 and {d.platform for d in devices} == {"tpu"}
    assert aot.devices_per_process(devices) == 4  # 16 hosts of 4 chips
    with pytest.raises(ValueError, match=r"dry_run.topology = 'v5p:2x2x1' has 4 devices but dry_run.num_devices = 8"):
        aot.target_devices("tpu", "v5p", 8, "v5p:2x2x1")


def _tiny_tpu(attention, **overrides):
    c = _config("tiny")
    c.model.attention = attention
    c.rl.max_new_tokens = 64  # 128-token sequences: one splash tile
    c.rl.prompts_per_step = 16
    c.model.num_hidden_layers = 2  # not tiny's 3: still a layer loop to count, and unrolled layers compile one by one
    for k, v in overrides.items():
        section, field = k.split("__")
        c[section][field] = v
    return c


@functools.lru_cache(maxsize=None)
def _tpu_plan(attention, **overrides):
    """``dry_run.plan`` of `_tiny_tpu` on 4 v5p chips, made once per module for the tests that read the same plan
    (each XLA:TPU compile of it takes seconds; the tests only read the report)."""
    return dry_run.plan(_tiny_tpu(attention, **overrides), compiler="tpu", chip="v5p", num_devices=4)


@needs_libtpu
@pytest.mark.parametrize("attention", ["splash", "blockwise"])
@pytest.mark.slow
def test_tiny_train_step_compiles_for_tpu(attention):
    """The tiny step with splash (Mosaic kernel under shard_map, batch sharded over 4 chips) and blockwise
    attention, compiled by XLA:TPU; FLOPs from XLA:TPU's cost model within 2x of 6 N D."""
    # The splash plan skips the FLOP-count compiles (dry_run.count_flops; the blockwise plan's count is
    # test_counted_flops_add_up_every_loop_iteration's).
    # The splash plan has one layer (XLA:TPU compiles it in half the time; the layers are alike).
    layers = {"model__num_hidden_layers": 1} if attention == "splash" else {}
    report = _tpu_plan(attention, dry_run__count_flops=attention == "blockwise", **layers)
    c = report["compiled"]
    assert report["target"] == "XLA:TPU v5p:2x2x1" and report["shape"].attention == attention
    assert c["attention_note"] == "" and 0 < c["total"] < 2 ** 30
    # The donated train state aliases its outputs; the arguments are the sharded state + batch.
    a = report["analytic"]
    assert abs(c["argument"] - (a["params"] + a["optimizer"] + a["batch"])) < 0.05 * c["argument"]
    assert c["alias"] > 0.9 * (a["params"] + a["optimizer"])
    ratio = c["flops"] / report["model_flops"]["flops"]
    assert 0.8 < ratio < 2.0, ratio
    # The sampler's programs compile for the same chips (colocated on TPU) and the verdict names XLA:TPU.
    assert report["sampler"]["colocated"] and report["sampler_compiled"]["total"] > 0
    text = dry_run.format_report(report)
    assert ("counted_tflops: not counted: dry_run.count_flops = False" in text) == (attention == "splash")
    last = text.splitlines()[-1]
    assert re.fullmatch(r"per-device total [0-9.]+ GiB of 95 GiB HBM \(XLA:TPU v5p:2x2x1, train step \+ colocated "
                        r"sampler \(compiled\)\): fits", last), last


@needs_libtpu
def test_splash_lowers_to_a_mosaic_kernel():
    """Under the TPU mesh the attention is the splash kernel itself (a Mosaic custom call), not a fallback."""
    from pdm_jax.sharding import activation_sharding, make_mesh, target_platform

    devices = aot.target_devices("tpu", "v5p", 4)
    mesh = make_mesh(data=4, fsdp=1, tensor=1, devices=devices)
    with activation_sharding(mesh):
        assert target_platform() == "tpu"
    assert target_platform() == "cpu"
    spec = run_spec(_tiny_tpu("splash"), dry_run=True)
    model_cfg = dry_run.resolve_model_config(spec)
    shape = dry_run.step_shape(spec, "v5p")
    text = dry_run.lowered_train_step(spec, model_cfg, shape, dry_run.mesh_sizes(spec, 4), devices=devices,
                                      platform="tpu").as_text()
    assert "tpu_custom_call" in text and "splash" in text


@needs_libtpu
@pytest.mark.slow
def test_tiny_moe_megablox_compiles_for_tpu():
    """megablox gmm (a Mosaic kernel: it needs shard_map) in the tiny MoE step on 4 chips, its temporaries
    close to ragged_dot's (the dispatch runs per shard in both)."""
    temps = {}
    for impl in ("megablox", "ragged_dot"):
        c = _config("tiny_moe")
        c.model.moe_implementation = impl
        c.model.moe_intermediate_size = 128  # Mosaic's lane width
        c.model.num_hidden_layers = 1  # the unrolled layers are alike: one compiles in a third of the time
        # The train step alone, as `dry_run.plan` compiles it (without the plan's sampler and FLOP-count compiles).
        s = run_spec(c, dry_run=True)
        temps[impl] = dry_run.compiled_plan(s, dry_run.resolve_model_config(s), dry_run.step_shape(s, "v5p"),
                                            dry_run.mesh_sizes(s, 4), platform="tpu",
                                            devices=aot.target_devices("tpu", "v5p", 4))["temp"]
    assert 0.5 < temps["megablox"] / temps["ragged_dot"] < 2.0, temps


@needs_libtpu
@pytest.mark.slow
def test_cli_dry_run_on_tpu_ends_with_the_verdict():
    """The CLI's XLA:TPU dry run of the tiny config (one layer: XLA:TPU compiles the step in half the time) with a
    subprocess sampler on 1 chip: libtpu has no 1-chip v5p slice, so its program compiles on the first chip of a
    one-host slice, and the verdict checks each side on its own chips (the colocated verdict:
    test_tiny_train_step_compiles_for_tpu)."""
    out = _cli_dry_run("--config.dry_run.compiler=tpu", "--config.dry_run.num_devices=4",
                       "--config.model.num_hidden_layers=1", "--config.dry_run.count_flops=false",
                       "--config.sampler.mode=subprocess")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "COMPILED by XLA:TPU v5p:2x2x1" in out.stdout and "COMPILED sampler program by XLA:TPU" in out.stdout
    assert "counted_tflops: not counted: dry_run.count_flops = False" in out.stdout  # the flag reaches the plan
    assert lines[-1].endswith("sampler on its own chips (compiled)): fits"), lines[-1]


def test_cpu_platform_outside_a_mesh():
    from pdm_jax.sharding import target_platform

    assert target_platform() == jax.default_backend() == "cpu"


@needs_libtpu
@pytest.mark.slow
def test_counted_flops_add_up_every_loop_iteration():
    """XLA counts a loop body once: the step scanned over layers and micro-batches reports a fraction of the
    FLOPs of the same step without loops; `counted_flops` (loop-free 1- and 2-layer compiles, added up) comes
    within 10% of the loop-free program's own count (the rest: ops that do not scale with rows)."""
    a = _tpu_plan("blockwise", model__scan_layers=True, rl__micro_batch_size=8)["compiled"]
    b = _tpu_plan("blockwise", dry_run__count_flops=True)["compiled"]  # layers unrolled, no micro-batches
    assert not _tiny_tpu("blockwise").model.scan_layers and _tiny_tpu("blockwise").rl.micro_batch_size == 0
    assert a["flops"] < 0.5 * b["flops"]
    for c in (a, b):
        assert abs(c["counted"]["flops"] - b["flops"]) < 0.1 * b["flops"], (c["counted"], b["flops"])
    text = dry_run.format_report(_tpu_plan("blockwise", dry_run__count_flops=True))
    assert re.search(r"counted_tflops +[0-9.e+-]+ +\(every layer", text) and "counted / expected" in text, text


@needs_libtpu
def test_moe_auto_is_megablox_for_tpu_devices_only():
    from pdm_jax.models import moe
    from pdm_jax.sharding import activation_sharding, make_mesh

    mesh = make_mesh(data=4, fsdp=1, tensor=1, devices=aot.target_devices("tpu", "v5p", 4))
    with activation_sharding(mesh):
        assert moe.resolve_implementation("auto", hidden_size=2048, moe_intermediate_size=768) == "megablox"
        assert moe.resolve_implementation("auto", hidden_size=128, moe_intermediate_size=96) == "ragged_dot"
        assert moe.resolve_implementation("ragged_dot", hidden_size=2048, moe_intermediate_size=768) == "ragged_dot"
    assert moe.resolve_implementation("auto", hidden_size=2048, moe_intermediate_size=768) == "ragged_dot"  # CPU
    with pytest.raises(ValueError, match="moe_implementation must be one of"):
        moe.resolve_implementation("fast", hidden_size=2048, moe_intermediate_size=768)


def test_bad_topologies_name_the_field():
    with pytest.raises(ValueError, match=r"dry_run.topology = 'v6e:2x2' is not a slice of dry_run.chip = 'v5p'"):
        aot.target_devices("tpu", "v5p", 4, "v6e:2x2")
    with pytest.raises(ValueError, match=r"dry_run.topology = '8x8x8': a GPU pod is '<hosts>x<GPUs per host>'"):
        aot.target_devices("gpu", "H100", 64, "8x8x8")
    if aot.compiler_available("tpu"):
        with pytest.raises(ValueError, match=r"dry_run.topology = 'v5p:3x3x3': libtpu refuses it"):
            aot.target_devices("tpu", "v5p", 27, "v5p:3x3x3")


def test_run_config_checks_the_dry_run_fields():
    from pdm_jax.config import validate_config

    c = _config("tiny")
    c.dry_run.chip, c.dry_run.num_devices = "bogus", 0
    with pytest.raises(ValueError, match=r"2 config errors: dry_run.chip = 'bogus': .*dry_run.num_devices = 0"):
        validate_config(c)


def test_a_dry_run_on_zero_devices_exits_2_naming_the_field():
    """The CLI, as a user types it: a config error (exit 2, the field and the value), not a ZeroDivisionError."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", "--dry_run",
                        "--config.dry_run.num_devices=0"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error: dry_run.num_devices = 0: must be >= 1" in r.stderr and "Traceback" not in r.stderr


class _Refused:
    """A lowered program whose compile raises the compiler's out-of-memory refusal ``message``."""

    def __init__(self, message):
        self.message = message

    def compile(self):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("message,temp", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (175.70G) "
     "exceeds available HBM (95.74G).", 175.70),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 21.90G of "
     "7.48G hbm. Exceeded hbm capacity by 14.42G.", 21.90),
    ("RESOURCE_EXHAUSTED: out of memory", 0.0),
])
def test_a_refused_compile_never_fits(monkeypatch, message, temp):
    """Both forms of XLA:TPU's refusal are read; whatever figures it gives, the verdict is 'does not fit'."""
    compiled, figures = dry_run._compile_or_exhausted(_Refused(message))
    assert compiled is None and abs(figures["temp"] / 2 ** 30 - temp) < 0.01
    monkeypatch.setattr(dry_run, "_compile_or_exhausted", lambda lowered: (None, dict(figures)))
    report = dry_run.plan(_config("tiny"), compiler="cpu", num_devices=8)
    text = dry_run.format_report(report)
    assert report["compiled"]["exhausted"] and not report["verdict"]["fits"]
    assert "the compiler refused it" in text and text.splitlines()[-1].endswith("does not fit"), text[-400:]


def test_per_host_rollouts_need_prompts_dividing_the_hosts():
    """As the trainer refuses at start-up: 128 prompts over the 12 hosts of 48 v5p chips cut groups."""
    with pytest.raises(ValueError, match=r"rl.prompts_per_step = 128: with sampler.per_host_rollouts each of the "
                                         r"12 hosts \(48 x v5p, 4 per host\)"):
        dry_run.plan(_config("qwen3_dapo", "size=8b"), compiler="none", num_devices=48)


@needs_libtpu
def test_a_sampler_on_chips_of_its_own_is_placed_on_part_of_a_host():
    """A subprocess sampler's chips: the first of a one-host slice (its compile and verdict:
    test_cli_dry_run_on_tpu_ends_with_the_verdict)."""
    assert len(aot.target_devices("tpu", "v5p", 1)) == 1
    assert aot.label("tpu", "v5p", None, 2) == "XLA:TPU v5p:2x2x1 (its first 2)"
