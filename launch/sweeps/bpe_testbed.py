"""Issue 29's testbed candidate, ``configs/tiny_bpe.py`` (chain_sum with a 1024-token BPE trained on the task's
text, K = 20), with the rollouts' own temperature as the behaviour/trainer mismatch lever.

``get_sweep("pilot")`` measures whether the masks can differ there before seeds are spent: one seed, the
sampler temperature tau_s in {1.0 (no mismatch), 1.3, 1.6, 2.0}, arms ``none`` (truncated IS, no mask), ``ratio``
(DPPO-TopK-KL) and ``pdm_bucket_exact`` at delta = 0.05. The testbed qualifies (the issue's rule) when
the mean ``frac_direction_disagree`` is >= 5% of valid tokens and ``none`` ends measurably below ``ratio``.

``get_sweep("int4")`` is the same pilot with a fixed-offset lever instead: the rollouts drawn at the loss's
temperature from an int4 copy of the weights (``sampler.quantization=int4``, one scale per output channel),
the analogue of the paper's fp8 stress, beside the default fp8 copy.

All runs share one supervised warm start (``share_warmstart_by=()``), 200 RL steps each, held-out
evaluation every 50 steps.

    python launch/sweep.py --sweep=launch/sweeps/bpe_testbed.py --sweep_arg=pilot --out=runs/bpe_pilot
    python launch/sweep.py --sweep=launch/sweeps/bpe_testbed.py --sweep_arg=int4 --out=runs/bpe_int4
"""

PILOT_ARMS = ["none", "ratio", "pdm_bucket_exact"]


def get_sweep(arg=None):
    """Returns the sweep dict read by launch/sweep.py (see its module docstring): arg "pilot" (the default) =
    the temperature pilot, "int4" = the int4-rollouts pilot."""
    if arg not in (None, "pilot", "int4"):
        raise ValueError(f"bpe_testbed sweep argument {arg!r}: expected 'pilot', 'int4' or none")
    if arg == "int4":
        lever = ("sampler.quantization", ["fp8", "int4"])
    else:
        lever = ("sampler.temperature", [1.0, 1.3, 1.6, 2.0])
    return dict(
        config="configs/tiny_bpe.py",
        fixed="log.tensorboard=False,log.progress=False,rl.steps=200,eval.every_steps=50",
        axes=[
            ("seed", [0]),
            lever,
            ("criterion", PILOT_ARMS),
        ],
        flags={"sampler.mode": "in_process"},
        collapse_margin=0.1,
        share_warmstart_by=(),
        paired_baseline=("criterion", "ratio"),
    )
