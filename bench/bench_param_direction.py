"""Benchmark: the param_jvp training criterion's step beside the DPPO and PDM steps, and the analysis jvp.

On the same synthetic rollout mini-batch and the same Qwen3 model (bench_train_step's
configs), side by side in one process, each jitted and compiled first, then ``--repeats``
rounds that call each in turn (load spikes of a shared machine hit all alike):

* ``dppo_step``   the trainer's real RL step (``train_step.make_rl_train_step``: forward,
  top-K KL trust region with the ratio direction, truncated IS, backward, AdamW), one device;
* ``pdm_step``    the same with ``mask="pdm"``, ``estimator="bucket_exact"`` (logit-space Ḋ);
* ``param_jvp_step`` the same with ``trust_region.direction="param_jvp"``: the unmasked
  gradient, its AdamW update (not applied), one jvp of every token's top-K KL along it,
  then the masked step (``train_step._param_jvp_rl_step``);
* ``forward``     the training forward alone (``train_step.completion_logits`` / τ) and the
  per-token top-K KL;
* ``param_jvp``   ``pdm_jax.analysis.param_direction.param_jvp_topk_kl``: D and Ḋᵖ of every
  token along a parameter update Δθ, one forward-mode pass (what the analysis adds per
  optimizer step, beside copying θ).

Prints the median time of each and its ratio to the DPPO step.

Reproduce (CPU, repository root; tiny ~3 min, tiny,medium ~11 min on the 2-core CPU at load ~15):

    python bench/bench_param_direction.py
    python bench/bench_param_direction.py --configs tiny,medium --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import CONFIGS, make_batch  # noqa: E402  (sibling script: same configs and batch)

from pdm_jax.rl import train_step as ts  # noqa: E402
from pdm_jax.rl import trust_region  # noqa: E402
from pdm_jax.analysis.param_direction import param_jvp_topk_kl, parameter_update  # noqa: E402
from pdm_jax.rl.loss import PolicyLossConfig  # noqa: E402
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

TAU = 1.0


def bench_config(name: str, spec: dict, repeats: int) -> list:
    """Median seconds of the dppo / pdm / param_jvp steps, forward and the analysis jvp on config `name`; rows."""
    cfg = Qwen3Config(**spec["model"])
    graphdef, params = nnx.split(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    b = make_batch(np.random.default_rng(0), spec["batch"], spec["prompt"], spec["completion"], spec["top_k"],
                   cfg.vocab_size)
    b = jax.tree.map(jnp.asarray, b)
    tx, _ = ts.make_optimizer(1e-5)
    tr = trust_region.TrustRegionConfig(mask="dppo", divergence="topk_kl", delta=0.05)
    loss_cfg = PolicyLossConfig(max_response_length=spec["completion"], policy_loss="tis")
    steps = {what: jax.jit(ts.make_rl_train_step(graphdef, tx, trc, loss_cfg), donate_argnums=0)
             for what, trc in (("dppo_step", tr), ("pdm_step", dataclasses.replace(tr, mask="pdm")),
                               ("param_jvp_step", dataclasses.replace(tr, mask="pdm", direction="param_jvp")))}
    fresh = lambda: ts.TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.map(jnp.copy, params),  # noqa: E731
                                  opt_state=jax.jit(tx.init)(params))
    states = {what: fresh() for what in steps}
    for what, step in steps.items():  # compile; Δθ = the update of one real DPPO step
        states[what], _ = step(states[what], b)
    after = jax.tree.map(jnp.copy, states["dppo_step"].params)
    delta = parameter_update(params, after)

    @jax.jit
    def forward(prm):
        z = ts.completion_logits(graphdef, prm, b.prompt_ids, b.prompt_mask, b.completion_ids,
                                 b.completion_mask) / TAU
        return trust_region.topk_kl(z, b.completion_ids, b.topk_ids, b.topk_logprobs, b.behavior_logprobs)

    def jvp(prm):
        return param_jvp_topk_kl(graphdef, prm, delta, b.prompt_ids, b.prompt_mask, b.completion_ids,
                                 b.completion_mask, b.topk_ids, b.topk_logprobs, b.behavior_logprobs,
                                 temperature=TAU)

    jax.block_until_ready((forward(params), jvp(params)))
    times = {what: [] for what in (*steps, "forward", "param_jvp")}
    for _ in range(repeats):
        for what, step in steps.items():
            t0 = time.perf_counter()
            states[what], metrics = step(states[what], b)
            jax.block_until_ready((states[what].params, metrics))
            times[what].append(time.perf_counter() - t0)
        for key, fn in (("forward", forward), ("param_jvp", jvp)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params))
            times[key].append(time.perf_counter() - t0)
    base = statistics.median(times["dppo_step"])
    return [dict(config=name, what=k, ms=1e3 * statistics.median(v), ratio_to_dppo_step=statistics.median(v) / base)
            for k, v in times.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    print(f"# jax {jax.__version__}, {jax.devices()[0].platform}, {platform.processor() or platform.machine()}")
    rows = []
    for name in a.configs.split(","):
        rows += bench_config(name, CONFIGS[name], a.repeats)
    print(f"{'config':<8} {'what':<15} {'median ms':>10} {'vs DPPO step':>13}")
    for r in rows:
        print(f"{r['config']:<8} {r['what']:<15} {r['ms']:>10.1f} {r['ratio_to_dppo_step']:>13.3f}")


if __name__ == "__main__":
    main()
