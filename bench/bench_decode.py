"""Rollout engine decode at two model shapes, this tree beside a baseline revision, in one run.

Each side runs in its own process (the baseline's package from a ``git worktree`` of ``--baseline``,
this file's measuring code for both), the processes alternate over ``--rounds`` rounds, and each
figure is the best over all rounds. Per shape and batch size it prints tokens/s, process CPU time
per generated token, the first call's seconds (trace + compile + run), the compile seconds within it (JAX's
tracing, lowering and XLA compile durations, from ``jax.monitoring``) and whether both sides sampled the same
tokens and log-probabilities bit for bit (a SHA-256 of the outputs). With a baseline, the ratio columns are
this tree's tokens/s over the baseline's (of the best rounds, and the median of the per-round ratios with a
distribution-free 95% interval of that median, `bench_stats.median_ci95`: single rounds on a 2-core machine move
by 30%, so a ratio near 1 needs 15 rounds or more to be read), and this tree's first-call and compile seconds over
the baseline's (below 1: this tree compiles faster).

Shapes (random f32 weights, ``quantization="none"``, the engine's default batching, prompts of
16 tokens, 128 new tokens each, temperature 1, top-K 20 log-probs):

- ``tiny``: V 512, d 128, 3 layers, 4 / 2 heads;
- ``large``: V 4096, d 512, 8 layers, 4 / 2 heads, MLP 1536.

    python bench/bench_decode.py --baseline HEAD~1 [--rounds 2 --repeats 3 --batches 1,8,32]
    python bench/bench_decode.py --baseline HEAD~1 --shapes tiny --batches 32 --rounds 15   # one ratio, its interval
    python bench/bench_decode.py                 # this tree alone
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"tiny": dict(vocab=512, hidden=128, layers=3), "large": dict(vocab=4096, hidden=512, layers=8)}
PROMPT, NEW, TOP_K = 16, 128, 20

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stats import median_ci95  # noqa: E402


def worker(shapes, batches, repeats) -> dict:
    """Measures the engine of the `pdm_jax` on ``sys.path``; returns {shape/batch: figures}."""
    import numpy as np
    from flax import nnx

    import pdm_jax
    from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from pdm_jax.sampler.engine import SamplingEngine

    import jax

    compile_s = [0.0]
    stages = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def on_duration(event, seconds, **_):
        if event in stages:
            compile_s[0] += seconds
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    out = {"package": os.path.dirname(pdm_jax.__file__)}
    for name in shapes:
        s = SHAPES[name]
        h = s["hidden"]
        config = Qwen3Config(vocab_size=s["vocab"], hidden_size=h, intermediate_size=3 * h,
                             num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=2,
                             head_dim=h // 4, max_position_embeddings=4096)
        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)), nnx.Param))
        engine = SamplingEngine(config, params, quantization="none", max_prompt_length=PROMPT, max_new_tokens=NEW,
                                max_batch_size=max(batches), min_prompt_bucket=PROMPT)
        for b in batches:
            prompts = np.random.default_rng(b).integers(0, s["vocab"], size=(b, PROMPT)).tolist()

            def go():
                return engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=NEW, top_k_logprobs=TOP_K,
                                       seed=1)
            compile_s[0] = 0.0
            t0 = time.perf_counter()
            batch = go()
            first = time.perf_counter() - t0
            compiling = compile_s[0]
            digest = hashlib.sha256()
            for a in (batch.completion_ids, batch.completion_mask, batch.behavior_logprobs, batch.topk_ids,
                      batch.topk_logprobs):
                digest.update(np.ascontiguousarray(a).tobytes())
            walls, cpus = [], []
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                go()
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
            tokens = b * NEW
            out[f"{name}/{b}"] = dict(wall=min(walls), cpu_per_token=min(cpus) / tokens, first_call=first,
                                      compile=compiling, tokens=tokens, digest=digest.hexdigest())
    return out


def _run_worker(tree, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shapes", args.shapes, "--batches", args.batches,
           "--repeats", str(args.repeats)]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"worker in {tree} failed:\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    if os.path.realpath(result["package"]) != os.path.realpath(os.path.join(tree, "pdm_jax")):
        sys.exit(f"worker in {tree} imported pdm_jax from {result['package']}")
    return result


def _merge(best, result):
    for key, v in result.items():
        if key == "package":
            continue
        if key in best and best[key]["digest"] != v["digest"]:
            sys.exit(f"{key}: one tree sampled different tokens in two rounds")
        if key not in best:
            best[key] = dict(v)
        else:
            for f in ("wall", "cpu_per_token", "first_call", "compile"):
                best[key][f] = min(best[key][f], v[f])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="", help="a git revision to measure beside this tree")
    ap.add_argument("--shapes", default="tiny,large")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        print(json.dumps(worker(shapes, batches, args.repeats)))
        return
    trees = {"this tree": REPO}
    tmp = None
    if args.baseline:
        tmp = tempfile.mkdtemp(prefix="pdm_bench_baseline_")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tmp, args.baseline], check=True,
                       capture_output=True)
        trees = {f"baseline {args.baseline}": tmp, "this tree": REPO}
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"bench_decode: this tree at {rev.strip()} (+ uncommitted changes if any), CPU x{os.cpu_count()}, "
          f"{args.rounds} rounds x {args.repeats} repeats, best of all; prompts {PROMPT}, {NEW} new tokens")
    best = {name: {} for name in trees}
    walls = {name: [] for name in trees}  # per round: {shape/batch: the round's best wall}
    try:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                result = _run_worker(trees[name], args)
                _merge(best[name], result)
                walls[name].append({k: v["wall"] for k, v in result.items() if k != "package"})
                print(f"round {r + 1} of {args.rounds}: {name} measured", file=sys.stderr, flush=True)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tmp], capture_output=True)
    names = list(trees)
    head = f"{'shape':>6s} {'B':>3s}"
    for n in names:
        head += f" | {n + ' tok/s':>22s} {'CPU us/tok':>10s} {'1st call s':>10s} {'compile s':>9s}"
    if len(names) == 2:
        head += " | tok/s ratio  1st call ratio  compile ratio  same tokens | median round ratio (95% interval)"
    print(head)
    for s in shapes:
        for b in batches:
            key = f"{s}/{b}"
            row = f"{s:>6s} {b:3d}"
            for n in names:
                v = best[n][key]
                row += (f" | {v['tokens'] / v['wall']:22.0f} {v['cpu_per_token'] * 1e6:10.1f} {v['first_call']:10.2f}"
                        f" {v['compile']:9.2f}")
            if len(names) == 2:
                a, c = best[names[0]][key], best[names[1]][key]
                ratio = lambda f: c[f] / a[f] if a[f] > 0 else float("nan")  # noqa: E731  this tree / baseline
                row += (f" | {a['wall'] / c['wall']:10.2f}x  {ratio('first_call'):13.2f}x  {ratio('compile'):12.2f}x"
                        f"  {'yes' if a['digest'] == c['digest'] else 'NO'}")
                per_round = [wa[key] / wc[key] for wa, wc in zip(walls[names[0]], walls[names[1]])]
                low, high = median_ci95(per_round)
                row += f" | {statistics.median(per_round):.2f}x ({low:.2f}-{high:.2f}, {len(per_round)} rounds)"
            print(row, flush=True)


if __name__ == "__main__":
    main()
