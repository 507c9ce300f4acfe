"""Benchmark: the stacked layers under ``lax.scan`` vs unrolled — train-step compile time and memory vs depth.

Part 1, compile time. The trainer's real RL step (``train_step.make_rl_train_step``: Qwen3
forward, top-K-KL trust region with the PDM mask, truncated-IS loss, backward, AdamW) is
lowered and compiled on abstract shapes (``jax.ShapeDtypeStruct``; nothing is allocated or
run) for a model of L = 2 and L = 36 layers of the same width, with ``model.scan_layers``
True and False, side by side in one process (after one unreported warm-up compile per mode,
which pays the process's one-time costs). It prints the seconds to trace+lower and to
compile, the HLO text size, and the ratio of the 36-layer time to the 2-layer one for each
mode. Scanned, the program holds one layer body whatever L (the ratio stays near 1);
unrolled, it holds L copies (the ratio grows with L).

Part 2, memory. XLA's ``memory_analysis().temp_size_in_bytes`` of fwd+bwd of the whole
model (mean log-partition loss w.r.t. every parameter, blockwise attention) for L in
``--layers``, scanned and unrolled, with remat ``none`` and ``full``. Scanned with full
remat, the backward keeps only each layer's input [B, T, D] (a stacked scan residual) and
recomputes one layer at a time: the temp is flat in L apart from that B·T·D per layer.
(XLA:CPU drops ``jax.checkpoint``'s barriers in an unrolled program and CSE merges the
recomputation back — see bench_attention_memory.py — so unrolled "full" saves nothing here;
under scan the residuals are fixed by JAX before XLA sees the loop, so remat holds on CPU too.)

Reproduce (CPU, repository root; ~3-6 minutes on 2 cores):

    python bench/bench_scan_layers.py
    python bench/bench_scan_layers.py --deep 12 --layers 2,4 --seq 512   # quicker
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.rl.step_batch import StepBatch

WIDTH = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)


def _abstract_model(cfg: Qwen3Config, **options):
    return nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), **options)))


def compile_seconds(layers: int, scan: bool, batch: int, prompt: int, completion: int,
                    top_k: int) -> dict:
    """Trace+lower and compile seconds (and HLO characters) of the RL train step on abstract shapes."""
    cfg = Qwen3Config(num_hidden_layers=layers, **WIDTH)
    graphdef, params = _abstract_model(cfg, scan_layers=scan)
    tx, _ = ts.make_optimizer(1e-5)
    state = ts.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                          opt_state=jax.eval_shape(tx.init, params))
    s = jax.ShapeDtypeStruct
    b, p, t, k = batch, prompt, completion, top_k
    batch_abs = StepBatch(prompt_ids=s((b, p), jnp.int32), prompt_mask=s((b, p), jnp.bool_),
                          completion_ids=s((b, t), jnp.int32), completion_mask=s((b, t), jnp.bool_),
                          behavior_logprobs=s((b, t), jnp.float32), topk_ids=s((b, t, k), jnp.int32),
                          topk_logprobs=s((b, t, k), jnp.float32), advantages=s((b,), jnp.float32))
    tr = trust_region.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="bucket_exact", delta=0.05)
    step = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, PolicyLossConfig(max_response_length=t,
                                                                             policy_loss="tis")))
    t0 = time.perf_counter()
    lowered = step.lower(state, batch_abs)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return dict(layers=layers, scan=scan, lower_s=t1 - t0, compile_s=t2 - t1,
                hlo_chars=len(lowered.as_text()))


def temp_mib(layers: int, scan: bool, remat: str, batch: int, seq: int, block: int) -> float:
    """XLA temp MiB of jit(grad) of the whole model's mean log-partition loss on abstract shapes."""
    cfg = Qwen3Config(num_hidden_layers=layers, **dict(WIDTH, vocab_size=256))
    graphdef, params = _abstract_model(cfg, scan_layers=scan, remat=remat, attention="blockwise",
                                       attention_block_q=block, attention_block_kv=block)

    def loss(params, ids_BxT, mask_BxT):
        logits = nnx.merge(graphdef, params)(ids_BxT, attention_mask=mask_BxT)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    s = jax.ShapeDtypeStruct
    compiled = jax.jit(jax.grad(loss)).lower(params, s((batch, seq), jnp.int32),
                                             s((batch, seq), jnp.bool_)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shallow", type=int, default=2)
    ap.add_argument("--deep", type=int, default=36)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--top_k", type=int, default=20)
    ap.add_argument("--layers", default="2,4,8,16", help="depths of part 2")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row in part 2")
    ap.add_argument("--mem_batch", type=int, default=1)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--json", default="", help="also write both tables to this JSON file")
    a = ap.parse_args()
    t_start = time.time()
    print(f"# jax {jax.__version__} {jax.devices()[0].platform}; RL train step (PDM, top-K KL, TIS, AdamW), "
          f"width {WIDTH}, batch {a.batch} x ({a.prompt} + {a.completion}) tokens, K {a.top_k}; "
          f"abstract shapes, lower + compile seconds")
    print(f"{'mode':>9} {'layers':>6} {'lower s':>8} {'compile s':>9} {'total s':>8} {'HLO kchars':>10}")
    for scan in (True, False):  # warm-up: the first compile in a process pays one-time costs
        compile_seconds(1, scan, a.batch, a.prompt, a.completion, a.top_k)
    rows = []
    for scan in (True, False):
        for layers in (a.shallow, a.deep):
            r = compile_seconds(layers, scan, a.batch, a.prompt, a.completion, a.top_k)
            rows.append(r)
            print(f"{'scanned' if scan else 'unrolled':>9} {layers:>6} {r['lower_s']:>8.2f} {r['compile_s']:>9.2f} "
                  f"{r['lower_s'] + r['compile_s']:>8.2f} {r['hlo_chars'] / 1e3:>10.0f}", flush=True)
    for scan in (True, False):
        shallow, deep = (next(r for r in rows if r["scan"] == scan and r["layers"] == n)
                         for n in (a.shallow, a.deep))
        ratio = (deep["lower_s"] + deep["compile_s"]) / (shallow["lower_s"] + shallow["compile_s"])
        print(f"# {'scanned' if scan else 'unrolled'}: lower+compile time {a.deep} layers / {a.shallow} layers "
              f"= {ratio:.2f}x")
    depths = [int(x) for x in a.layers.split(",")]
    print(f"\n# model fwd+bwd temp MiB (XLA memory_analysis), blockwise attention {a.block}, "
          f"B={a.mem_batch}, T={a.seq}, D={WIDTH['hidden_size']}; one layer input [B,T,D] f32 = "
          f"{a.mem_batch * a.seq * WIDTH['hidden_size'] * 4 / 2 ** 20:.2f} MiB")
    print(f"{'layers':>6} {'scan none':>10} {'scan full':>10} {'unroll none':>12} {'unroll full':>12}")
    mem = []
    for n in depths:
        vals = {f"{'scan' if scan else 'unroll'}_{remat}": temp_mib(n, scan, remat, a.mem_batch, a.seq, a.block)
                for scan in (True, False) for remat in ("none", "full")}
        mem.append(dict(layers=n, **vals))
        print(f"{n:>6} {vals['scan_none']:>10.2f} {vals['scan_full']:>10.2f} {vals['unroll_none']:>12.2f} "
              f"{vals['unroll_full']:>12.2f}", flush=True)
    if len(mem) > 1:
        span = mem[-1]["layers"] - mem[0]["layers"]
        per = {k: (mem[-1][k] - mem[0][k]) / span for k in mem[0] if k != "layers"}
        print("# MiB per extra layer: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
    print(f"# {time.time() - t_start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"compile": rows, "memory": mem}, f, indent=2)


if __name__ == "__main__":
    main()
