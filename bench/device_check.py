"""Device check: what one accelerator does with random-weight Qwen3 at real widths (at most ~8 minutes).

For each shape (``--sizes``, default the 0.6B and 1.7B presets, random weights, bf16 compute over f32 masters):

* **train step**: the trainer's jitted RL step (`train_step.make_rl_train_step`: forward, PDM top-K KL mask,
  TIS loss with the chunked LM head, backward, AdamW; remat full, scanned layers, state donated) on a
  synthetic batch of ``--batch`` sequences x (``--prompt`` + ``--completion``) tokens: median step time,
  tokens/s (prompt + completion) and model-FLOPs utilization, ``8 N D`` + causal attention
  (`dry_run.model_flops`) over the chip's datasheet peak (`aot.CHIP_PEAK_BF16_FLOPS`);
* **decode**: one decode step of `Qwen3ForCausalLM.decode` (``--slots`` rows, one token each, against a KV cache
  of prompt + completion positions, as the rollout engine's loop runs it): tokens/s and the step time beside
  its HBM-bandwidth floor (the weights and the KV cache read once at `aot.CHIP_HBM_BYTES_PER_S`);
* **peak device memory** (``memory_stats()["peak_bytes_in_use"]``, where the backend reports it) beside the
  dry run's analytic figure for the same train step on one chip (`dry_run.analytic_plan`).

The chip is named by ``--chip`` (H100, H200, v5e, ...; default: guessed from the device kind) for the peaks.
``--tiny`` runs 2-layer, 64-wide shapes on whatever backend JAX has (the CPU in the tests), so the script does
not rot; its figures mean nothing about a chip. Prints one JSON object (``--json`` writes it too).

    python bench/device_check.py                 # on one H100 / H200 / TPU chip
    python bench/device_check.py --tiny          # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax import aot, dry_run
from pdm_jax.distributed import opt_state_shardings, put_global_batch
from pdm_jax.models.presets import get_preset
from pdm_jax.models.qwen3 import init_model
from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.sharding import activation_sharding, make_mesh

SIZES = {"0.6b": "qwen3_0p6b", "1.7b": "qwen3_1p7b"}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def guess_chip() -> str:
    """`aot.CHIP_HBM_GIB`'s name for device 0 ("H100", "H200", "v5e", ...), or "" (CPU, unknown)."""
    kind = jax.devices()[0].device_kind.lower()
    for name in ("H200", "H100", "v5p", "v6e", "v4"):
        if name.lower() in kind:
            return name
    return "v5e" if "v5 lite" in kind or "v5e" in kind else ""


def _batch(rng, b, p, t, k, v) -> StepBatch:
    """A synthetic rollout: random ids, full-length completions, random top-K log-probs, +-1 advantages."""
    logp = np.log(rng.dirichlet(np.ones(k + 1), size=(b, t)).astype(np.float32))
    return StepBatch(prompt_ids=rng.integers(0, v, (b, p)).astype(np.int32), prompt_mask=np.ones((b, p), bool),
                     completion_ids=rng.integers(0, v, (b, t)).astype(np.int32), completion_mask=np.ones((b, t), bool),
                     behavior_logprobs=logp[..., 0], topk_ids=rng.integers(0, v, (b, t, k)).astype(np.int32),
                     topk_logprobs=np.sort(logp[..., 1:], -1)[..., ::-1].copy(),
                     advantages=np.where(rng.random(b) < 0.5, -1.0, 1.0).astype(np.float32))


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(cfg, a, chip: str) -> dict:
    """The train-step, decode and memory figures of model config ``cfg`` (see the module docstring)."""
    mesh = make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
    b, p, t, k = a.batch, a.prompt, a.completion, 20
    chunk = min(512, t)
    model = init_model(cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.float32, mesh=mesh, remat="full",
                       scan_layers=True)
    graphdef, params = nnx.split(model)
    tx, _ = ts.make_optimizer(1e-6, weight_decay=0.1)
    state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params))
    tr = trust_region.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="bucket_exact", delta=0.05)
    loss = PolicyLossConfig(max_response_length=t, policy_loss="tis", logits_chunk_size=chunk)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, loss), in_shardings=(shardings, None),
                   out_shardings=(shardings, None), donate_argnums=0)
    batch = put_global_batch(_batch(np.random.default_rng(0), b, p, t, k, cfg.vocab_size), mesh)
    holder = [state, batch]  # the run's state and batch, released below

    def run():
        holder[0], metrics = step(holder[0], holder[1])
        return metrics
    with activation_sharding(mesh):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        compile_s = time.perf_counter() - t0
        step_s = _median_time(run, a.repeats)
    shape = dry_run.StepShape(batch=b, prompt_len=p, completion_len=t, top_k=k, logits_chunk_size=chunk,
                              attention="dense", remat="full", scan_layers=True)
    mf = dry_run.model_flops(cfg, shape, 1)
    peak = aot.CHIP_PEAK_BF16_FLOPS.get(chip)
    plan = dry_run.analytic_plan(cfg, shape, {"data": 1, "fsdp": 1, "tensor": 1}, dtype="bfloat16",
                                 param_dtype="float32")
    train = dict(step_s=step_s, compile_s=compile_s, tokens_per_s=b * (p + t) / step_s,
                 mfu=(mf["flops"] + mf["attention_flops"]) / step_s / peak if peak else None,
                 dry_run_analytic_gib=plan["total"] / 2 ** 30)
    holder.clear()
    del state, batch

    # One decode step, as the engine's loop runs it: bf16 weights, the cache at its longest.
    engine = init_model(cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh)
    egraph, estate = nnx.split(engine)
    s = p + t
    cache = engine.init_cache(a.slots, s, dtype=jnp.bfloat16)

    @jax.jit
    def decode(state, cache, ids, pos, index, mask):
        logits, cache = nnx.merge(egraph, state).decode(ids, pos, cache, index, mask)[:2]
        return jnp.argmax(logits[:, -1], -1), cache
    ids = jnp.zeros((a.slots, 1), jnp.int32)
    pos = jnp.full((a.slots, 1), s - 1, jnp.int32)
    index = jnp.full((a.slots,), s - 1, jnp.int32)
    mask = jnp.ones((a.slots, s), bool)
    jax.block_until_ready(decode(estate, cache, ids, pos, index, mask))
    decode_s = _median_time(lambda: decode(estate, cache, ids, pos, index, mask), a.repeats)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    floor_bytes = nbytes(estate) + nbytes(cache)
    bw = aot.CHIP_HBM_BYTES_PER_S.get(chip)
    out = dict(train=train, decode=dict(step_s=decode_s, tokens_per_s=a.slots / decode_s, floor_bytes=floor_bytes,
                                        floor_s=floor_bytes / bw if bw else None,
                                        floor_ratio=decode_s / (floor_bytes / bw) if bw else None))
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_device_gib"] = stats["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in stats else None
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.6b,1.7b")
    ap.add_argument("--tiny", action="store_true", help="2-layer 64-wide shapes, short sequences (CPU: the tests)")
    ap.add_argument("--chip", default="", help="the chip's name for the peaks (default: from the device kind)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=1536)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.tiny:
        a.batch, a.prompt, a.completion, a.slots, a.repeats = 2, 8, 16, 4, 2
    chip = a.chip or guess_chip()
    result = dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform, chip=chip or None,
                  jax=jax.__version__, tiny=a.tiny, batch=a.batch, prompt=a.prompt, completion=a.completion,
                  slots=a.slots, sizes={})
    for size in a.sizes.split(","):
        cfg = get_preset(SIZES[size])
        if a.tiny:
            cfg = dataclasses.replace(cfg, **TINY)
        t0 = time.perf_counter()
        result["sizes"][size] = dict(check(cfg, a, chip), wall_s=time.perf_counter() - t0)
        print(json.dumps({size: result["sizes"][size]}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
