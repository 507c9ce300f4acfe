"""δ × direction criterion × seed on a shortened tiny task (issue 6).

δ ∈ {0.05, 0.15} × {ratio (DPPO), predictive-aggregated_tail (PDM),
predictive-bucket_exact (PDM)} × 3 seeds = 18 runs of ``configs/tiny.py`` with:

* warm start: 300 SFT steps × 128 (the default has 700), so the warm start is
  weaker and RL has room to improve;
* RL: 40 GRPO steps (default 300), 16 prompts × 8 samples, 2 mini-batches ×
  2 iterations per rollout batch (4 optimizer steps, 3 of them off-policy),
  staleness 1, fp8 sampler in process (no subprocess start-up), lr 1e-4;
* held-out eval on 200 prompts (avg@4 + greedy) at the warm start, every 20 RL
  steps and at the end (collapse = an eval below warm start − 0.1).

The 6 runs of one seed differ only in the RL phase, so they share one warm
start (run once with ``rl.steps=0``, then resumed per run; see
``launch/sweep.py:run_local``).

The argument string selects the sizes: ``get_sweep("full")`` runs the default
tiny job (700 SFT / 300 RL steps) per grid point instead.
"""


def get_sweep(arg=None):
    """Returns the sweep dict read by launch/sweep.py (see its module docstring)."""
    if arg == "full":
        fixed = "rl.num_iterations=2,staleness=1,model.num_hidden_layers=3,sft.steps=700,sft.target_token_accuracy=0.0"
        flags = {}
    else:
        fixed = ("sft.steps=300,steps=40,rl.prompts_per_step=16,rl.num_minibatches=2,rl.num_iterations=2,"
                 "staleness=1,eval.every_steps=20,eval.num_prompts=200,checkpoint.every_steps=20,"
                 "log.tensorboard=False,log.progress=False,"
                 "model.num_hidden_layers=3,sft.target_token_accuracy=0.0")  # the sweep's tiny model (3 layers)
        flags = {"sampler.mode": "in_process"}
    return dict(
        config="configs/tiny.py",
        fixed=fixed,
        axes=[
            ("delta", [0.05, 0.15]),
            ("criterion", ["ratio", "pdm_aggregated_tail", "pdm_bucket_exact"]),
            ("seed", [0, 1, 2]),
        ],
        flags=flags,
        collapse_margin=0.1,
        share_warmstart_by=("seed",),  # the 6 runs of a seed share its warm start
    )
