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
under way) and 4 mini-batches x 4 iterations per batch at a learning rate of 5e-4 (30-step probes,
reports/between_pilot), at delta = 0.05; ``get_sweep("pilot_stale_slow")`` is the same at a learning rate of 3e-4.

All runs share one supervised warm start (``share_warmstart_by=()``).

    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot --out=runs/between_pilot
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_delta_0.15 \
        --out=runs/between_pilot_delta_0.15
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_int2 --out=runs/between_int2
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_stale --out=runs/between_stale
    python launch/sweep.py --sweep=launch/sweeps/between_testbed.py --sweep_arg=pilot_stale_slow \
        --out=runs/between_stale_slow
"""

PILOT_ARMS = ["none", "ratio", "pdm_bucket_exact"]
#: The pilot's sampler.weight_noise (see the module docstring).
PILOT_NOISE = 0.45
#: The drift pilot's lever (see the module docstring).
STALE_LEVER = "rl.max_staleness=8,rl.num_iterations=4,rl.learning_rate="
ARGS = ("pilot", "pilot_delta_0.15", "pilot_int2", "pilot_stale", "pilot_stale_slow")


def get_sweep(arg=None):
    """Returns the sweep dict read by launch/sweep.py (see its module docstring): arg "pilot" (the default),
    "pilot_delta_0.15", "pilot_int2", "pilot_stale" or "pilot_stale_slow"."""
    if arg is not None and arg not in ARGS:
        raise ValueError(f"between_testbed sweep argument {arg!r}: expected one of {ARGS} or none")
    wide = arg == "pilot_delta_0.15"
    lever = {"pilot_int2": "sampler.quantization=int2", "pilot_stale": STALE_LEVER + "5e-4",
             "pilot_stale_slow": STALE_LEVER + "3e-4"}.get(arg, f"sampler.weight_noise={PILOT_NOISE}")
    return dict(
        config="configs/tiny_between.py",
        fixed=f"log.tensorboard=False,log.progress=False,rl.steps=200,eval.every_steps=50,"
              f"{lever},delta={0.15 if wide else 0.05}",
        axes=[  # seed outermost: a sweep stopped early has every arm at the same number of seeds
            ("seed", [0, 1]),
            ("criterion", PILOT_ARMS[1:] if wide else PILOT_ARMS),
        ],
        flags={"sampler.mode": "in_process"},
        collapse_margin=0.1,
        share_warmstart_by=(),
        paired_baseline=("criterion", "ratio"),
    )
