"""Trust-region criteria side by side on the stress testbed ``configs/tiny_stress.py`` (issue 16).

Arms (the ``criterion`` axis, `launch/sweep.py:CRITERIA`):

* ``none``: truncated importance sampling (C = 5) without a mask;
* ``ppo_clip_higher``: GRPO with DAPO's clip-higher, ratio kept in [0.8, 1.28];
* ``ratio``: DPPO-TopK-KL (mask tokens whose top-K KL > δ and whose ratio moves away from 1);
* ``pdm_aggregated_tail`` / ``pdm_bucket_exact`` / ``pdm_uniform_tail``: PDM, mask tokens whose top-K KL
  > δ and whose predicted divergence change D' (each closed-form estimator) is > 0;
* ``pdm_param_jvp``: PDM with the parameter-space direction (``trust_region.direction=param_jvp``: Ḋᵖ, the
  jvp of each token's divergence along the optimizer's update of the unmasked gradient);

at δ ∈ {0.05, 0.15} (δ only for the divergence masks: ``none`` and ``ppo_clip_higher`` run once, listed under
δ = 0.05) × 8 seeds. All runs share one supervised warm start (``share_warmstart_by=()``): the seed varies the
RL phase only (rollout sampling and mini-batch order), so the comparison is between trust regions applied to
the same starting policy.

``get_sweep("core")`` is the first part run when time is short: δ = 0.05 and the arms none, ppo_clip_higher,
ratio, pdm_aggregated_tail, pdm_param_jvp.
"""

SEEDS = list(range(8))
FULL_ARMS = ["none", "ppo_clip_higher", "ratio", "pdm_aggregated_tail", "pdm_bucket_exact", "pdm_uniform_tail",
             "pdm_param_jvp"]
CORE_ARMS = ["none", "ppo_clip_higher", "ratio", "pdm_aggregated_tail", "pdm_param_jvp"]
#: Arms whose mask has no divergence radius: run at the first δ only.
NO_RADIUS = ("none", "ppo", "ppo_clip_higher")


def _keep(point):
    return point["criterion"] not in NO_RADIUS or point["delta"] == 0.05


def get_sweep(arg=None):
    """Returns the sweep dict read by launch/sweep.py (see its module docstring); arg None = the full grid."""
    core = arg == "core"
    return dict(
        config="configs/tiny_stress.py",
        fixed="log.tensorboard=False,log.progress=False",
        axes=[  # seed outermost: a sweep stopped early has every arm at the same number of seeds
            ("seed", SEEDS),
            ("delta", [0.05] if core else [0.05, 0.15]),
            ("criterion", CORE_ARMS if core else FULL_ARMS),
        ],
        flags={"sampler.mode": "in_process"},
        collapse_margin=0.1,
        keep=_keep,
        share_warmstart_by=(),  # one warm start for every run
        paired_baseline=("criterion", "ratio"),  # per-seed differences against DPPO-TopK-KL in the table
    )
