"""Benchmark: jitted loss + gradient w.r.t. the logits for PPO-clip, DPPO and PDM.

For a batch of B*T tokens over a V-token vocabulary with the sampler's top-K,
each method computes, under one ``jax.jit``, the token-mean policy loss and its
gradient w.r.t. the (temperature-scaled) logits ``[B,T,V]``:

* ``ppo_clip``            log pi(y_t) (one log-softmax) -> PPO clipped surrogate
                          (eps 0.2/0.28, dual clip 3); no divergence.
* ``dppo_topk_kl``        ``trust_region_mask_and_logprobs`` with the top-K KL
                          proximity and the ratio direction -> truncated-IS loss.
                          The baseline every ratio is taken against.
* ``pdm_<estimator>``     the same with the predictive direction D' from the
                          closed forms ``aggregated_tail``, ``uniform_tail``,
                          ``bucket_exact`` and the ``autodiff`` (``jax.jvp``) path.

Per method: compile once (ahead of time), read the compiled temporary memory
``compiled.memory_analysis().temp_size_in_bytes`` (buffers XLA allocates besides
the arguments and outputs), then time ``--repeats`` calls (``block_until_ready``),
interleaving the methods round by round so a load spike on a shared machine
hits all of them alike, and report the median and minimum wall time and the
median process CPU time (all threads; the steadiest figure on a shared machine,
where wall time also counts waiting for a core), plus XLA's static cost model
of each compiled program (bytes accessed, transcendentals, flops: deterministic
proxies that do not depend on the load). Ratios are to ``dppo_topk_kl``.

Reproduce (CPU, from the repository root):

    python bench/bench_loss.py                       # B=8 T=256 V=32768 K=20
    python bench/bench_loss.py --batch 2 --seq 64 --vocab 4096 --repeats 3   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pdm_jax.rl import objectives, trust_region

BASELINE = "dppo_topk_kl"
#: XLA's static cost model of the compiled program (deterministic, unlike timings).
_COST_KEYS = {"flops": "flops", "bytes_accessed": "bytes accessed", "transcendentals": "transcendentals"}


def make_batch(batch: int, seq: int, vocab: int, topk: int, seed: int = 0, dtype=jnp.float32):
    """A synthetic rollout: pi and mu differ by logit noise; tokens sampled from mu.

    Returns a dict of device arrays: logits [B,T,V] (dtype), tokens [B,T] int32,
    topk_ids [B,T,K] int32, topk_logprobs [B,T,K] f32, behavior_logprobs [B,T] f32,
    advantages [B] f32, valid_mask [B,T] bool (random right padding).
    """
    key = jax.random.PRNGKey(seed)
    k_logits, k_noise, k_tok, k_adv, k_len = jax.random.split(key, 5)

    @jax.jit
    def build():
        # Heavy-tailed logits so top-K holds a realistic share of the mass.
        logits = 3.0 * jax.random.normal(k_logits, (batch, seq, vocab), jnp.float32)
        behavior_logits = logits + 0.3 * jax.random.normal(k_noise, (batch, seq, vocab), jnp.float32)
        behavior_logp = jax.nn.log_softmax(behavior_logits, axis=-1)
        tokens = jax.random.categorical(k_tok, behavior_logits, axis=-1).astype(jnp.int32)
        topk_logprobs, topk_ids = jax.lax.top_k(behavior_logp, topk)
        behavior_logprobs = jnp.take_along_axis(behavior_logp, tokens[..., None], axis=-1)[..., 0]
        advantages = jax.random.normal(k_adv, (batch,), jnp.float32)
        lengths = jax.random.randint(k_len, (batch,), seq // 2, seq + 1)
        valid = jnp.arange(seq)[None, :] < lengths[:, None]
        return dict(logits=logits.astype(dtype), tokens=tokens, topk_ids=topk_ids.astype(jnp.int32),
                    topk_logprobs=topk_logprobs, behavior_logprobs=behavior_logprobs,
                    advantages=advantages, valid_mask=valid)

    return jax.block_until_ready(build())


def _ppo_loss(logits, b):
    logprobs = trust_region.token_logprobs(logits, b["tokens"], b["valid_mask"])
    per_token = objectives.ppo_clip_policy_loss(
        logprobs, b["behavior_logprobs"], b["advantages"], clip_eps_low=0.2, clip_eps_high=0.28,
        dual_clip=3.0, mask=b["valid_mask"])
    s, d = objectives.aggregate_loss(per_token, b["valid_mask"], "token_mean")
    return s / d, {}


def _trust_region_loss(config: trust_region.TrustRegionConfig, tis_cap: float = 5.0):
    def loss(logits, b):
        mask, logprobs, stats = trust_region.trust_region_mask_and_logprobs(
            logits, b["tokens"], b["topk_ids"], b["topk_logprobs"], b["behavior_logprobs"],
            b["advantages"], b["valid_mask"], config)
        per_token = objectives.tis_policy_loss(logprobs, b["behavior_logprobs"], b["advantages"], mask,
                                               tis_cap=tis_cap)
        s, d = objectives.aggregate_loss(per_token, b["valid_mask"], "token_mean")
        return s / d, stats

    return loss


def methods(delta: float):
    """name -> loss_fn(logits, batch) -> (loss, stats)."""
    cfg = dict(divergence="topk_kl", delta=delta, direction_stats=False)
    out = {
        "ppo_clip": _ppo_loss,
        BASELINE: _trust_region_loss(trust_region.TrustRegionConfig(mask="dppo", **cfg)),
    }
    for est in ("aggregated_tail", "uniform_tail", "bucket_exact", "autodiff"):
        out[f"pdm_{est}"] = _trust_region_loss(trust_region.TrustRegionConfig(mask="pdm", estimator=est, **cfg))
    return out


def run(args) -> list[dict]:
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    batch = make_batch(args.batch, args.seq, args.vocab, args.topk, seed=args.seed, dtype=dtype)
    logits = batch.pop("logits")
    selected = methods(args.delta)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in selected]
        if unknown:
            raise SystemExit(f"--only: unknown method(s) {unknown}; choose from {list(selected)}")
        selected = {n: selected[n] for n in names}

    compiled, rows = {}, {}
    for name, loss_fn in selected.items():
        fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        t0 = time.perf_counter()
        try:
            c = fn.lower(logits, batch).compile()
        except Exception as e:  # noqa: BLE001  (report and carry on with the other methods)
            print(f"{name}: compile failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        compile_s = time.perf_counter() - t0
        mem = c.memory_analysis()
        cost = c.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
        (loss, stats), grad = jax.block_until_ready(c(logits, batch))  # warm-up run
        if not (np.isfinite(float(loss)) and bool(jnp.all(jnp.isfinite(grad)))):
            raise SystemExit(f"{name}: non-finite loss or gradient")
        compiled[name] = c
        rows[name] = dict(
            method=name, compile_s=compile_s, times_s=[], cpu_times_s=[],
            temp_bytes=int(mem.temp_size_in_bytes) if mem is not None else None,
            loss=float(loss), frac_masked=float(stats.get("frac_masked", 0.0)),
            **{key: float(cost[name_]) for key, name_ in _COST_KEYS.items() if name_ in cost},
        )
        del grad

    for _ in range(args.repeats):
        for name, c in compiled.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(c(logits, batch))
            rows[name]["times_s"].append(time.perf_counter() - t0)
            rows[name]["cpu_times_s"].append(time.process_time() - c0)

    for row in rows.values():
        row["median_s"] = statistics.median(row["times_s"])
        row["min_s"] = min(row["times_s"])
        row["cpu_median_s"] = statistics.median(row["cpu_times_s"])
    base = rows.get(BASELINE)
    out = []
    for name, row in rows.items():
        if base is not None:
            row["time_ratio"] = row["median_s"] / base["median_s"]
            row["min_time_ratio"] = row["min_s"] / base["min_s"]
            row["cpu_ratio"] = row["cpu_median_s"] / base["cpu_median_s"]
            for key in _COST_KEYS:
                if row.get(key) is not None and base.get(key):
                    row[f"{key}_ratio"] = row[key] / base[key]
            row["mem_ratio"] = (row["temp_bytes"] / base["temp_bytes"]
                                if row["temp_bytes"] is not None and base["temp_bytes"] else None)
        out.append(row)
    return out


def format_table(rows: list[dict], args) -> str:
    head = (f"B={args.batch} T={args.seq} (B*T={args.batch * args.seq} tokens) V={args.vocab} K={args.topk} "
            f"logits={args.dtype}, delta={args.delta}, {args.repeats} timed runs (median), "
            f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus, {platform.machine()})")
    lines = [head, "",
             "| method | wall median (ms) | / DPPO | wall min (ms) | / DPPO | CPU time median (ms) | / DPPO "
             "| temp memory (MiB) | / DPPO | XLA bytes accessed / DPPO | XLA transcendentals / DPPO "
             "| XLA flops / DPPO | compile (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratio = lambda r, key: f"{r[key]:.2f}x" if r.get(key) is not None else "-"  # noqa: E731
    for r in rows:
        mem = "n/a" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['method']} | {1e3 * r['median_s']:.1f} | {ratio(r, 'time_ratio')} "
                     f"| {1e3 * r['min_s']:.1f} | {ratio(r, 'min_time_ratio')} "
                     f"| {1e3 * r['cpu_median_s']:.1f} | {ratio(r, 'cpu_ratio')} "
                     f"| {mem} | {ratio(r, 'mem_ratio')} | {ratio(r, 'bytes_accessed_ratio')} "
                     f"| {ratio(r, 'transcendentals_ratio')} | {ratio(r, 'flops_ratio')} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--delta", type=float, default=0.05)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated subset of methods")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = run(args)
    print(format_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
