"""Off-policy gap of the quantized sampler: every ``sampler.quantization`` (bf16, fp8 e4m3, int8, int4, int2;
the quantized ones per output channel) and every ``sampler.weight_noise`` asked for (f32 copies with a fixed
Gaussian perturbation, ``--weight_noise``) against the f32 policy.

For each sampler mode the sampler generates rollouts (tokens drawn from mu =
softmax(z_q / tau)); the f32 "trainer" recomputes pi = softmax(z / tau) by teacher
forcing.  Printed per mode:

* mean |log mu(y) - log pi(y)| over generated tokens (and its 99th percentile),
* mean top-K KL_topK(mu || pi) over E = TopK(mu) u {y} plus the tail bucket
  (DESIGN.md section 2, the DPPO proximity D_t),
* the share of generated tokens whose top-K KL exceeds ``--delta`` (outside the DPPO trust region),
* mean full-vocabulary KL(mu || pi) (the sampler's full logits, for reference),
* the relative Frobenius error ||W - W_q|| / ||W|| of the weights (mean / max over
  quantized tensors) and the relative error of the logits.

Weights: a random Qwen3 with fan-in-scaled init (peaked, LLM-like next-token
distributions; the default N(0, 0.02) init gives near-uniform ones), or a real
Hugging Face checkpoint with ``--hf_path``.

    python bench/bench_quantization.py [--hf_path DIR] [--layers 4] [--hidden 256] [--modes none,fp8,int4] \
        [--weight_noise 0.02,0.05,0.1] [--delta 0.05] ...
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import quantize as q
from pdm_jax.sampler.defaults import QUANTIZATIONS
from pdm_jax.sampler.engine import SamplingEngine


def fan_in_scaled(pure: dict, config: Qwen3Config, logit_gain: float) -> dict:
    """Rescales a random init's matrices to std 1/sqrt(fan_in) (embedding: 1; lm_head: logit_gain/sqrt(D)).

    Norm scales and other vectors are left alone. Under ``layers`` every leaf is stacked over the layers (a
    leading [L] axis), which is not a fan-in axis: the fan-in is the first axis after it (o_proj: the heads and
    head_dim axes)."""
    def rec(d, path):
        out = {}
        for k, v in d.items():
            p = path + (str(k),)
            if isinstance(v, dict):
                out[k] = rec(v, p)
                continue
            shape = v.shape[1:] if "layers" in p else v.shape
            if len(shape) < 2 or "norm" in p[-2]:
                out[k] = v
                continue
            x = v / jnp.std(v)
            if "embed_tokens" in p:
                std = 1.0
            elif "lm_head" in p:
                std = logit_gain / np.sqrt(config.hidden_size)
            elif "o_proj" in p:
                std = 1.0 / np.sqrt(shape[0] * shape[1])
            else:
                std = 1.0 / np.sqrt(shape[0])
            out[k] = x * std
        return out
    return rec(pure, ())


def full_logits(config, params, batch, dtype=jnp.float32):
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    st = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    nnx.update(model, st)
    ids = np.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], 1)
    logits = jax.jit(lambda i, m: model(i, attention_mask=m))(jnp.asarray(ids), jnp.asarray(mask))
    p = batch.prompt_ids.shape[1]
    return np.asarray(logits[:, p - 1:-1], np.float64)


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def xlogy_ratio(a, b):
    """a * log(a / b) with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a > 0, a * (np.log(a) - np.log(np.maximum(b, 1e-300))), 0.0)


def topk_kl(batch, logpi):
    """KL_topK(mu || pi) per generated token: buckets E = TopK u {y} and the tail."""
    out = []
    n, t = batch.completion_ids.shape
    for r in range(n):
        for s in range(t):
            if not batch.completion_mask[r, s]:
                continue
            ids = list(batch.topk_ids[r, s])
            lmu = list(batch.topk_logprobs[r, s])
            y = int(batch.completion_ids[r, s])
            if y not in ids:
                ids.append(y)
                lmu.append(batch.behavior_logprobs[r, s])
            mu_e = np.exp(np.asarray(lmu, np.float64))
            pi_e = np.exp(logpi[r, s, ids])
            tail = np.ones(logpi.shape[-1], bool)
            tail[ids] = False
            mu_t = max(1.0 - mu_e.sum(), 0.0)
            pi_t = np.exp(logpi[r, s, tail]).sum()  # complement sum: never negative
            out.append(xlogy_ratio(mu_e, pi_e).sum() + float(xlogy_ratio(np.array(mu_t), np.array(pi_t))))
    return np.asarray(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf_path", default=None, help="HF Qwen3 checkpoint dir (default: random fan-in init)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--logit_gain", type=float, default=4.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(QUANTIZATIONS),
                    help=f"comma-separated sampler precisions, of {', '.join(QUANTIZATIONS)} (default: all)")
    ap.add_argument("--weight_noise", default="",
                    help="comma-separated sampler.weight_noise values: one more row each, an f32 copy with that "
                         "relative noise (default: none)")
    ap.add_argument("--delta", type=float, default=0.05, help="trust-region delta of the 'outside' column (nats)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in QUANTIZATIONS]
    if bad or not modes:
        ap.error(f"--modes={args.modes!r}: each must be one of {', '.join(QUANTIZATIONS)}")
    try:
        noises = [q.check_weight_noise(float(x)) for x in args.weight_noise.split(",") if x.strip()]
    except ValueError as e:
        ap.error(f"--weight_noise={args.weight_noise!r}: {e}")

    if args.hf_path:
        from pdm_jax.models import hf_io

        model = hf_io.from_pretrained(args.hf_path)
        config = model.config
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    else:
        h = args.hidden
        config = Qwen3Config(vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h,
                             num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=h // 4)
        model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(args.seed))
        params = fan_in_scaled(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config, args.logit_gain)
    print(f"model: V={config.vocab_size} D={config.hidden_size} L={config.num_hidden_layers} "
          f"({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M params), tau={args.temperature}, K={args.k}")

    err = q.relative_errors(params, q.quantize_params_fp8(params))
    kern = {k: v for k, v in err.items() if v > 0}
    by_kind = {}
    for k, v in kern.items():
        by_kind.setdefault(k.split("/")[-2], []).append(v)
    print("fp8 weight error ||W - W_q||_F / ||W||_F per tensor kind (mean over layers): " +
          ", ".join(f"{kind} {np.mean(v):.4f}" for kind, v in sorted(by_kind.items())))
    for mode in modes:
        if mode in ("none", "fp8"):
            continue
        e = [v for v in q.relative_errors(params, q.prepare_sampler_params(params, mode)).values() if v > 0]
        print(f"{mode} weight error: mean {np.mean(e):.5f}, max {max(e):.5f} (over the {len(e)} tensors it changes)")

    rng = np.random.default_rng(args.seed)
    prompts = [list(rng.integers(0, config.vocab_size, size=int(rng.integers(4, 17)))) for _ in range(args.prompts)]
    print(f"\n{'mode':11s} {'mean|logmu-logpi|':>18s} {'p99':>8s} {'mean KL_topK':>13s} {'outside':>8s} "
          f"{'mean KL_full':>13s} {'logit rel err':>14s} {'tokens':>7s} {'gen s':>6s}")
    for mode, noise in [(m, 0.0) for m in modes] + [("none", x) for x in noises]:
        eng = SamplingEngine(config, params, quantization=mode, weight_noise=noise, max_prompt_length=32,
                             max_new_tokens=args.max_new_tokens, min_new_tokens_bucket=args.max_new_tokens)
        t0 = time.perf_counter()
        b = eng.generate(prompts, n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                         top_k_logprobs=args.k, seed=args.seed)
        gen_s = time.perf_counter() - t0
        m = b.completion_mask
        tau = args.temperature if args.temperature > 0 else 1.0
        z_pi = full_logits(config, params, b)
        logpi = log_softmax(z_pi / tau)
        lpi_y = np.take_along_axis(logpi, b.completion_ids[..., None], -1)[..., 0]
        gap = np.abs(b.behavior_logprobs.astype(np.float64) - lpi_y)[m]
        kl_topk = topk_kl(b, logpi)
        z_mu = full_logits(config, eng.params, b, dtype=eng.compute_dtype)
        logmu = log_softmax(z_mu / tau)
        kl_full = (np.exp(logmu) * (logmu - logpi)).sum(-1)[m]
        logit_err = np.linalg.norm((z_mu - z_pi)[m]) / np.linalg.norm(z_pi[m])
        name = mode if not noise else f"noise {noise:g}"
        print(f"{name:11s} {gap.mean():18.3e} {np.quantile(gap, 0.99):8.2e} {kl_topk.mean():13.3e} "
              f"{np.mean(kl_topk > args.delta):8.1%} {kl_full.mean():13.3e} {logit_err:14.3e} {int(m.sum()):7d} "
              f"{gen_s:6.1f}")
    print("\n(none = the f32 sampler: the gap is decode-vs-full-forward rounding only; noise x = sampler.weight_noise "
          f"x on the f32 copy; outside = the share of tokens whose top-K KL exceeds delta = {args.delta:g})")


if __name__ == "__main__":
    main()
