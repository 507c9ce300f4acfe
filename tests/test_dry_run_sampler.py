"""The dry run's sampler memory plan (`dry_run.sampler_plan`) against hand computations for Qwen3-8B
(``configs/qwen3_dapo.py:size=8b``, 2,048 + 8,192 tokens, fp8 weights held in bf16): the config's own
per-host engine (1 x 4 chips, 64 slots, a host's 8 prompts) and, as before, a whole-step engine of 256
slots (``_config``'s defaults: 128 prompts in one request, park 2)."""

import importlib.util
import os

import pytest

from pdm_jax import dry_run
from pdm_jax.models.presets import count_params, get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3


def _recipe():
    spec = importlib.util.spec_from_file_location("qwen3_dapo", os.path.join(ROOT, "configs", "qwen3_dapo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config("size=8b")


def _config(mesh=(1, 1), **sampler):
    """The 8B recipe with one engine sampling the whole step (256 slots, park 2, no per-host split); a mesh
    larger than a host's 4 chips runs as a subprocess sampler on devices of its own."""
    c = _recipe()
    c.sampler.mesh.data, c.sampler.mesh.tensor = mesh
    c.sampler.max_batch_size, c.sampler.park_rows, c.sampler.per_host_rollouts = 256, 2, False
    if mesh[0] * mesh[1] > 4:
        c.sampler.mode = "subprocess"
    for k, v in sampler.items():
        c.sampler[k] = v
    return c


def _hand(mesh=(1, 1), slots=256, store_rows=128, dtype_bytes=2):
    """Qwen3-8B by hand: L 36, 8 kv heads x 128, D 4096; every matrix has a heads / kv heads / MLP /
    vocab axis that the tensor axis splits; the RMSNorm scales (2 D + 2 H per layer, D final) stay whole.
    Returns weights, KV cache, prompt store and park (2 x slots x (2,048 + 8,192 / 4) entries) bytes."""
    d, t = mesh
    n = count_params(get_preset("qwen3_8b"))
    norms = 36 * (2 * 4096 + 2 * 128) + 4096
    weights = ((n - norms) // t + norms) * dtype_bytes
    per_token = 36 * 2 * 8 * 128 * dtype_bytes  # 144 KiB in bf16 (the figure)
    kv = slots * (2048 + 8192) * per_token // (d * t)
    store = store_rows * 2048 * per_token // (d * t)
    park = 2 * slots * (2048 + 2048) * per_token // (d * t)  # sampler.park_rows 2
    return weights, kv, store, park


def _hand_transient(mesh, kv, store, park, rows=1024, chunk=128):
    """The engine's transient by hand: outputs (rows x 8,192 x (2 + 2 x 20) x 4 bytes, every device), the prefill's
    f32 scores (16 bytes x chunk prompts x 32 / tensor heads x 2,048^2 / data) and the LM head gathered whole
    (151,936 x 4,096 bf16 where tensor > 1); the largest of decode loop, prefill and compaction."""
    d, t = mesh
    outputs = rows * 8192 * 42 * 4
    prefill = 16 * chunk * (32 // t) * 2048 ** 2 // d
    lm_head = 151936 * 4096 * 2 if t > 1 else 0
    return max(kv + store + park + outputs + lm_head, kv + store + outputs + prefill, kv * 3 // 2 + 2 * outputs)


@pytest.mark.parametrize("mesh", [(1, 1), (8, 8), (4, 2), (1, 4)])
def test_sampler_plan_equals_hand_computation(mesh):
    sp = dry_run.plan(_config(mesh), compiler="none")["sampler"]
    weights, kv, store, park = _hand(mesh)
    assert (sp["weights"], sp["kv_cache"], sp["prompt_store"], sp["park"]) == (weights, kv, store, park)
    assert sp["transient"] == _hand_transient(mesh, kv, store, park) and sp["dtype"] == "bfloat16"
    assert sp["total"] == weights + sp["transient"]
    chunked = dry_run.plan(_config(mesh, prefill_chunk=8), compiler="none")["sampler"]
    assert chunked["prefill"] * 16 == sp["prefill"] and chunked["prefill_chunk"] == 8
    assert sp["colocated"] == (mesh[0] * mesh[1] <= 4)  # auto: colocated on TPU
    if mesh == (1, 1):  # the issue: 144 KiB per token, 256 slots x 10,240 tokens = 360 GiB on one chip
        assert 36 * 2 * 8 * 128 * 2 == 144 * 1024 and kv == 360 * GIB
    if mesh == (8, 8):  # 1.91 + 5.62 + 0.56 + 4.50 = 12.60 GiB per chip
        assert (round(sp["weights"] / GIB, 2), kv / GIB, store / GIB, park / GIB) == (1.91, 5.625, 0.5625, 4.5)


def test_the_recipes_own_per_host_engine():
    """configs/qwen3_dapo.py's sampler: each of 16 hosts samples its 8 prompts x 8 samples on its own 4 chips
    (tensor 4), 64 slots, a prompt store of max(8, 64 / 4) = 16 rows, nothing parked."""
    sp = dry_run.plan(_recipe(), compiler="none")["sampler"]
    weights, kv, _, _ = _hand((1, 4), slots=64)
    store = _hand((1, 4), store_rows=16)[2]
    assert (sp["weights"], sp["kv_cache"], sp["prompt_store"], sp["park"]) == (weights, kv, store, 0)
    assert (sp["hosts"], sp["request_prompts"], sp["slots"], sp["mesh"]) == (16, 8, 64, (1, 4))
    assert kv == 22.5 * GIB


def test_sampler_plan_dtype_slots_mode_and_report():
    """quantization none -> f32 weights and cache; static batches -> max_batch_size rows; continuous with
    max_slots 64 -> 64; a subprocess sampler on its own devices; the report's section and labels."""
    sp = dry_run.plan(_config(quantization="none"), compiler="none")["sampler"]
    assert (sp["weights"], sp["kv_cache"], sp["prompt_store"], sp["park"]) == _hand(dtype_bytes=4)
    assert sp["dtype"] == "float32"
    sp = dry_run.plan(_config(batching="static"), compiler="none")["sampler"]
    assert (sp["slots"], sp["prompt_store"], sp["park"]) == (256, 0, 0)
    assert dry_run.plan(_config(park_rows=0), compiler="none")["sampler"]["park"] == 0
    sp = dry_run.plan(_config(max_slots=64, mode="subprocess"), compiler="none")["sampler"]
    assert sp["kv_cache"] == _hand(slots=64)[1] and sp["prompt_store"] == _hand(store_rows=128)[2]
    assert sp["park"] == _hand(slots=64)[3]
    assert not sp["colocated"]
    report = dry_run.plan(_config((2, 2)), compiler="none")
    text = dry_run.format_report(report)
    assert "SAMPLER (rollout engine), ANALYTIC" in text and "same chips as the train step" in text
    a, sp, v = report["analytic"], report["sampler"], report["verdict"]
    resident = a["params"] + a["optimizer"] + a["batch"]
    both = resident + sp["weights"] + max(a["total"] - resident, sp["total"] - sp["weights"])
    assert v["total"] == both and v["colocated"]
    assert f"{'sampler_transient':<30}{(sp['total'] - sp['weights']) / GIB:10.3f}" in text
    assert text.splitlines()[-1].startswith("per-device total ")  # the verdict stays last
    with pytest.raises(ValueError, match="sampler.mesh = data 16 x tensor 8"):
        dry_run.plan(_config((16, 8), mode="colocated"), compiler="none")


@pytest.mark.slow
def test_compiled_sampler_program_agrees_with_the_analytic_weights_and_holds_the_cache():
    """configs/tiny.py with a 2 x 2 sampler mesh and dry_run.compile_sampler: XLA:CPU's memory_analysis of
    the sharded continuous program (8 fake devices) has the analytic weights as its argument (within 5%:
    plus the request's inputs) and an output (the carry) + temp at least the analytic KV cache + prompt store
    (plus activations); the tail's program is compiled too."""
    spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(None)
    c.sampler.mesh.data, c.sampler.mesh.tensor = 2, 2
    c.dry_run.compile_sampler = True
    report = dry_run.plan(c, compiler="cpu", chip="v5p", num_devices=8)
    sp, comp = report["sampler"], report["sampler_compiled"]
    assert comp is not None and sp["mesh"] == (2, 2)
    assert sp["weights"] <= comp["argument"] <= 1.05 * sp["weights"]
    assert comp["output"] + comp["temp"] >= sp["kv_cache"] + sp["prompt_store"] + sp["park"]  # the carry: output
    assert 0 < comp["tail_total"] <= comp["total"] and 0 < comp["compact_total"] <= comp["total"]
    assert comp["compact_total"] >= comp["argument"] + comp["output"]  # weights + full carry (+ its half)
    assert comp["tail_total"] < comp["compact_total"]  # the full cache is not the tail's
    text = dry_run.format_report(report)
    assert "sampler_compiled_temp" in text and "sampler_compiled_tail_total" in text
    assert "sampler_compiled_compact_total" in text
    # one decode step compiled alone: its floor is the analytic weights and KV cache, read once each
    step = comp["decode_step"]
    assert (step["weights"], step["kv_cache"]) == (sp["weights"], sp["kv_cache"])
    assert step["floor"] == step["weights"] + step["kv_cache"]
    assert step["bytes_accessed"] >= step["weights"]  # every weight read at least once per step
    assert "x the floor: weights + KV cache, each read once" in text


@pytest.mark.parametrize("mesh,chunk", [((8, 8), 4), ((2, 1), 1)])
def test_prefill_chunk_below_data_axis_is_whole_on_every_device(mesh, chunk):
    """A prefill chunk of fewer prompts than the engine's data axis could not be split over it: XLA replicates a
    chunk the data axis does not divide (XLA:CPU on fake devices: mesh 8 x 1 with a chunk of 4 held f32[4, 4, 64, 32]
    scores per device), so every data device would compute the whole chunk. The engine and the plan round the chunk
    up to a multiple of the data axis (`prefill_rows_at_once`), which splits it: 1 / data of it per device."""
    from pdm_jax.sampler.continuous_batching import prefill_rows_at_once

    d, t = mesh
    sp = dry_run.plan(_config(mesh, prefill_chunk=chunk), compiler="none")["sampler"]
    assert sp["prefill_chunk"] == d  # 8 for 4 prompts over 8 data devices, 2 for 1 over 2
    assert sp["prefill"] == 16 * (d // d) * (32 // t) * 2048 ** 2
    assert [prefill_rows_at_once(128, c, 8) for c in (0, 1, 8, 12, 64, 200)] == [128, 8, 8, 8, 64, 128]
    assert [prefill_rows_at_once(8, c) for c in (3, 5, 8)] == [2, 4, 8] and prefill_rows_at_once(4, 1, 8) == 4


def test_routing_outputs_counted_in_their_dtype():
    """With MoE routing replay the engine carries [rows, P + T, layers, k] routing in `rollout.routing_dtype`
    (continuous_batching: ``store_routed.astype(routing_dtype(num_experts))``): int16 for Qwen3-30B-A3B's 128
    experts (int8 holds ids up to 127 only). The plan counted one byte per entry (int8) whatever the experts."""
    from pdm_jax.rollout import routing_dtype

    spec = importlib.util.spec_from_file_location("qwen3_30b", os.path.join(ROOT, "configs", "qwen3_30b_a3b_dapo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    plain = dry_run.plan(c, compiler="none")["sampler"]
    c.model.moe_routing_replay = True
    replay = dry_run.plan(c, compiler="none")["sampler"]
    cfg = get_preset("qwen3_30b_a3b")
    assert cfg.num_experts == 128 and routing_dtype(cfg.num_experts).itemsize == 2
    rows = max(dry_run.next_pow2(plain["request_prompts"] * c.rl.group_size), plain["slots"])
    entries = rows * (c.sampler.max_prompt_length + c.rl.max_new_tokens) * cfg.num_hidden_layers * 8
    assert replay["outputs"] - plain["outputs"] == 2 * entries
