"""Benchmark: compiled temp memory of the RL loss + gradient, unchunked vs sequence-chunked, vs T.

A 1-layer Qwen3 with the real vocabulary (V = 151,936; hidden size 64 so it
compiles on a CPU) computes the PDM (top-K KL, bucket_exact) truncated-IS loss
and its gradient w.r.t. all parameters, through ``train_step.make_rl_loss``:

* ``unchunked``: all ``[B,T,V]`` f32 logits at once (``logits_chunk_size=0``);
* ``chunk=c``:  ``pdm_jax.rl.chunked_loss`` (scan over c positions, remat).

For each completion length T it lowers and compiles the jitted
``value_and_grad`` on abstract inputs (nothing is allocated) and prints
``compiled.memory_analysis().temp_size_in_bytes`` in MiB: the buffers XLA
allocates besides arguments and outputs. The unchunked temp grows linearly
with T (several [B,T,V] f32 buffers); the chunked one stays near the
``[B,c,V]`` cost of one chunk.

Reproduce (CPU, repository root; ~1-2 minutes):

    python bench/bench_chunked_memory.py
    python bench/bench_chunked_memory.py --seqs 256,1024 --chunks 128   # quicker
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


def temp_mib(graphdef, abs_params, batch: int, prompt: int, seq: int, top_k: int, chunk: int) -> tuple[float, float]:
    """(temp MiB, compile seconds) of jit(value_and_grad(RL loss)) for one shape and chunk size (0 = unchunked)."""
    tr = trust_region.TrustRegionConfig(mask="pdm", estimator="bucket_exact")
    loss = ts.make_rl_loss(graphdef, tr, PolicyLossConfig(max_response_length=seq, logits_chunk_size=chunk))
    s = jax.ShapeDtypeStruct
    args = StepBatch(prompt_ids=s((batch, prompt), jnp.int32), prompt_mask=s((batch, prompt), jnp.bool_),
                     completion_ids=s((batch, seq), jnp.int32), completion_mask=s((batch, seq), jnp.bool_),
                     behavior_logprobs=s((batch, seq), jnp.float32), topk_ids=s((batch, seq, top_k), jnp.int32),
                     topk_logprobs=s((batch, seq, top_k), jnp.float32), advantages=s((batch,), jnp.float32))
    t0 = time.time()
    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(abs_params, args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--seqs", default="256,512,1024,2048")
    ap.add_argument("--chunks", default="128,256")
    ap.add_argument("--json", default="", help="also write the table to this JSON file")
    a = ap.parse_args()
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=a.hidden // 2, tie_word_embeddings=True)
    graphdef, abs_params = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    seqs = [int(x) for x in a.seqs.split(",")]
    chunks = [0] + [int(x) for x in a.chunks.split(",")]
    print(f"# jax {jax.__version__} {jax.devices()[0].platform}; V={a.vocab} D={a.hidden} 1 layer, B={a.batch}, "
          f"P={a.prompt}, K={a.topk}; PDM bucket_exact loss + grad; compiled temp MiB")
    names = ["unchunked" if c == 0 else f"chunk={c}" for c in chunks]
    print(f"{'T':>6} " + " ".join(f"{n:>12}" for n in names) + f" {'[B,T,V] f32':>12}")
    rows = []
    for t in seqs:
        vals = [temp_mib(graphdef, abs_params, a.batch, a.prompt, t, a.topk, c)[0] for c in chunks]
        logits = a.batch * t * a.vocab * 4 / 2 ** 20
        print(f"{t:>6} " + " ".join(f"{v:>12.1f}" for v in vals) + f" {logits:>12.1f}", flush=True)
        rows.append(dict(T=t, logits_mib=logits, **{n: v for n, v in zip(names, vals)}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
