"""Compiled FLOPs per valid token of one RL optimizer step, padded vs packed (rl.pack_sequences), one run.

For a config (default: the Qwen3-8B DAPO recipe, ``configs/qwen3_dapo.py``) and a length mix drawn
here, both steps are compiled for the target (default XLA:TPU, the config's ``dry_run`` slice) and
their FLOPs counted with ``pdm_jax.dry_run.counted_flops`` (XLA ``cost_analysis`` of loop-free 1- and
2-layer compiles, every layer added up; a while loop's body would be counted once). The padded step
runs ``B`` rows of ``P + T`` tokens; the packed step the rows ``pdm_jax.rl.packing.plan_packing``
makes of the same mini-batch (``L = rl.packed_length`` tokens each, whole micro-batches of
``rl.micro_batch_size`` rows). Printed: each step's counted FLOPs over all devices, per valid
(loss-bearing completion) token and per real token, and the ratio padded / packed. These are the
compiler's counts for the named slice, not a speed: nothing runs on a chip.

Length mix (default, a stand-in for long-response RL): completion lengths geometric with mean
``--mean_completion`` (2,048) capped at ``rl.max_new_tokens`` (8,192), prompt lengths geometric with
mean ``--mean_prompt`` (256) capped at ``sampler.max_prompt_length`` (2,048), seed ``--seed``.

    python bench/bench_packing.py                                   # 8B recipe, XLA:TPU v5p:4x4x4 (~10 min)
    python bench/bench_packing.py --config=configs/tiny.py --compiler=cpu --num_devices=8 --mean_completion=3 \
        --mean_prompt=8
"""
import argparse
import dataclasses
import importlib.util
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def length_mix(rng, n: int, mean: float, cap: int, low: int = 1):
    """``n`` lengths, geometric with mean ``mean``, clipped to ``[low, cap]``."""
    return rng.geometric(1.0 / max(mean, 1.0), size=n).clip(low, cap)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen3_dapo.py:size=8b")
    ap.add_argument("--compiler", default="tpu", choices=("tpu", "gpu", "cpu"))
    ap.add_argument("--num_devices", type=int, default=0, help="0: the config's dry_run.num_devices")
    ap.add_argument("--mean_completion", type=float, default=2048.0)
    ap.add_argument("--mean_prompt", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.compiler == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.num_devices or 8}").strip()
    import numpy as np

    from pdm_jax import aot, dry_run
    from pdm_jax.run_spec import run_spec
    from pdm_jax.rl.packing import plan_packing

    path, _, arg = args.config.partition(":")
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(REPO, path) if not os.path.isabs(path)
                                                  else path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)
    with config.unlocked():
        config.rl.pack_sequences = False
    packed_config = config.copy_and_resolve_references()
    with packed_config.unlocked():
        packed_config.rl.pack_sequences = True
    config, packed_config = run_spec(config, dry_run=True), run_spec(packed_config, dry_run=True)
    chip = config.dry_run.chip
    n_dev = args.num_devices or config.dry_run.num_devices
    model_cfg = dry_run.resolve_model_config(config)
    sizes = dry_run.mesh_sizes(config, n_dev)
    shards = sizes["data"] * sizes["fsdp"]
    devices = aot.target_devices(args.compiler, chip, n_dev)

    shape = dry_run.step_shape(config, chip)
    b, p, t = shape.batch, shape.prompt_len, shape.completion_len
    rng = np.random.default_rng(args.seed)
    prompt_lens = length_mix(rng, b, args.mean_prompt, config.sampler.max_prompt_length)
    completion_lens = length_mix(rng, b, args.mean_completion, t)
    prompt_mask = np.arange(p)[None, :] >= (p - prompt_lens)[:, None]
    completion_mask = np.arange(t)[None, :] < completion_lens[:, None]
    length = packed_config.packed_length
    plan = plan_packing(prompt_mask, completion_mask, row_length=length,
                        rows_per_micro_batch=config.rl.micro_batch_size, row_multiple=shards)
    packed_shape = dataclasses.replace(dry_run.step_shape(packed_config, chip), packed_rows=plan.token_mask.shape[0])
    valid = int(completion_lens.sum())
    real = int((prompt_lens + completion_lens).sum())

    out = {}
    for name, cfg, shp in (("padded", config, shape), ("packed", packed_config, packed_shape)):
        t0 = time.time()
        counted = dry_run.counted_flops(cfg, model_cfg, shp, sizes, devices=devices, platform=args.compiler)
        if counted.get("flops") is None:
            raise SystemExit(f"{name}: {counted.get('note')}")
        total = counted["flops"] * n_dev
        out[name] = dict(rows=shp.rows, row_length=shp.row_length, flops=total, per_valid=total / valid,
                         per_real=total / real, seconds=time.time() - t0)
    target = aot.label(args.compiler, chip, None, n_dev)
    print(f"{args.config} on {target}: mini-batch of {b} sequences, mesh {sizes}")
    print(f"length mix: prompts geometric mean {args.mean_prompt:g} (drawn mean {prompt_lens.mean():.0f}, cap "
          f"{config.sampler.max_prompt_length}), completions geometric mean {args.mean_completion:g} (drawn mean "
          f"{completion_lens.mean():.0f}, cap {t}), seed {args.seed}: {valid:,} completion tokens, "
          f"{real:,} real tokens")
    print(f"packing: {plan.token_mask.shape[0]} rows of {length} tokens in {plan.num_micro_batches} micro-batch(es), "
          f"fill {plan.fill:.3f}")
    print(f"{'step':<8}{'rows x tokens':>18}{'counted TFLOP (all devices)':>30}{'GFLOP / valid token':>22}"
          f"{'GFLOP / real token':>21}{'compile s':>11}")
    for name, r in out.items():
        print(f"{name:<8}{r['rows']:>8} x {r['row_length']:<7}{r['flops'] / 1e12:>30,.4g}{r['per_valid'] / 1e9:>22.2f}"
              f"{r['per_real'] / 1e9:>21.2f}{r['seconds']:>11.0f}")
    ratio = out["padded"]["flops"] / out["packed"]["flops"]
    print(f"padded / packed FLOPs per valid token: {ratio:.2f}x")
    return dict(out, ratio=ratio, fill=plan.fill)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
