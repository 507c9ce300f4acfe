"""Decode throughput of the JAX sampler vs transformers' PyTorch ``generate``, same tiny Qwen3, same CPU.

Both generate exactly ``--new_tokens`` tokens per sequence (no stop token) with
temperature-1 sampling from the same f32 weights (the JAX engine with
``quantization="none"``; torch in f32).  The JAX engine also computes, per token,
log mu of the sampled id and the top-K (K=20) ids/logprobs; transformers only
samples.  Time = best of ``--repeats`` runs after one warm-up (JAX compile excluded).

Printed: tokens/s at batch 1, 8, 32 side by side, the speed-up, and
time(256 new tokens) / time(128) (2.0 = constant per-token cost) for both.
Torch is optional: without it the PyTorch column is skipped with a message.

``--modes none,bf16,fp8`` adds, interleaved in the same runs, the JAX engine with
other weight formats (``quantization[:compute_dtype]``, e.g. ``fp8:bfloat16`` for fp8
weights computed in bf16, the engine's choice before ``sampler.compute_dtype=auto``):
tokens/s at 128 new tokens per mode, each mode's ratio to the first, and how many
XLA programs each mode's first call built (0: it runs a program an earlier mode
compiled -- bf16/fp8 weights computed in f32 run the f32 engine's very program).

    python bench/bench_sampler.py [--hidden 128 --layers 3 --vocab 512 --repeats 5]
    python bench/bench_sampler.py --modes none,bf16,fp8,bf16:bfloat16,fp8:bfloat16 --threads -1
"""
import argparse
import os
import random
import time

import jax
import numpy as np
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.profiling import CompileCounter
from pdm_jax.sampler.defaults import QUANTIZATIONS
from pdm_jax.sampler.engine import SamplingEngine


def best_time(fn, repeats):
    return best_times([fn], repeats)[0]


def best_times(fns, repeats, pause=0.2):
    """Best-of-`repeats` wall time of each fn, runs interleaved (a shared, noisy CPU hits all alike).

    Each repeat runs the fns in a fresh (seeded) random order, after a `pause`-second idle
    gap: torch's OpenMP workers keep spinning for a while after a call and would otherwise
    slow down whichever fn always runs next (measured: +12% on the next JAX call).
    """
    for fn in fns:
        fn()  # warm-up (compile)
    order_rng = random.Random(0)
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for i in order_rng.sample(range(len(fns)), len(fns)):
            time.sleep(pause)
            t0 = time.perf_counter()
            fns[i]()
            ts[i].append(time.perf_counter() - t0)
    return [min(t) for t in ts]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="JAX sampler weights/compute (none = f32, like the torch side)")
    ap.add_argument("--modes", default="",
                    help="comma list of quantization[:compute_dtype] engines timed beside the first "
                         "(e.g. none,bf16,fp8,fp8:bfloat16); compute_dtype default auto")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0 = torch default; 1 is torch's best case on a small, shared CPU: "
                         "its OpenMP workers spin-wait and collapse under contention; -1 = skip torch)")
    args = ap.parse_args()
    if args.modes:
        return compare_modes(args)

    h = args.hidden
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                         max_position_embeddings=4096)
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    batches = [int(b) for b in args.batches.split(",")]
    long_tokens = 2 * args.new_tokens
    engine = SamplingEngine(config, params, quantization=args.quantization, max_prompt_length=args.prompt_len,
                            max_new_tokens=long_tokens, max_batch_size=max(batches),
                            min_prompt_bucket=args.prompt_len)
    rng = np.random.default_rng(0)
    print(f"tiny Qwen3: V={args.vocab} D={h} L={args.layers} heads 4/2, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, jax sampler {args.quantization} (torch f32), CPU x{os.cpu_count()}, "
          f"jax {jax.__version__}")

    def jax_run(b, new):
        prompts = rng.integers(0, args.vocab, size=(b, args.prompt_len)).tolist()

        def go():
            out = engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=new, top_k_logprobs=args.k, seed=1)
            assert out.completion_mask.all()
        return go

    torch_model = None
    try:
        import torch
        import transformers

        from pdm_jax.models import hf_io

        if args.threads:
            torch.set_num_threads(args.threads)
        hf_cfg = transformers.Qwen3Config(**{k: v for k, v in config.to_hf_dict().items()
                                              if k not in ("architectures", "model_type")})
        torch_model = transformers.Qwen3ForCausalLM(hf_cfg).eval()
        sd = {k: torch.from_numpy(np.array(v)) for k, v in hf_io.hf_state_dict(model).items()}
        missing, unexpected = torch_model.load_state_dict(sd, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    except ImportError as e:
        print(f"PyTorch column skipped: {e} (pip install torch==2.13.0)")

    def torch_run(b, new):
        ids = torch.from_numpy(rng.integers(0, args.vocab, size=(b, args.prompt_len)))
        mask = torch.ones_like(ids)

        def go():
            with torch.no_grad():
                out = torch_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                           top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                                           pad_token_id=0, eos_token_id=None)
            assert out.shape[1] == args.prompt_len + new
        return go

    print(f"\n{'batch':>5s} {'jax tok/s':>10s} {'torch tok/s':>12s} {'jax/torch':>10s} "
          f"{'jax t' + str(long_tokens) + '/t' + str(args.new_tokens):>12s} {'torch ratio':>12s}")
    for b in batches:
        fns = [jax_run(b, args.new_tokens), jax_run(b, long_tokens)]
        if torch_model is not None:
            fns += [torch_run(b, args.new_tokens), torch_run(b, long_tokens)]
        times = best_times(fns, args.repeats)
        row = f"{b:5d} {b * args.new_tokens / times[0]:10.0f}"
        if torch_model is not None:
            row += f" {b * args.new_tokens / times[2]:12.0f} {times[2] / times[0]:9.2f}x"
        else:
            row += f" {'-':>12s} {'-':>10s}"
        row += f" {times[1] / times[0]:12.2f}"
        if torch_model is not None:
            row += f" {times[3] / times[2]:12.2f}"
        print(row, flush=True)
    print(f"(time ratio 2.00 = constant per-token cost; best of {args.repeats} interleaved runs, wall clock)")

def compare_modes(args):
    """tokens/s of the JAX engine per weight format (``--modes``), interleaved, at each batch size."""
    h = args.hidden
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                         max_position_embeddings=4096)
    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)), nnx.Param))
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    engines = {}
    for mode in modes:
        quantization, _, dtype = mode.partition(":")
        engines[mode] = SamplingEngine(config, params, quantization=quantization, compute_dtype=dtype or "auto",
                                       max_prompt_length=args.prompt_len, max_new_tokens=args.new_tokens,
                                       max_batch_size=max(batches), min_prompt_bucket=args.prompt_len)
    print(f"tiny Qwen3: V={args.vocab} D={h} L={args.layers} heads 4/2, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, CPU x{os.cpu_count()}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}; best of {args.repeats} interleaved runs")
    names = [f"{m} ({engines[m].compute_dtype})" for m in modes]
    print(f"\n{'batch':>5s} " + " ".join(f"{n:>22s}" for n in names) + "   tokens/s; ratio to the first")
    rng = np.random.default_rng(0)
    for b in batches:
        prompts = rng.integers(0, args.vocab, size=(b, args.prompt_len)).tolist()

        def run(engine):
            def go():
                out = engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=args.new_tokens,
                                      top_k_logprobs=args.k, seed=1)
                assert out.completion_mask.all()
            return go
        fns, compiled = [run(engines[m]) for m in modes], []
        for fn in fns:  # warm-up, counting the XLA programs each mode's first call builds
            counter = CompileCounter()
            fn()
            compiled.append(counter.snapshot()["compiles"])
        times = best_times(fns, args.repeats)
        cells = [f"{b * args.new_tokens / t:14.0f} ({times[0] / t:4.2f}x)" for t in times]
        print(f"{b:5d} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
        print(f"{'':5s} " + " ".join(f"{f'{n} new programs':>22s}" for n in compiled)
              + "   (0: the same compiled program as an earlier mode)", flush=True)


if __name__ == "__main__":
    main()
