"""The default run's held-out gain over seeds x device counts: the range the README and configs/tiny.py state.

Runs the README's command (`configs/tiny.py`) once per (seed, device count), one after another, each in its own
workdir under ``--out`` (a finished run, one with a ``summary.json``, is read, not rerun), then prints one row per
run (warm start, the evaluations, the gain in held-out avg@4 and greedy accuracy) and the ranges over all runs.
Device counts are XLA's fake CPU devices (``--xla_force_host_platform_device_count``): the trainer's mesh shards
the batch over them, which changes the order of floating-point reductions, so each count is a run of its own.

    python bench/default_run_range.py --out=runs/range --seeds=0,1,2,3,4 --devices=1,8
    python bench/default_run_range.py --out=runs/range --report_only     # the table of the runs already there

Exit status 1 when a run failed or any run's gain is below ``--min_gain`` (0.10, what configs/tiny.py promises).
"""

import argparse
import json
import os
import subprocess
import sys
import time


def run_one(out: str, seed: int, devices: int, overrides: list) -> dict:
    """Runs (or reads) one default run; returns its summary.json as a dict (empty if the run failed)."""
    workdir = os.path.join(out, f"seed{seed}_dev{devices}")
    summary = os.path.join(workdir, "summary.json")
    if not os.path.exists(summary):
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"]
                                             if devices > 1 else []))
        cmd = [sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", f"--workdir={workdir}",
               f"--config.seed={seed}", "--config.log.progress=False", *overrides]
        t0 = time.time()
        with open(workdir + ".log", "w") as log:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"seed {seed}, {devices} device(s): exit {rc} after {time.time() - t0:.0f} s", flush=True)
    return json.load(open(summary)) if os.path.exists(summary) else {}


def table(results: dict, min_gain: float) -> tuple:
    """(markdown lines, ok): one row per run and the ranges of the warm start, final accuracy and gain."""
    lines = ["| seed | devices | avg@4 after the warm start | at each evaluation | gain | greedy | wall s |",
             "|---:|---:|---:|---|---:|---|---:|"]
    gains, starts, ok = [], [], True
    for (seed, devices), s in sorted(results.items()):
        if not s:
            lines.append(f"| {seed} | {devices} | failed | | | | |")
            ok = False
            continue
        evals = s["evaluations"]
        gain = s["final_accuracy"] - s["warmstart_accuracy"]
        gains.append(gain)
        starts.append(s["warmstart_accuracy"])
        ok &= gain >= min_gain
        lines.append(f"| {seed} | {devices} | {s['warmstart_accuracy']:.4f} | "
                     + " / ".join(f"{e['eval_accuracy']:.4f}" for e in evals[1:])
                     + f" | **{gain:+.4f}** | {s['warmstart_greedy_accuracy']:.3f} → {s['final_greedy_accuracy']:.3f}"
                     f" | {s['wall_seconds']:.0f} |")
    if gains:
        lines.append("")
        lines.append(f"{len(gains)} runs: warm start {min(starts):.4f}-{max(starts):.4f}, gain {min(gains):+.4f} to "
                     f"{max(gains):+.4f} (mean {sum(gains) / len(gains):+.4f}); every gain >= {min_gain}: "
                     f"{'yes' if ok else 'NO'}")
    return lines, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory of the runs' workdirs")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated config seeds")
    p.add_argument("--devices", default="1,8", help="comma-separated fake CPU device counts")
    p.add_argument("--min_gain", type=float, default=0.10, help="the least gain in held-out avg@4 every run must show")
    p.add_argument("--report_only", action="store_true", help="print the table of the runs in --out, run nothing")
    a, overrides = p.parse_known_args(argv)  # the rest: --config.FIELD=VALUE overrides for every run
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        p.error(f"unknown arguments {bad} (extra arguments must be --config.FIELD=VALUE overrides)")
    os.makedirs(a.out, exist_ok=True)
    results = {}
    for devices in (int(d) for d in a.devices.split(",")):
        for seed in (int(s) for s in a.seeds.split(",")):
            path = os.path.join(a.out, f"seed{seed}_dev{devices}", "summary.json")
            if a.report_only:
                if os.path.exists(path):
                    results[seed, devices] = json.load(open(path))
            else:
                results[seed, devices] = run_one(a.out, seed, devices, overrides)
    lines, ok = table(results, a.min_gain)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
