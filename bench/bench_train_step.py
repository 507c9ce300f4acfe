"""Benchmark: RL train-step throughput (completion tokens/s) for PPO-clip, DPPO and PDM side by side.

Each method is the trainer's real jitted step (``train_step.make_rl_train_step``:
Qwen3 forward, trust-region mask, policy loss, backward, AdamW with clipping)
on the same synthetic rollout batch, on a mesh over all local devices
(``data`` axis) with the state donated, exactly as ``Trainer._jit_step`` runs it:

* ``ppo_clip``   PPO clipped surrogate (eps 0.2 / 0.28), ratio mask;
* ``dppo``       truncated IS (C = 5), top-K KL trust region, ratio direction (the baseline);
* ``pdm``        truncated IS, top-K KL trust region, predictive direction (bucket_exact);
* ``pdm_chunk``  (medium only) the same with the sequence-chunked loss (``logits_chunk_size``).

Per config: compile every method once, then ``--repeats`` rounds that call
each method once in turn (so load spikes of a shared machine hit all alike),
and report the median step time, tokens/s (valid completion tokens per
second) and the ratio of tokens/s to DPPO.

Configs: ``tiny`` = configs/tiny.py's model and RL mini-batch (d 128, 3 layers,
V 15, 128 sequences x (8 prompt + 5 completion) tokens, K 4); ``medium`` =
d 256, 4 layers, V 8192, 16 sequences x (32 + 128) tokens, K 20.

The process uses the trainer's allocator setting (``host_memory.reuse_freed``, set before JAX
starts; ``--default_allocator`` keeps glibc's default, which maps and page-faults the step's
temporary buffer in at every call).

Reproduce (CPU, repository root; ~2-4 minutes on 2 cores):

    python bench/bench_train_step.py
    python bench/bench_train_step.py --configs tiny --repeats 3   # quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.rl import train_step as ts
from pdm_jax.rl import trust_region
from pdm_jax.distributed import opt_state_shardings, put_global_batch
from pdm_jax.host_memory import reuse_freed_host_memory
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.models.qwen3 import Qwen3Config, init_model
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.sharding import activation_sharding, make_mesh

CONFIGS = {
    "tiny": dict(model=dict(vocab_size=15, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
                 batch=128, prompt=8, completion=5, top_k=4, chunk=0),
    "medium": dict(model=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
                   batch=16, prompt=32, completion=128, top_k=20, chunk=32),
}
BASELINE = "dppo"


def methods(chunk: int) -> dict:
    """name -> (TrustRegionConfig, PolicyLossConfig kwargs)."""
    out = {
        "ppo_clip": (trust_region.TrustRegionConfig(mask="ppo", clip_eps_low=0.2, clip_eps_high=0.28),
                     dict(policy_loss="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28)),
        "dppo": (trust_region.TrustRegionConfig(mask="dppo", divergence="topk_kl", delta=0.05),
                 dict(policy_loss="tis")),
        "pdm": (trust_region.TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="bucket_exact", delta=0.05),
                dict(policy_loss="tis")),
    }
    if chunk:
        out["pdm_chunk"] = (out["pdm"][0], dict(policy_loss="tis", logits_chunk_size=chunk))
    return out


def make_batch(rng, b, p, t, k, v) -> dict:
    """A synthetic rollout: behaviour log-probs from random logits, right-padded completions, +-1 advantages."""
    logmu = rng.standard_normal((b, t, v)).astype(np.float32) * 3.0
    logmu -= np.log(np.exp(logmu).sum(-1, keepdims=True))
    ids = rng.integers(0, v, (b, t)).astype(np.int32)
    topk = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    lengths = rng.integers(max(1, t // 2), t + 1, (b, 1))
    return StepBatch(prompt_ids=rng.integers(0, v, (b, p)).astype(np.int32), prompt_mask=np.ones((b, p), bool),
                     completion_ids=ids, completion_mask=np.arange(t)[None] < lengths,
                     behavior_logprobs=np.take_along_axis(logmu, ids[..., None], -1)[..., 0],
                     topk_ids=topk, topk_logprobs=np.take_along_axis(logmu, topk, -1),
                     advantages=np.where(rng.random(b) < 0.5, -1.0, 1.0).astype(np.float32))


def bench_config(name: str, spec: dict, repeats: int) -> list[dict]:
    cfg = Qwen3Config(**spec["model"])
    mesh = make_mesh(data=-1, fsdp=1, tensor=1)
    graphdef, params = nnx.split(init_model(cfg, seed=0, mesh=mesh))
    tx, _ = ts.make_optimizer(1e-5)
    batch_np = make_batch(np.random.default_rng(0), spec["batch"], spec["prompt"], spec["completion"],
                          spec["top_k"], cfg.vocab_size)
    batch = put_global_batch(batch_np, mesh)
    tokens = int(batch_np.completion_mask.sum())
    steps, states = {}, {}
    for m, (tr, loss_kw) in methods(spec["chunk"]).items():
        loss_cfg = PolicyLossConfig(max_response_length=spec["completion"], **loss_kw)
        p = jax.tree.map(jnp.copy, params)
        state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                              opt_state=jax.jit(tx.init, out_shardings=opt_state_shardings(tx, p, mesh))(p))
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, loss_cfg), in_shardings=(shardings, None),
                       out_shardings=(shardings, None), donate_argnums=0)
        with activation_sharding(mesh):
            t0 = time.time()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        print(f"  {name}/{m}: compiled + first step {time.time() - t0:.1f} s, frac_masked "
              f"{float(metrics['frac_masked']):.3f}", flush=True)
        steps[m], states[m] = step, state
    times = {m: [] for m in steps}
    with activation_sharding(mesh):
        for _ in range(repeats):
            for m, step in steps.items():
                t0 = time.perf_counter()
                states[m], metrics = step(states[m], batch)
                jax.block_until_ready((states[m].params, metrics))
                times[m].append(time.perf_counter() - t0)
    base = tokens / statistics.median(times[BASELINE])
    rows = []
    for m, ts_ in times.items():
        med = statistics.median(ts_)
        rows.append(dict(config=name, method=m, step_ms=1e3 * med, tokens_per_s=tokens / med,
                         ratio_to_dppo=(tokens / med) / base, tokens=tokens))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,medium")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="")
    ap.add_argument("--default_allocator", action="store_true",
                    help="keep glibc's default allocator (as the trainer with host_memory.reuse_freed=false)")
    a = ap.parse_args()
    if not a.default_allocator:  # as the trainer does, before JAX starts its backend (pdm_jax.host_memory)
        reuse_freed_host_memory()
    print(f"# jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}, "
          f"{platform.processor() or platform.machine()}")
    rows = []
    for name in a.configs.split(","):
        rows += bench_config(name, CONFIGS[name], a.repeats)
    print(f"{'config':<8} {'method':<10} {'step ms':>9} {'tokens/s':>10} {'vs DPPO':>8}")
    for r in rows:
        print(f"{r['config']:<8} {r['method']:<10} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{r['ratio_to_dppo']:>8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
