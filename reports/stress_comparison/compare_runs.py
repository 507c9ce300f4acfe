#!/usr/bin/env python
"""Compare two sets of run directories record by record, timing fields aside (issue 16's re-check).

Usage::

    python reports/stress_comparison/compare_runs.py DIR_A DIR_B NAME [NAME ...]

NAME is a run directory under both DIR_A and DIR_B (e.g. ``_warmstart/all``,
``seed=0_delta=0.05_criterion=ratio``). For each it matches the ``metrics.jsonl`` records by
(phase, step) and prints how many values are bit-equal, the first difference, the first RL step
whose sampled rollouts differ (reward / response length / valid tokens), the largest |a - b| per
field, and the ``summary.json`` fields that differ. Timing fields (``time_*``, ``*_seconds``,
compile counters, ``sampler_tokens_per_second``) are left out: they depend on the machine's load.
"""
import json
import math
import os
import sys

TIMING_PREFIXES = ("time_", "compile", "sampler_compile")
TIMING = {"step_seconds", "generate_seconds", "train_seconds", "sampler_tokens_per_second", "wall_seconds"}
ROLLOUT = ("reward", "response_length", "num_valid")


def is_timing(field):
    return field in TIMING or field.startswith(TIMING_PREFIXES)


def records(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[(r.get("phase"), r.get("step"))] = r
    return out


def flatten(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flatten(v, f"{prefix}{k}.")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], x


def difference(a, b):
    """|a - b| for numbers (0 for two NaNs), else 0 if equal and inf if not."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return 0.0 if (math.isnan(a) and math.isnan(b)) else abs(a - b)
    return 0.0 if a == b else math.inf


def compare(dir_a, dir_b, name):
    ra, rb = records(os.path.join(dir_a, name)), records(os.path.join(dir_b, name))
    keys = list(ra) + [k for k in rb if k not in ra]
    largest, n_values, n_equal, first, first_rollout = {}, 0, 0, None, None
    for key in keys:
        a, b = ra.get(key), rb.get(key)
        if a is None or b is None:
            continue
        for f in sorted(set(a) | set(b)):
            if is_timing(f):
                continue
            d = difference(a[f], b[f]) if (f in a and f in b) else math.inf
            n_values, n_equal = n_values + 1, n_equal + (d == 0)
            largest[f] = max(largest.get(f, 0.0), d)
            if d and first is None:
                first = (key, f, a.get(f), b.get(f))
            if d and first_rollout is None and key[0] == "rl" and f in ROLLOUT:
                first_rollout = key[1]
    unmatched = sum((k in ra) != (k in rb) for k in keys)
    print(f"== {name}: {len(ra)} vs {len(rb)} records ({unmatched} unmatched), {n_values} values compared "
          f"(timing aside), {n_equal} bit-equal")
    print(f"   first difference: {first}; first RL step with different rollouts: {first_rollout}")
    for f, d in sorted(largest.items()):
        if d:
            print(f"   {f}: max |diff| = {d:.3g}")
    sa = dict(flatten(json.load(open(os.path.join(dir_a, name, "summary.json")))))
    sb = dict(flatten(json.load(open(os.path.join(dir_b, name, "summary.json")))))
    differ = [(k, sa.get(k), sb.get(k)) for k in sorted(set(sa) | set(sb))
              if not is_timing(k.split(".")[-1]) and difference(sa.get(k), sb.get(k))]
    print(f"   summary.json: {len(differ)} of {len(set(sa) | set(sb))} fields differ (timing aside)"
          + "".join(f"\n     {k}: {x} vs {y}" for k, x, y in differ))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    for run in sys.argv[3:]:
        compare(sys.argv[1], sys.argv[2], run)
