"""Weight sync per RL step: the file path (subprocess sampler) beside colocated (in memory), one process.

For each model, the trainer's side of one weight sync, `SamplerSupervisor.sync(params, v)`, is
timed for

* ``subprocess``: a real ``pdm_jax.sampler.server`` child process on loopback. The trainer
  writes ``params.safetensors`` + its sha256 manifest (``save``), the server reads, checks,
  re-quantizes and installs it (``load``, including the HTTP round trip);
* ``colocated``: an engine in this process on its first device: the trainer's parameter tree
  is handed over and one jitted program builds the quantized copy there (no file);

alternating the two modes version by version (same parameters, changed between versions
outside the timers), after one warm-up sync each (compiles). Prints the median of each and
the ratio file / colocated.

Models: ``tiny`` (the default run's model, 0.6M parameters, ``configs/tiny.py``) and ``100m``
(a Qwen3-shaped model scaled up to ~100M parameters: V 32768, d 768, 12 layers, GQA 12/4,
head 64, MLP 2048, tied embeddings), random weights. The parameters live on one device, as in
the default single-device run.

    python bench/bench_weight_sync.py                       # both models, fp8 sampler copy
    python bench/bench_weight_sync.py --models tiny --repeats 41 --quantization none
    python bench/bench_weight_sync.py --models tiny --modes subprocess --repeats 41   # the file path alone
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

MODELS = {
    "tiny": dict(vocab_size=16, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "100m": dict(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
}


def sampler_section(mode: str, quantization: str):
    """The base config's sampler settings (`SamplerSpec`) in `mode` / `quantization`, 16-token prompts, batches of 8."""
    from pdm_jax.config import get_base_config
    from pdm_jax.rollouts.spec import SamplerSpec
    sc = get_base_config().sampler
    sc.mode, sc.quantization = mode, quantization
    sc.max_prompt_length, sc.max_batch_size = 16, 8
    return SamplerSpec.from_config(sc)


def random_params(cfg, seed: int = 0):
    """Random f32 parameters (std 0.02, norm scales 1) on the default device, as the trainer holds them."""
    import jax
    import jax.numpy as jnp

    from pdm_jax.sampler.weights import abstract_params
    rng = np.random.default_rng(seed)

    def init(path, x):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(x.shape, jnp.float32)
        return jnp.asarray((0.02 * rng.standard_normal(x.shape, dtype=np.float32)))
    return jax.tree_util.tree_map_with_path(init, abstract_params(cfg))


def bench_model(name: str, repeats: int, quantization: str, modes=("subprocess", "colocated")) -> dict:
    import jax

    from pdm_jax.models.qwen3 import Qwen3Config
    from pdm_jax.rollouts.supervisor import SamplerSupervisor

    cfg = Qwen3Config(**MODELS[name])
    params = random_params(cfg)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.0001, p))
    sups = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for mode in modes:
            wd = os.path.join(tmp, mode)
            os.makedirs(os.path.join(wd, "model"))
            with open(os.path.join(wd, "model", "config.json"), "w") as f:
                json.dump(cfg.to_hf_dict(), f)
            sup = SamplerSupervisor(sampler_section(mode, quantization), workdir=wd, model_config=cfg,
                                    max_new_tokens=16)
            sup.start(0, params=params)
            sups[mode] = sup
        times = {m: [] for m in sups}
        try:
            for v in range(1, repeats + 2):
                params = jax.block_until_ready(bump(params))
                for mode in (modes if v % 2 else modes[::-1]):
                    t0 = time.perf_counter()
                    sups[mode].sync(params, v)
                    dt = time.perf_counter() - t0
                    if v > 1:  # the first sync of each mode compiles
                        times[mode].append((dt, dict(sups[mode].last_sync_seconds)))
        finally:
            for s in sups.values():
                s.stop()
    out = dict(model=name, params=n_params, mbytes=4 * n_params / 1e6)
    for mode, rows in times.items():
        out[mode] = float(np.median([t for t, _ in rows]))
        out[mode + "_save"] = float(np.median([d["save"] for _, d in rows]))
        out[mode + "_load"] = float(np.median([d["load"] for _, d in rows]))
    out["ratio"] = out["subprocess"] / out["colocated"] if len(times) == 2 else float("nan")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,100m", help="comma-separated: " + ",".join(MODELS))
    p.add_argument("--repeats", type=int, default=0, help="timed syncs per mode (default: 21 tiny, 7 100m)")
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--modes", default="subprocess,colocated",
                   help="both (default), or one alone: its timings then see no async work of the other")
    args = p.parse_args(argv)
    print(f"weight sync per version, sampler copy {args.quantization}, median over versions; load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    print(f"{'model':>6} {'params':>8} {'MB f32':>7} | {'file (subprocess) ms':>24} | {'colocated ms':>12} | "
          f"{'file / colocated':>16}")
    for name in args.models.split(","):
        modes = tuple(args.modes.split(","))
        r = bench_model(name, args.repeats or (21 if name == "tiny" else 7), args.quantization, modes)
        r = {"subprocess": float("nan"), "subprocess_save": float("nan"), "subprocess_load": float("nan"),
             "colocated": float("nan"), **r}
        print(f"{name:>6} {r['params'] / 1e6:7.1f}M {r['mbytes']:7.1f} | {1e3 * r['subprocess']:7.1f} (save "
              f"{1e3 * r['subprocess_save']:6.1f} + load {1e3 * r['subprocess_load']:6.1f}) | "
              f"{1e3 * r['colocated']:12.1f} | {r['ratio']:15.1f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
