"""Issue 29's testbed candidate with many right answers, ``configs/tiny_between.py`` (``number_between``: any
integer strictly inside a prompt's interval; a 1,024-token BPE trained on the task's text, K = 20), with a fixed
perturbation of the sampler's copy (``sampler.weight_noise``) as the behaviour/trainer mismatch lever.

``get_sweep("pilot")`` measures whether the masks can differ there before comparison seeds are spent: seeds 0
and 1, weight noise sigma = 0.45 (chosen by 30-step probes, reports/between_pilot), arms ``none`` (truncated IS, no
mask), ``ratio`` (DPPO-TopK-KL) and ``pdm_bucket_exact`` at delta = 0.05, 200 RL steps, held-out evaluation every
50 steps. The testbed qualifies (the issue's rule) when the mean ``frac_direction_disagree`` is >= 5% of valid
tokens and ``none`` ends measurably below ``ratio``.

``get_sweep("pilot_delta_0.15")`` is the masked arms of the same pilot at delta = 0.15 (``none`` has no radius).

``get_sweep("pilot_int2")`` is the pilot with a lever that has fixed points instead of the noise: rollouts from an
int2 copy of the weights (``sampler.quantization=int2``, four levels per output channel; a π whose weights sit on
the grid is its own copy), at delta = 0.05.

``get_sweep("pilot_stale")`` replaces the fixed offset by drift: no weight noise (the fp8 copy), rollouts up to
``rl.max_staleness`` = 8 versions behind the trainer (the producer runs ahead, so the lag is 8 once the run is
under way) and 2 mini-batches x 4 iterations per batch (``rl.num_iterations`` = 4 over tiny's 2 mini-batches) at a
learning rate of 5e-4 (30-step probes, reports/between_pilot), at delta = 0.05; ``get_sweep("pilot_stale_slow")`` is
the same at a learning rate of 3e-4.
``get_sweep("pilot_stale_temp")`` is ``pilot_stale_slow`` with the rollouts drawn at a sampler temperature of its
own, ``sampler.temperature`` = 1.15 (the loss's pi stays at ``rl.temperature`` 1): drift plus a small persistent
offset (100-step probes, reports/between_pilot). It is the first lever that meets both of the issue's rules.

``get_sweep("comparison")`` is the comparison on that testbed (the ``pilot_stale_temp`` lever): no mask, GRPO
clip-higher, DPPO-TopK-KL, and PDM with the paper's two estimators (aggregated_tail, uniform_tail) and bucket_exact,
at delta in {0.05, 0.15}, over `COMPARISON_SEEDS` paired seeds. The seed count is the pilot's power estimate: its
PDM - DPPO difference in final accuracy (+0.006, standard deviation 0.012 over two seeds, d_z 0.51) needs 33
paired seeds for 80% power in a two-sided paired t-test at 5% (`launch/sweep.py:seeds_for_power`). The arms
without a radius (none, clip-higher) run at delta 0.05 and only for the first `RADIUS_FREE_SEEDS` seeds: their
differences from DPPO in the pilot (-0.16) are tens of standard deviations. That is 8 x 10 + 25 x 8 = 280 runs of
~2.5 min on a 2-core CPU with nothing else running (12 h); seed is the outermost axis, so a sweep stopped early (and
resumed later: runs with a ``summary.json`` are skipped) has every arm at the same seeds. The finished runs' records
and the warm start are committed in ``reports/between_pilot/comparison_records`` (``--records``,
`launch/sweep.py:save_record`), so the sweep goes on across machines from the same warm start and its tables are
rebuilt from the records with ``--aggregate_only``. Besides the differences from DPPO, the table pairs each arm
across the radii (``paired_change``): its change from delta 0.05 to 0.15, seed by seed (the paper's delta-robustness
claim), and the change of its difference from DPPO (does PDM's gap to DPPO narrow at the larger radius). Its
``step_means`` table gives the seed means of a few metrics at RL steps 1, 2, 3, 5 and 9 (`EARLY_STEPS`), whose
rollouts every arm draws from the warm start (the staleness ramps up to 8, so batch i is sampled by version 0 for
i <= 9): there μ, the tokens and the advantages are the same in every arm at a seed, and the arms differ only by what
their mask kept.

All runs share one supervised warm start (``share_warmstart_by=()``).

    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot --out=runs/between_pilot
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_delta_0.15 \
        --out=runs/between_pilot_delta_0.15
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_int2 --out=runs/between_int2
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_stale --out=runs/between_stale
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_stale_slow \
        --out=runs/between_stale_slow
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_stale_temp \
        --out=runs/between_stale_temp
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=comparison \
        --out=runs/between_comparison --records=reports/between_pilot/comparison_records --code_dir=<git archive>
"""

PILOT_ARMS = ["none", "ratio", "pdm_bucket_exact"]
#: The pilot's sampler.weight_noise (see the module docstring).
PILOT_NOISE = 0.45
#: The drift pilot's lever (see the module docstring).
STALE_LEVER = "rl.max_staleness=8,rl.num_iterations=4,rl.learning_rate="
#: The sampler's own temperature in ``pilot_stale_temp`` (see the module docstring).
STALE_TEMPERATURE = 1.15
ARGS = ("pilot", "pilot_delta_0.15", "pilot_int2", "pilot_stale", "pilot_stale_slow", "pilot_stale_temp",
        "comparison")
#: The comparison's arms (`launch/sweep.py:CRITERIA`) and seeds (see the module docstring).
COMPARISON_ARMS = ["none", "ppo_clip_higher", "ratio", "pdm_aggregated_tail", "pdm_uniform_tail", "pdm_bucket_exact"]
COMPARISON_SEEDS = list(range(33))
RADIUS_FREE_SEEDS = 8
#: The RL steps of the comparison's `step_means` table (rollouts from the warm start in every arm) and its metrics.
EARLY_STEPS = [1, 2, 3, 5, 9]
EARLY_METRICS = ["mean_topk_kl", "entropy", "frac_masked_first_minibatch", "frac_direction_disagree",
                 "mean_tail_mass"]
#: Arms whose mask has no divergence radius: run at the first delta only.
NO_RADIUS = ("none", "ppo", "ppo_clip_higher")


def _comparison_keep(point):
    if point["criterion"] not in NO_RADIUS:
        return True
    return point["delta"] == 0.05 and point["seed"] < RADIUS_FREE_SEEDS


def get_sweep(arg=None):
    """Returns the sweep dict read by launch/sweep.py (see its module docstring): arg "pilot" (the default),
    "pilot_delta_0.15", "pilot_int2", "pilot_stale", "pilot_stale_slow", "pilot_stale_temp" or "comparison"."""
    if arg is not None and arg not in ARGS:
        raise ValueError(f"between_testbed sweep argument {arg!r}: expected one of {ARGS} or none")
    tempered = f"{STALE_LEVER}3e-4,sampler.temperature={STALE_TEMPERATURE}"
    lever = {"pilot_int2": "sampler.quantization=int2", "pilot_stale": STALE_LEVER + "5e-4",
             "pilot_stale_slow": STALE_LEVER + "3e-4", "pilot_stale_temp": tempered, "comparison": tempered,
             }.get(arg, f"sampler.weight_noise={PILOT_NOISE}")
    sweep = dict(
        config="configs/tiny_between.py",
        fixed=f"log.tensorboard=False,log.progress=False,rl.steps=200,eval.every_steps=50,{lever}",
        flags={"sampler.mode": "in_process"},
        collapse_margin=0.1,
        share_warmstart_by=(),
        paired_baseline=("criterion", "ratio"),
    )
    # seed outermost: a sweep stopped early has every arm at the same number of seeds
    if arg == "comparison":
        return dict(sweep, keep=_comparison_keep, paired_change=("delta", 0.05),
                    step_means=dict(metrics=EARLY_METRICS, steps=EARLY_STEPS), axes=[
            ("seed", COMPARISON_SEEDS), ("delta", [0.05, 0.15]), ("criterion", COMPARISON_ARMS)])
    wide = arg == "pilot_delta_0.15"
    return dict(sweep, fixed=f"{sweep['fixed']},delta={0.15 if wide else 0.05}",
                axes=[("seed", [0, 1]), ("criterion", PILOT_ARMS[1:] if wide else PILOT_ARMS)])
