"""Where an RL step's time goes, phase by phase, beside the floor each phase is compared with.

Reads the ``time_*`` metrics of a run's ``metrics.jsonl`` (`pdm_jax.profiling.PhaseTimer`,
docs/metrics.md) -- from ``--workdir`` of a finished or running job, or from a
short run of the default config that this script starts first (``--run``) -- and prints,
per phase, the median over the steady RL steps (the first ``--skip`` steps compile), its
share of the step, and a floor measured or computed on this machine:

* sampling: the decode's matmul FLOPs (2 x matmul parameters per generated or prompt
  token, the step's rollouts) at the measured f32 matmul rate;
* optimizer: the training matmul FLOPs (6 x matmul parameters x padded tokens of the
  rollout batch, ``rl.num_iterations`` passes) at the same rate;
* weight_sync: writing the same bytes raw (``numpy.tofile``) into the run directory's
  file system and reading them back, median of 21 (the sampler's copy cannot be faster
  than a raw write + read; shared memory would remove the file system, not the copy);
* checkpoint: the raw write of parameters + two Adam moments (3x the parameter bytes);
* scoring, advantages: host Python over 256 short strings / arrays, no hardware floor.

The matmul rate is the best of 5 runs of a jitted f32 ``[1024,1024] @ [1024,1024]``.
Attention and the logit softmax are left out of the FLOP floors (they are a few % of
the tiny model's matmuls), so the floors are lower bounds.

    python bench/bench_step_breakdown.py --workdir runs/tiny          # an existing run
    python bench/bench_step_breakdown.py --run --steps 30             # a short tiny run first
    python bench/bench_step_breakdown.py --run --config.compile_cache.dir=   # --config.* flags go to the run
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

PHASES = ("sampling", "scoring", "advantages", "optimizer", "weight_sync", "eval", "checkpoint", "other")


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` rate of a jitted f32 n x n x n matmul (GFLOP/s)."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def raw_io_seconds(directory: str, nbytes: int, repeats: int = 21) -> tuple:
    """Median (write, write + read) seconds of `nbytes` raw bytes through a file in `directory`."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    writes, both = [], []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for i in range(repeats):
            path = os.path.join(tmp, f"raw{i}.bin")
            t0 = time.perf_counter()
            data.tofile(path)
            t1 = time.perf_counter()
            back = np.fromfile(path, np.uint8)
            t2 = time.perf_counter()
            assert back.size == nbytes
            writes.append(t1 - t0)
            both.append(t2 - t0)
            if i >= 2:
                os.remove(os.path.join(tmp, f"raw{i - 2}.bin"))
    return float(np.median(writes)), float(np.median(both))


def model_sizes(workdir: str) -> dict:
    """Matmul and total parameter counts of the run's model (``WORKDIR/model/config.json``)."""
    hf = json.load(open(os.path.join(workdir, "model", "config.json")))
    d, f, n_layers, v = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    n, k = hf["num_attention_heads"], hf["num_key_value_heads"]
    h = hf.get("head_dim") or d // n
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    matmul = n_layers * per_layer + d * v  # + lm_head (tied or not: one logit matmul)
    norms = n_layers * (2 * d + 2 * h) + d
    total = n_layers * per_layer + v * d * (1 if hf.get("tie_word_embeddings", True) else 2) + norms
    return dict(matmul=matmul, total=total)


def run_short(workdir: str, steps: int, sft_steps: int, extra: list) -> None:
    cmd = [sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", f"--workdir={workdir}",
           f"--config.rl.steps={steps}", f"--config.sft.steps={sft_steps}", "--config.log.progress=false",
           f"--config.eval.every_steps={steps}", f"--config.checkpoint.every_steps={max(steps // 2, 1)}"] + extra
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="", help="a run directory (default with --run: a new temporary one)")
    ap.add_argument("--run", action="store_true", help="first run configs/tiny.py for --steps RL steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sft_steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=2, help="first RL steps left out of the medians (compiles)")
    ap.add_argument("--prompt_tokens", type=int, default=8, help="padded prompt length of the rollouts (tokens)")
    args, extra = ap.parse_known_args()  # the rest: --config.x=y flags for --run
    if any(not e.startswith("--config.") for e in extra):
        ap.error(f"unrecognized arguments: {' '.join(e for e in extra if not e.startswith('--config.'))} "
                 "(only --config.x=y flags are passed on to the run)")
    args.extra = extra
    workdir = args.workdir or (tempfile.mkdtemp(prefix="pdm_breakdown_") if args.run else "")
    if not workdir:
        ap.error("give --workdir, or --run")
    if args.run:
        run_short(workdir, args.steps, args.sft_steps, args.extra)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    rl = sorted((r for r in records if r.get("phase") == "rl"), key=lambda r: r["step"])
    if not rl or "time_sampling" not in rl[0]:
        sys.exit(f"{workdir}/metrics.jsonl has no rl records with time_* fields (a run of older code?)")
    steady = rl[args.skip:] or rl
    config = json.load(open(os.path.join(workdir, "config.json")))
    sizes = model_sizes(workdir)
    rollouts = config["rl"]["prompts_per_step"] * config["rl"]["group_size"]
    new = float(np.median([r["response_length"] for r in steady]))
    gflops = matmul_gflops()
    padded = rollouts * (args.prompt_tokens + config["rl"]["max_new_tokens"])
    decode_flops = 2 * sizes["matmul"] * rollouts * (args.prompt_tokens + new)
    train_flops = 6 * sizes["matmul"] * padded * config["rl"]["num_iterations"]
    param_bytes = 4 * sizes["total"]
    write_s, io_s = raw_io_seconds(workdir, param_bytes)
    ckpt_s, _ = raw_io_seconds(workdir, 3 * param_bytes, repeats=7)
    floors = dict(sampling=(decode_flops / gflops / 1e9, f"{decode_flops / 1e9:.2f} GFLOP decode matmuls"),
                  optimizer=(train_flops / gflops / 1e9, f"{train_flops / 1e9:.2f} GFLOP training matmuls"),
                  weight_sync=(io_s,
                               f"raw write+read of {param_bytes / 1e6:.1f} MB (write alone {1e3 * write_s:.1f} ms)"),
                  checkpoint=(ckpt_s, f"raw write of {3 * param_bytes / 1e6:.1f} MB (params + Adam moments)"))
    med = {p: float(np.median([r[f"time_{p}"] for r in steady])) for p in PHASES}
    evals = [r["time_eval"] for r in steady if r["time_eval"] > 0]
    ckpts = [r["time_checkpoint"] for r in steady if r["time_checkpoint"] > 0]
    step = float(np.median([r["step_seconds"] for r in steady]))
    print(f"\n{workdir}: {len(rl)} RL steps, medians over steps {steady[0]['step']}..{steady[-1]['step']}; "
          f"{sizes['total'] / 1e6:.2f}M parameters ({sizes['matmul'] / 1e6:.2f}M in matmuls), {rollouts} rollouts "
          f"of {new:.1f} new tokens; f32 matmul rate {gflops:.0f} GFLOP/s on this CPU")
    print(f"\n{'phase':>12s} {'median ms':>10s} {'of step':>8s} {'floor ms':>9s} {'x floor':>8s}  floor")
    for p in PHASES:
        value = med[p]
        if p == "eval" and evals:
            value = float(np.median(evals))
        if p == "checkpoint" and ckpts:
            value = float(np.median(ckpts))
        share = f"{100 * med[p] / step:7.1f}%" if p not in ("eval", "checkpoint") else f"{'(*)':>8s}"
        floor, what = floors.get(p, (None, "-"))
        ratio = f"{value / floor:8.1f}" if floor else f"{'-':>8s}"
        fl = f"{1e3 * floor:9.2f}" if floor else f"{'-':>9s}"
        print(f"{p:>12s} {1e3 * value:10.2f} {share} {fl} {ratio}  {what}")
    sync = [r["time_weight_save"] for r in steady], [r["time_weight_load"] for r in steady]
    print(f"\nweight sync = save {1e3 * np.median(sync[0]):.2f} ms + load {1e3 * np.median(sync[1]):.2f} ms (medians)")
    print(f"RL step (step_seconds, without eval/checkpoint): median {1e3 * step:.1f} ms; "
          f"sum of the matmul floors {1e3 * (floors['sampling'][0] + floors['optimizer'][0]):.1f} ms")
    first = rl[0]
    print(f"compiles up to the end of RL step 1: trainer {first['compiles']:.0f} programs in "
          f"{first['compile_seconds']:.1f} s ({first['compile_cache_hits']:.0f} from the cache), sampler "
          f"{first['sampler_compiles']:.0f} in {first['sampler_compile_seconds']:.1f} s "
          f"({first['sampler_compile_cache_hits']:.0f} from the cache)")
    print("(*) eval and checkpoint: median over the steps that ran one; not part of step_seconds")


if __name__ == "__main__":
    main()
