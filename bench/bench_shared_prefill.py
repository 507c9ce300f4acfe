"""Benchmark: shared prefill — n samples per prompt prefilled once vs once per row, side by side.

Two ``SamplingEngine``s on the same random tiny Qwen3 (f32), one with ``share_prefill=True``
(the default: each prompt's KV cache is computed once and repeated for its n rows) and one
with ``share_prefill=False``. For ``--prompts`` prompts of ``--prompt_len`` tokens and
n = ``--n`` samples, ``--new_tokens`` new tokens each, it reports:

* prompt rows prefilled (the engines' ``prefill_rows`` counters; padding rows included) and
  the prefill FLOPs of XLA's cost model for one decode call over those rows (the model's
  ``decode`` on [rows, P] prompts, compiled on its own);
* the median wall time of ``generate`` over ``--repeats`` interleaved rounds (after one
  compile round), and the ratio shared / per-row;
* whether both produced the same tokens (they must: tests/test_sampler_engine.py).

Reproduce (CPU, repository root; ~1 minute):

    python bench/bench_shared_prefill.py
    python bench/bench_shared_prefill.py --prompt_len 512 --n 8 --prompts 4 --new_tokens 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler.engine import SamplingEngine


def prefill_flops(model: Qwen3ForCausalLM, rows: int, prompt_len: int) -> float:
    """XLA cost-model FLOPs of ``model.decode`` over a [rows, prompt_len] prompt into an empty cache."""
    graphdef, state = nnx.split(model)

    def prefill(state, ids):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(rows, prompt_len)
        pos = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), ids.shape)
        return m.decode(ids, pos, cache, jnp.int32(0), jnp.ones((rows, prompt_len), bool))[0][:, -1]

    ids = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32)
    cost = jax.jit(prefill).lower(state, ids).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=256)
    ap.add_argument("--new_tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=a.hidden // 4, max_position_embeddings=a.prompt_len + a.new_tokens + 64)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, a.vocab, a.prompt_len)) for _ in range(a.prompts)]
    kw = dict(max_prompt_length=a.prompt_len, max_new_tokens=max(a.new_tokens, 16),
              max_batch_size=a.prompts * a.n, min_new_tokens_bucket=16)
    engines = {"shared": SamplingEngine(cfg, params, **kw),
               "per_row": SamplingEngine(cfg, params, share_prefill=False, **kw)}
    gen = dict(n=a.n, max_new_tokens=a.new_tokens, temperature=1.0, seed=0, top_k_logprobs=4)
    outs = {name: e.generate(prompts, **gen) for name, e in engines.items()}  # compile round
    rows = {name: e.prefill_rows for name, e in engines.items()}
    times = {name: [] for name in engines}
    for _ in range(a.repeats):
        for name, e in engines.items():
            t0 = time.perf_counter()
            e.generate(prompts, **gen)
            times[name].append(time.perf_counter() - t0)
    same = np.array_equal(outs["shared"].completion_ids, outs["per_row"].completion_ids)
    print(f"# jax {jax.__version__} {jax.devices()[0].platform}; tiny Qwen3 d={a.hidden} L={a.layers} V={a.vocab}, "
          f"{a.prompts} prompts x n={a.n} samples, prompt {a.prompt_len} tokens, {a.new_tokens} new tokens; "
          f"median of {a.repeats} interleaved rounds")
    print(f"{'engine':>8} {'rows prefilled':>15} {'prefill GFLOP':>14} {'generate s':>11}")
    for name in engines:
        flops = prefill_flops(model, rows[name], a.prompt_len)
        print(f"{name:>8} {rows[name]:>15} {flops / 1e9:>14.3f} {statistics.median(times[name]):>11.3f}")
    print(f"# shared / per-row: rows {rows['shared'] / rows['per_row']:.3f}, generate time "
          f"{statistics.median(times['shared']) / statistics.median(times['per_row']):.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
