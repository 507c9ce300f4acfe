"""Benchmark: compiled memory of the MoE grouped matmul, ``ragged_dot`` vs ``blocked``, per compiler.

One expert matmul of the 30B-A3B shape (M = tokens x top-k assignments sorted by expert, D 2048,
E 128 experts, I 768; bf16) as the MoE layer runs it three ways: forward, the gradient of its
input, the gradient of its kernels. Each is lowered on ``jax.ShapeDtypeStruct`` inputs and
compiled (nothing is allocated or run) by XLA:CPU and, where the CUDA PJRT plugin is installed
(``pip install -e '.[gpu-aot]'``), by XLA:GPU deviceless for one H100 (`pdm_jax.aot`). It prints
``memory_analysis().temp_size_in_bytes`` in GiB side by side and the ratio ragged_dot / blocked.
XLA:GPU lowers ``ragged_dot`` as a dense dot over an E-fold expanded input; ``blocked``
(`pdm_jax.models.moe.blocked_gmm`) keeps the padded rows and a few kernels. Memory only: no
speed is measured (no GPU here).

Reproduce (repository root; ~1 minute):

    python bench/bench_moe_memory.py
    python bench/bench_moe_memory.py --tokens 1024     # M = 8192 assignments at top-8 (default 1024)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdm_jax import aot, dry_run
from pdm_jax.models import moe


def programs(M: int, D: int, I: int, E: int):  # noqa: E741 (I: the MLP's intermediate size)
    """name -> (function, abstract args) for forward, d input and d kernels of each implementation."""
    x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((E, D, I), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((E,), jnp.int32)
    dy = jax.ShapeDtypeStruct((M, I), jnp.bfloat16)
    out = {}
    for name, mm in (("ragged_dot", jax.lax.ragged_dot), ("blocked", moe.blocked_gmm)):
        out[name] = {
            "forward": (lambda x, w, gs, mm=mm: mm(x, w, gs), (x, w, gs)),
            "d input": (lambda dy, w, gs, mm=mm:
                        jax.vjp(lambda a: mm(a, w, gs), jnp.zeros((M, D), jnp.bfloat16))[1](dy)[0], (dy, w, gs)),
            "d kernels": (lambda x, dy, gs, mm=mm:
                          jax.vjp(lambda b: mm(x, b, gs), jnp.zeros((E, D, I), jnp.bfloat16))[1](dy)[0], (x, dy, gs)),
        }
    return out


def temp_gib(fn, args, device) -> float:
    sharding = NamedSharding(Mesh([device], ("x",)), P())
    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args)
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--top_k", type=int, default=8)
    args = ap.parse_args()
    M, D, I, E = args.tokens * args.top_k, 2048, 768, 128  # noqa: E741 (I: the MLP's intermediate size)
    dry_run.prepare_devices(1)  # JAX on CPU, as the dry run: the CUDA plugin then compiles deviceless for H100
    targets = [("XLA:CPU", jax.devices("cpu")[0])]
    if aot.compiler_available("gpu"):
        targets.append(("XLA:GPU H100", aot.target_devices("gpu", "H100", 1, None)[0]))
    else:
        print("(XLA:GPU skipped: pip install -e '.[gpu-aot]')")
    progs = programs(M, D, I, E)
    print(f"M {M} assignments, D {D}, E {E}, I {I}, bf16; temp GiB per program")
    print(f"{'compiler':14s} {'program':10s} {'ragged_dot':>11s} {'blocked':>9s} {'ratio':>7s}")
    for label, device in targets:
        for part in ("forward", "d input", "d kernels"):
            r = temp_gib(*progs["ragged_dot"][part], device)
            b = temp_gib(*progs["blocked"][part], device)
            print(f"{label:14s} {part:10s} {r:11.3f} {b:9.3f} {r / max(b, 1e-9):7.1f}")


if __name__ == "__main__":
    main()
