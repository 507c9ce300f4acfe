"""Benchmark: continuous vs static batching -- useful tokens/s on mixed response lengths, and compiles.

Part 1 (throughput). A random tiny Qwen3 (f32, near-uniform next-token distributions) and
``--prompts`` prompts x n = ``--n`` samples (more sequences than ``--slots``), temperature 1:

* **mixed**: 8 stop ids (of V = 512), so a row stops with probability ~8/512 = 1/64 per token:
  geometric response lengths, mean ~64, capped at ``--max_new`` = 256;
* **uniform**: no stop ids, exactly ``--uniform_len`` = 64 new tokens per row.

Each engine (``batching="static"``: chunks of ``--slots`` rows run to their longest row;
``batching="continuous"``: ``--slots`` slots refilled as rows stop) runs both workloads;
useful tokens/s = completion tokens (the mask's sum) / wall time, median of ``--repeats``
interleaved rounds after a compile round, and mixed / uniform per engine (the issue's target:
>= 0.6x), with its min / median / max over the rounds (each round times mixed and uniform back to
back) and the same ratio per process CPU second (all threads; less moved by other processes on a
shared machine). ``--modes continuous`` times one engine; ``--modes continuous_nopark,continuous``
times continuous batching without and with parking rows (`SamplingEngine.park_rows`). All engines
must give the same tokens (checked against the first mode and printed).

Part 2 (compiles). A stream of ``--stream`` requests of mixed shapes (1-8 prompts of 3-60
tokens, n in {1, 2, 4, 8}, max_new_tokens in {8, 16, 32, 64, 128}, seeded) through a fresh
engine per mode: the distinct generate programs the engine ran (`SamplingEngine.program_shapes`:
one compile each), the XLA programs the process built meanwhile (`pdm_jax.profiling.CompileCounter`,
small helper programs included) and their seconds, and the stream's wall time.

Part 3 (``--part default_run``): the default run's request shapes (configs/tiny.py) through both
engines: milliseconds per request, same tokens, largest log mu difference.

Part 4 (``--part paged``): a decode step over the dense slot cache vs the same step reading a
paged cache through a page-table gather (XLA without a paged-attention kernel).

Reproduce (CPU, repository root):

    python bench/bench_continuous_batching.py            # both parts, ~5 min on 2 shared cores
    python bench/bench_continuous_batching.py --part throughput --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.profiling import CompileCounter
from pdm_jax.sampler.engine import SamplingEngine

MODES = ("static", "continuous")
ENGINE_KW = {"static": dict(batching="static"), "continuous": dict(batching="continuous"),
             "continuous_nopark": dict(batching="continuous", park_rows=0)}  # --modes choices


def make(a):
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=a.hidden // 4, max_position_embeddings=4096)
    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    return cfg, params


def engines(cfg, params, a, max_new, modes):
    return {m: SamplingEngine(cfg, params, quantization="none", max_prompt_length=64, max_new_tokens=max_new,
                              max_batch_size=a.slots, **ENGINE_KW[m]) for m in modes}


def throughput(a):
    cfg, params = make(a)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(8, a.vocab, a.prompt_len)) for _ in range(a.prompts)]
    stops = list(range(8))  # ids 0..7: ~1/64 of the mass of a near-uniform distribution
    work = {"mixed": dict(max_new_tokens=a.max_new, stop_token_ids=stops),
            "uniform": dict(max_new_tokens=a.uniform_len, stop_token_ids=[])}
    modes = a.modes.split(",")
    eng = engines(cfg, params, a, a.max_new, modes)
    gen = dict(n=a.n, temperature=1.0, seed=0, top_k_logprobs=a.k)
    first = {(m, w): eng[m].generate(prompts, **gen, **work[w]) for w in work for m in modes}  # compile round
    times = {key: [] for key in first}
    cpu = {key: [] for key in first}  # process CPU seconds (all threads): less moved by other processes' load
    steps, parked = {}, {}
    for _ in range(a.repeats):
        for key in first:
            m, w = key
            t0, c0 = time.perf_counter(), time.process_time()
            eng[m].generate(prompts, **gen, **work[w])
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
            steps[key] = eng[m].last_decode_steps
            parked[key], eng[m].parked_rows = eng[m].parked_rows, 0
    lengths = first[(modes[0], "mixed")].completion_mask.sum(1)
    print(f"# jax {jax.__version__} {jax.devices()[0].platform} x{len(jax.devices())}; tiny Qwen3 d={a.hidden} "
          f"L={a.layers} V={a.vocab}; {a.prompts} prompts x n={a.n} = {a.prompts * a.n} sequences, {a.slots} slots "
          f"(static: chunks of {a.slots}); prompt {a.prompt_len} tokens; K={a.k}; median of {a.repeats} rounds")
    print(f"# mixed lengths: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, max {lengths.max()} "
          f"(cap {a.max_new}); uniform: {a.uniform_len}")
    for w in work:
        for m in modes[1:]:
            same = np.array_equal(first[(modes[0], w)].completion_ids, first[(m, w)].completion_ids)
            print(f"# {w}: same tokens {modes[0]} vs {m}: {same}")
    print(f"{'engine':>17} {'workload':>9} {'useful tok':>11} {'seconds':>8} {'tok/s':>8} {'last-chunk steps':>17} "
          f"{'parked rows':>12}")
    rate = {}
    for key in first:
        m, w = key
        useful = int(first[key].completion_mask.sum())
        sec = statistics.median(times[key])
        rate[key] = useful / sec
        print(f"{m:>17} {w:>9} {useful:>11} {sec:>8.3f} {rate[key]:>8.0f} {steps[key]:>17} {parked[key]:>12}")
    for m in modes:
        useful = {w: int(first[(m, w)].completion_mask.sum()) for w in work}
        cpu_ratio = (useful["mixed"] / statistics.median(cpu[(m, "mixed")])
                     / (useful["uniform"] / statistics.median(cpu[(m, "uniform")])))
        per_round = sorted(useful["mixed"] / tm / (useful["uniform"] / tu)
                           for tm, tu in zip(times[(m, "mixed")], times[(m, "uniform")]))
        print(f"# {m}: mixed / uniform useful tokens/s = {rate[(m, 'mixed')] / rate[(m, 'uniform')]:.2f}x "
              f"(per interleaved round: min {per_round[0]:.2f}, median {statistics.median(per_round):.2f}, "
              f"max {per_round[-1]:.2f}); per process CPU second {cpu_ratio:.2f}x")
    for m in modes[1:]:
        print(f"# {m} / {modes[0]}: mixed {rate[(m, 'mixed')] / rate[(modes[0], 'mixed')]:.2f}x, "
              f"uniform {rate[(m, 'uniform')] / rate[(modes[0], 'uniform')]:.2f}x")


def stream(a):
    cfg, params = make(a)
    rng = np.random.default_rng(1)
    reqs = []
    for _ in range(a.stream):
        prompts = [list(rng.integers(8, a.vocab, int(rng.integers(3, 61)))) for _ in range(int(rng.integers(1, 9)))]
        reqs.append((prompts, dict(n=int(rng.choice([1, 2, 4, 8])),
                                   max_new_tokens=int(rng.choice([8, 16, 32, 64, 128])), temperature=1.0,
                                   seed=int(rng.integers(1 << 30)), top_k_logprobs=a.k, stop_token_ids=list(range(8)))))
    print(f"# stream of {a.stream} requests: 1-8 prompts of 3-60 tokens, n in 1/2/4/8, max_new_tokens in "
          f"8..128, {a.slots} slots / max batch")
    print(f"{'engine':>11} {'programs':>9} {'XLA compiles':>13} {'compile s':>10} {'wall s':>8} {'compile share':>14}")
    for m in a.modes.split(","):
        e = SamplingEngine(cfg, params, quantization="none", max_prompt_length=64, max_new_tokens=128,
                           max_batch_size=a.slots, **ENGINE_KW[m])
        counter = CompileCounter()
        t0 = time.perf_counter()
        for prompts, kw in reqs:
            e.generate(prompts, **kw)
        wall = time.perf_counter() - t0
        snap = counter.snapshot()
        print(f"{m:>11} {len(e.program_shapes):>9} {snap['compiles']:>13} {snap['compile_seconds']:>10.1f} "
              f"{wall:>8.1f} {snap['compile_seconds'] / wall:>13.0%}")


def default_run_shapes(a):
    """The default run's requests (configs/tiny.py: fp8 weights, f32 compute, 64 slots / max batch, 5 new tokens,
    K 4; random weights, 8-token prompts, stop id 2): rollouts 32 x 8, avg@4 200 x 4, greedy 200 x 1."""
    import sys

    sys.path.insert(0, "configs")
    import tiny

    from pdm_jax.config import model_config_from_fields

    c = tiny.get_config()
    cfg = model_config_from_fields(c.model, 15)
    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    eng = {m: SamplingEngine(cfg, params, batching=m, quantization="fp8", max_prompt_length=c.sampler.max_prompt_length,
                             max_new_tokens=c.rl.max_new_tokens, max_batch_size=c.sampler.max_batch_size)
           for m in MODES}
    rng = np.random.default_rng(0)
    reqs = {"rollout 32x8": (32, dict(n=8, temperature=1.0)), "avg@4 200x4": (200, dict(n=4, temperature=1.0)),
            "greedy 200x1": (200, dict(n=1, temperature=0.0))}
    print(f"# the default run's request shapes; median of {a.repeats} interleaved rounds")
    for name, (num, g) in reqs.items():
        prompts = [list(rng.integers(1, 15, 8)) for _ in range(num)]
        g = dict(g, max_new_tokens=c.rl.max_new_tokens, seed=1, stop_token_ids=[2], top_k_logprobs=c.rl.top_k_logprobs)
        outs = {m: e.generate(prompts, **g) for m, e in eng.items()}
        same = np.array_equal(outs["static"].completion_ids, outs["continuous"].completion_ids)
        dlp = float(np.abs(outs["static"].behavior_logprobs - outs["continuous"].behavior_logprobs).max())
        ts = {m: [] for m in eng}
        for _ in range(a.repeats):
            for m, e in eng.items():
                t0 = time.perf_counter()
                e.generate(prompts, **g)
                ts[m].append(time.perf_counter() - t0)
        s, cc = statistics.median(ts["static"]), statistics.median(ts["continuous"])
        print(f"{name:>13}: static {s * 1e3:7.1f} ms, continuous {cc * 1e3:7.1f} ms ({cc / s:.2f}x); "
              f"same tokens {same}, max |d log mu| {dlp:.1e}")


def paged_gather(a, steps=100, page=16):
    """One decode step over the dense slot cache vs the same step reading a paged cache: every layer's pages
    gathered through a page table into the dense [slots, K, H, S] view attention needs (what XLA does without a
    paged-attention kernel), then the new key/value written back to its page."""
    import jax.numpy as jnp

    from pdm_jax.models.qwen3 import KVCache

    cfg, params = make(a)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    b, s = a.slots, a.prompt_len + a.max_new
    n_pages = -(-s // page)
    kv, hd, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers

    def program(paged):
        def run(state, table):
            m = nnx.merge(graphdef, state)
            pool_k = tuple(jnp.zeros((b * n_pages, kv, hd, page)) for _ in range(layers))
            pool_v = tuple(jnp.zeros((b * n_pages, kv, page, hd)) for _ in range(layers))
            mask = jnp.ones((b, s), bool)

            def body(c):
                t, tok, cache, pk, pv = c
                col = t % s
                if paged:
                    cache = KVCache(
                        k=tuple(jnp.take(p, table, axis=0).transpose(0, 2, 3, 1, 4).reshape(b, kv, hd, -1)[..., :s]
                                for p in pk),
                        v=tuple(jnp.take(p, table, axis=0).transpose(0, 2, 1, 3, 4).reshape(b, kv, -1, hd)[:, :, :s]
                                for p in pv))
                logits, cache = m.decode(tok[:, None], jnp.full((b, 1), col), cache, jnp.full((b,), col), mask)
                if paged:
                    pg, off = table[:, col // page], col % page
                    pk = tuple(p.at[pg, :, :, off].set(k[:, :, :, col]) for p, k in zip(pk, cache.k))
                    pv = tuple(p.at[pg, :, off, :].set(v[:, :, col, :]) for p, v in zip(pv, cache.v))
                return t + 1, jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache, pk, pv
            init = (jnp.int32(0), jnp.zeros((b,), jnp.int32), m.init_cache(b, s), pool_k, pool_v)
            return jax.lax.while_loop(lambda c: c[0] < steps, body, init)[1]
        return jax.jit(run)

    table = jnp.asarray(np.random.default_rng(0).permutation(b * n_pages).reshape(b, n_pages), jnp.int32)
    fns = {name: program(name == "paged") for name in ("dense", "paged")}
    for f in fns.values():
        f(state, table).block_until_ready()
    ts = {name: [] for name in fns}
    for _ in range(max(a.repeats, 5)):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(state, table).block_until_ready()
            ts[name].append(time.perf_counter() - t0)
    d, p = (statistics.median(ts[n]) / steps * 1e3 for n in ("dense", "paged"))
    print(f"# decode step, {b} slots x {s} cache slots, pages of {page}: dense {d:.2f} ms, paged through a gather "
          f"{p:.2f} ms ({p / d:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("both", "throughput", "compiles", "default_run", "paged"), default="both")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--max_new", type=int, default=256)
    ap.add_argument("--uniform_len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream", type=int, default=40)
    ap.add_argument("--modes", default="static,continuous",
                    help=f"engines of the throughput part and the compile stream, of {sorted(ENGINE_KW)} "
                         "(continuous_nopark: continuous batching without parking rows)")
    a = ap.parse_args()
    if a.part in ("both", "throughput"):
        throughput(a)
    if a.part in ("both", "compiles"):
        stream(a)
    if a.part == "default_run":
        default_run_shapes(a)
    if a.part == "paged":
        paged_gather(a)


if __name__ == "__main__":
    main()
