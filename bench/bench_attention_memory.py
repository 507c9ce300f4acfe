"""Benchmark: compiled temp memory of attention fwd+bwd vs T (dense vs blockwise), and of remat vs layers.

Part 1, one attention layer. ``pdm_jax.models.qwen3.Attention`` (q/k/v/o projections,
q/k RMSNorm, RoPE and the attention kernel; small heads so it compiles fast) under
``jax.jit(jax.grad(...))`` w.r.t. its parameters and input, causal with a left-padding
mask. For each T it lowers and compiles on ``jax.ShapeDtypeStruct`` inputs (nothing is
allocated or run) and prints ``compiled.memory_analysis().temp_size_in_bytes`` (the
buffers XLA allocates besides arguments and outputs) in MiB, and the ratio
temp(T)/temp(T_0) and the growth per 1k tokens since the previous T. Dense attention
holds ``[B, K, G, T, T]`` f32 scores and probabilities (ratio ~ (T/T_0)^2, growth per 1k
tokens doubling with T); blockwise holds a fixed set of ``[B, K, G, block_q, block_kv]``
tiles plus O(T) vectors (temp = a + b T: constant growth per 1k tokens).

Part 2, an L-layer model (unrolled layers), fwd+bwd of a mean log-partition loss
w.r.t. all parameters, at one T, blockwise attention, for ``remat`` none vs full. Two
measures: the compiled XLA:CPU temp, and the bytes of the residuals the forward saves for
the backward (the leaves of ``jax.vjp``'s backward function, arguments excluded). Without
remat every layer's activations are residuals; with full remat only each layer's input
is. XLA:CPU does not honour remat: its pipeline drops the optimization barriers that
``jax.checkpoint`` inserts and CSE then merges the recomputation back into the forward
(a 4-layer toy compiles to the same 23 dots and the same temp with and without
``jax.checkpoint``), so its temp hardly moves; GPU and TPU compilers keep the barriers,
and there the residual column is what the backward holds. (With the layers scanned, the
default, remat holds on CPU too: see ``bench/bench_scan_layers.py``.)

Reproduce (CPU, repository root; ~2-4 minutes):

    python bench/bench_attention_memory.py
    python bench/bench_attention_memory.py --seqs 1024,2048 --layers 2,4   # quicker
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from pdm_jax.models.attention import AttentionOptions, SelfAttentionMask
from pdm_jax.models.qwen3 import Attention, Qwen3Config, Qwen3ForCausalLM


def _config(hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True)


def attention_temp_mib(cfg: Qwen3Config, batch: int, seq: int, impl: str, block: int) -> float:
    """Temp MiB of jit(grad) of one Attention layer (params and x) at [batch, seq]."""
    module = nnx.eval_shape(lambda: Attention(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_params = nnx.split(module)
    options = AttentionOptions(impl, block, block)

    def loss(params, x_BxTxD, positions_BxT, valid_BxT):
        out, _ = nnx.merge(graphdef, params)(x_BxTxD, positions_BxT, SelfAttentionMask(valid_BxT),
                                              attention=options)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    s = jax.ShapeDtypeStruct
    args = (abs_params, s((batch, seq, cfg.hidden_size), jnp.float32), s((batch, seq), jnp.int32),
            s((batch, seq), jnp.bool_))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def _residual_mib(fn, *args) -> float:
    """MiB of the forward's saved residuals for the backward of ``fn(*args)``, arguments excluded.

    The residuals are the leaves of ``jax.vjp``'s backward function: the outputs of
    ``make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])`` that are not its inputs (e.g. weights).
    """
    leaves, tree = jax.tree.flatten(args)

    def backward_fn(*flat):
        return jax.vjp(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), *flat)[1]

    jaxpr = jax.make_jaxpr(backward_fn)(*leaves).jaxpr
    inputs = set(jaxpr.invars)
    saved = {v for v in jaxpr.outvars if not hasattr(v, "val") and v not in inputs}
    return sum(v.aval.size * v.aval.dtype.itemsize for v in saved) / 2 ** 20


def model_mib(cfg: Qwen3Config, batch: int, seq: int, remat: str, block: int) -> tuple[float, float]:
    """(XLA temp MiB, saved-residual MiB) of jit(grad) of the whole model (blockwise attention)."""
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), attention="blockwise",
                                                    remat=remat, attention_block_q=block,
                                                    attention_block_kv=block, scan_layers=False))
    graphdef, abs_params = nnx.split(model)

    def loss(params, ids_BxT, mask_BxT):
        logits = nnx.merge(graphdef, params)(ids_BxT, attention_mask=mask_BxT)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    s = jax.ShapeDtypeStruct
    args = (abs_params, s((batch, seq), jnp.int32), s((batch, seq), jnp.bool_))
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    return temp, _residual_mib(loss, *args)


def _growth_per_1k(table: list, key: str) -> str:
    """MiB per 1k tokens between the last two rows: constant = linear in T, growing = faster."""
    if len(table) < 2:
        return ""
    prev, last = table[-2], table[-1]
    return f"{(last[key] - prev[key]) / (last['T'] - prev['T']) * 1024:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=16)
    ap.add_argument("--block", type=int, default=512, help="blockwise block_q = block_kv")
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--layers", default="2,4,8")
    ap.add_argument("--model_seq", type=int, default=2048)
    ap.add_argument("--model_hidden", type=int, default=256)
    ap.add_argument("--json", default="", help="also write both tables to this JSON file")
    a = ap.parse_args()
    t0 = time.time()
    cfg = _config(a.hidden, a.heads, a.kv_heads, a.head_dim, 1)
    seqs = [int(x) for x in a.seqs.split(",")]
    print(f"# jax {jax.__version__} {jax.devices()[0].platform}; one Attention layer D={a.hidden} "
          f"N={a.heads} K={a.kv_heads} H={a.head_dim}, B={a.batch}, f32, fwd+bwd; compiled temp MiB; "
          f"blockwise tiles {a.block}x{a.block}")
    print(f"{'T':>6} {'dense':>10} {'blockwise':>10} {'dense/T0':>9} {'block/T0':>9} "
          f"{'(T/T0)':>7} {'(T/T0)^2':>9} {'dense d/1k':>11} {'block d/1k':>11}")
    table = []
    for t in seqs:
        dense, block = (attention_temp_mib(cfg, a.batch, t, impl, a.block)
                        for impl in ("dense", "blockwise"))
        table.append({"T": t, "dense_mib": dense, "blockwise_mib": block})
        r = t / seqs[0]
        slopes = [_growth_per_1k(table, key) for key in ("dense_mib", "blockwise_mib")]
        print(f"{t:>6} {dense:>10.2f} {block:>10.2f} {dense / table[0]['dense_mib']:>9.2f} "
              f"{block / table[0]['blockwise_mib']:>9.2f} {r:>7.1f} {r * r:>9.1f} "
              f"{slopes[0]:>11} {slopes[1]:>11}", flush=True)
    layers = [int(x) for x in a.layers.split(",")]
    print(f"\n# model fwd+bwd, D={a.model_hidden} N={a.heads} K={a.kv_heads} H={a.head_dim}, "
          f"T={a.model_seq}, B={a.batch}, blockwise attention, unrolled layers; MiB")
    print(f"{'':>6} {'XLA:CPU temp':>23} {'saved residuals':>23}")
    print(f"{'layers':>6} {'none':>11} {'full':>11} {'none':>11} {'full':>11}")
    remat_table = []
    for n in layers:
        mcfg = _config(a.model_hidden, a.heads, a.kv_heads, a.head_dim, n)
        (t_none, r_none), (t_full, r_full) = (model_mib(mcfg, a.batch, a.model_seq, r, a.block)
                                              for r in ("none", "full"))
        remat_table.append({"layers": n, "temp_none_mib": t_none, "temp_full_mib": t_full,
                            "residuals_none_mib": r_none, "residuals_full_mib": r_full})
        print(f"{n:>6} {t_none:>11.2f} {t_full:>11.2f} {r_none:>11.2f} {r_full:>11.2f}", flush=True)
    print(f"# {time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"attention": table, "remat": remat_table}, f, indent=2)


if __name__ == "__main__":
    main()
