"""Digests of the continuous-batching engine's outputs, to show that a change of the engine keeps its tokens.

Runs `SamplingEngine.generate` (``batching="continuous"``, 4 slots, cache phases of 8 / 16 / 32 / 64 new
tokens, so every piece of `_continuous_program` runs: admission, the cache phases and their changes, parking, the
tail's levels, shared and per-row prefill, MoE routing replay, and the single-row requests' own program) over 24
requests of a tiny random dense and MoE Qwen3, and prints one SHA-256 (first 16 hex digits) per request of its
tokens, log mu, top-K ids and log mu, completion mask, finish reasons (and routed experts), with the decode steps
and rows parked.

    python scripts/engine_digest.py                     # this tree
    python scripts/engine_digest.py --baseline HEAD~1   # this tree and a revision (a git worktree), compared

With ``--baseline`` it exits 1 unless both sides print the same lines.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digests() -> list:
    """One line per request: the configuration, the outputs' digest, decode steps and rows parked so far."""
    import numpy as np
    from flax import nnx

    from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from pdm_jax.sampler.engine import SamplingEngine

    def digest(rb) -> str:
        h = hashlib.sha256()
        for a in (rb.completion_ids, rb.behavior_logprobs, rb.topk_ids, rb.topk_logprobs, rb.completion_mask,
                  np.asarray(rb.finish_reason).astype(str)):
            h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
        if rb.routed_experts is not None:
            h.update(np.ascontiguousarray(rb.routed_experts).tobytes())
        return h.hexdigest()[:16]

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    models = {"dense": Qwen3Config(**shape),
              "moe": Qwen3Config(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=int(n)).tolist() for n in rng.integers(2, 15, size=6)]
    requests = (dict(temperature=1.0, stop_token_ids=[3, 7], n=3), dict(temperature=0.8, top_p=0.9, top_k=10, n=2),
                dict(temperature=0.0, n=1, stop_token_ids=[5]),
                dict(temperature=1.0, n=1, stop_token_ids=[3], prompts=1))  # 1 row: the small requests' program
    lines = []
    for name, cfg in models.items():
        params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        for park in (0, 2):
            for share in ((True, False) if name == "dense" else (True,)):
                engine = SamplingEngine(cfg, params, quantization="none", max_prompt_length=16, max_new_tokens=64,
                                        max_batch_size=4, max_slots=4, batching="continuous", park_rows=park,
                                        share_prefill=share)
                engine.min_cache_phase = 8
                for kw in requests:
                    kw = dict(kw)
                    rb = engine.generate(prompts[:kw.pop("prompts", len(prompts))], max_new_tokens=64,
                                         top_k_logprobs=5, seed=11,
                                         **kw, **(dict(return_routing=True) if name == "moe" else {}))
                    lines.append(f"{name} park={park} shared_prefill={share} {kw} rows={rb.num_sequences}: "
                                 f"{digest(rb)} "
                                 f"steps={engine.last_decode_steps} parked={engine.parked_rows}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a git revision to compare with (run from its worktree)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker or not args.baseline:
        import pdm_jax
        print("\n".join(digests()), flush=True)
        print(f"package: {os.path.dirname(pdm_jax.__file__)}", file=sys.stderr)
        return 0
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, args.baseline], check=True,
                       capture_output=True)
        try:
            for side, root in (("this tree", REPO), (args.baseline, tree)):
                env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, cwd=root,
                                     capture_output=True, text=True)
                if run.returncode:
                    sys.exit(f"{side}: the worker failed:\n{run.stderr[-3000:]}")
                package = run.stderr.strip().splitlines()[-1].removeprefix("package: ")
                if os.path.commonpath([os.path.realpath(package), os.path.realpath(root)]) != os.path.realpath(root):
                    sys.exit(f"{side}: imported pdm_jax from {package}, not from {root}")
                sides[side] = run.stdout.splitlines()
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True)
    (a, la), (b, lb) = sides.items()
    for x, y in zip(la, lb):
        print(("same " if x == y else "DIFF ") + x + ("" if x == y else f"\n     {b}: {y}"))
    same = la == lb
    print(f"{a} vs {b}: {'the same outputs, bit for bit' if same else 'DIFFERENT outputs'} ({len(la)} requests)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
