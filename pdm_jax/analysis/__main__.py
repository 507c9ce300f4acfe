"""CLI of the token-level analysis: ``python -m pdm_jax.analysis {run,report,disagreement_map} ...``.

``run`` runs ``--seeds`` short tiny-task runs with the `AlignmentCallback` in one process, saves each seed under
``<out>/seeds/`` and writes the report; ``report`` rebuilds ``<out>/README.md`` and the figures from saved seeds;
``disagreement_map`` maps where the two direction tests can disagree on synthetic logits. The committed report::

    python -m pdm_jax.analysis run --out=reports/analysis --seeds=20

On the stress testbed (``configs/tiny_stress.py``), from one shared warm start::

    python -m pdm_jax.train --config=configs/tiny_stress.py:rl.steps=0 --workdir=runs/stress_warmstart
    python -m pdm_jax.analysis run --setting=stress --warmstart=runs/stress_warmstart \
        --out=reports/analysis_stress_61seeds --seeds=61"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import tempfile
import time
from typing import Optional


def _parse_seeds(text: str) -> list:
    """"20" -> 0..19; "3-7" -> 3..7; "1,4,9" -> [1, 4, 9]. Raises ValueError for anything else."""
    text = text.strip()
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        if "-" in text:
            a, b = text.split("-", 1)
            return list(range(int(a), int(b) + 1))
        n = int(text)
    except ValueError:
        raise ValueError(f"--seeds={text!r}: expected N, A-B or a comma-separated list") from None
    if n < 1:
        raise ValueError(f"--seeds={text!r}: need at least one seed")
    return list(range(n))


def _disagreement_map(args, parser) -> int:
    """The ``disagreement_map`` subcommand: computes the map, writes it, prints its summary; returns 0."""
    import dataclasses

    import jax

    from pdm_jax.analysis import disagreement_map as dm

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out={args.out!r} exists and is not a directory")
    spec = dm.MapSpec()
    if args.positions is not None:
        try:
            spec = dataclasses.replace(spec, positions=tuple(int(x) for x in args.positions.split(",")))
        except ValueError as e:
            parser.error(f"--positions={args.positions!r}: {e}")
    command = "python -m pdm_jax.analysis disagreement_map --out=" + args.out + (
        f" --positions={args.positions}" if args.positions is not None else "")
    dm.run(args.out, spec, command=command, provenance=f"JAX {jax.__version__} on {jax.default_backend()}")
    print("\n".join(dm.summary(dm.read_csv(os.path.join(args.out, "cells.csv")))))
    print(f"map written to {os.path.join(args.out, 'README.md')}")
    return 0


def config_spec_of(config_file: str, arg: str = "", overrides: str = "", seed: Optional[int] = None):
    """The `RunSpec` of ``config_file`` with ``arg``, ``overrides`` and ``seed=<seed>`` (`pdm_jax.config.apply_arg`):
    the analysis reads its config files here, at the command line, and hands records down. Raises ValueError naming a
    bad field."""
    from pdm_jax.config import apply_arg, load_config_file  # lazy: --help answers without importing JAX
    from pdm_jax.run_spec import as_run_spec

    config = load_config_file(config_file + (":" + arg if arg else ""))
    if overrides:
        apply_arg(config, overrides)
    if seed is not None:
        apply_arg(config, f"seed={seed}")
    return as_run_spec(config)


def report_spec(seeds: list):
    """The `RunSpec` the saved ``seeds`` ran with (their settings' config file, argument string and overrides), or
    None when it is not readable here (a missing or changed config file): the report is written without it."""
    settings = seeds[0].get("settings", {}) if seeds else {}
    try:
        return config_spec_of(settings["config"], settings.get("arg", ""), settings.get("overrides", ""))
    except Exception:  # noqa: BLE001 - a report must still be written without the config file
        return None


def main(argv=None) -> int:
    """CLI of the token-level analysis (`run` seeds, `report` from saved seeds, or the synthetic `disagreement_map`);
    returns the exit code."""
    from pdm_jax.analysis.run import SETTINGS  # lazy: --help answers without importing JAX

    p = argparse.ArgumentParser(prog="python -m pdm_jax.analysis", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run seeds with the analysis callback, then write the report")
    r.add_argument("--out", required=True, help="output directory (seeds/, README.md, figures)")
    r.add_argument("--seeds", default="20", help="N (seeds 0..N-1), A-B, or a comma-separated list")
    r.add_argument("--setting", default="tiny", choices=sorted(SETTINGS),
                   help="named analysis setting: tiny = configs/tiny.py with run.DEFAULT_ARG (δ = 0.005, fp8); "
                        "stress = configs/tiny_stress.py with run.STRESS_ARG (int8, 16 optimizer steps per batch, "
                        "δ = 0.05, 6 RL steps); bpe = configs/tiny_bpe.py with run.BPE_ARG (V 1,024, K 20, rollouts "
                        "at sampler.temperature 1.6, δ = 0.05, 12 RL steps); between = configs/tiny_between.py with "
                        "run.BETWEEN_ARG (number_between, many right answers, V 1,024, K 20, sampler.weight_noise "
                        "0.45, δ = 0.05, 12 RL steps); between_comparison = configs/tiny_between.py with "
                        "run.BETWEEN_COMPARISON_ARG (the PDM / DPPO comparison's lever: rollouts up to 8 versions "
                        "stale at sampler.temperature 1.15, lr 3e-4, δ = 0.05, trained with PDM aggregated_tail; its "
                        "9 RL steps all sample from the warm start)")
    r.add_argument("--config", default=None, help="config file (get_config(arg)); default: the --setting's")
    r.add_argument("--arg", default=None, help="config argument string; default: the --setting's")
    r.add_argument("--warmstart", default=None,
                   help="a finished warm-start workdir of the same config (rl.steps=0) shared by every seed, "
                        "which then varies only the RL phase (default: each seed trains its own)")
    r.add_argument("--overrides", default="", help="extra key=value,... applied after --arg (e.g. delta=0.01)")
    r.add_argument("--isolated_tokens", type=int, default=8, help="tokens per optimizer step in isolated mode (0=off)")
    r.add_argument("--isolated_step", type=float, default=1e-2, help="isolated normalized step length ε")
    r.add_argument("--no_full_mu", action="store_true", help="skip recomputing μ from the quantized weights")
    r.add_argument("--no_param_direction", action="store_true",
                   help="skip the parameter-space Ḋᵖ (one jvp through the model per optimizer step)")
    r.add_argument("--compile_cache", default=os.path.join(tempfile.gettempdir(), "pdm_jax_xla_cache"),
                   help="persistent XLA compilation cache shared by the seeds ('' = off)")
    r.add_argument("--no_report", action="store_true")
    q = sub.add_parser("report", help="rebuild the report from <out>/seeds")
    q.add_argument("--out", required=True)
    m = sub.add_parser("disagreement_map", help="where the ratio and predictive direction tests can disagree: a map "
                       "on synthetic logits (writes <out>/cells.csv and <out>/README.md)")
    m.add_argument("--out", required=True)
    m.add_argument("--positions", default=None,
                   help="positions per cell, one per vocabulary size, comma-separated (default: MapSpec's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from absl import logging as absl_logging  # lazy: --help answers without importing JAX

    absl_logging.set_verbosity(absl_logging.WARNING)
    from pdm_jax.analysis import report, run  # lazy: --help answers without importing JAX

    if args.cmd == "disagreement_map":
        return _disagreement_map(args, m)
    if args.cmd == "run":
        try:
            seeds = _parse_seeds(args.seeds)
        except ValueError as e:
            r.error(str(e))
        t0 = time.time()
        config_spec, arg = SETTINGS[args.setting]
        config_spec, arg = args.config or config_spec, arg if args.arg is None else args.arg
        run.run_seeds(seeds, args.out, functools.partial(config_spec_of, config_spec, arg, args.overrides or ""),
                      config_spec=config_spec, arg=arg, overrides=args.overrides or None,
                      warmstart=args.warmstart,
                      isolated_tokens=args.isolated_tokens, isolated_step=args.isolated_step,
                      full_mu=not args.no_full_mu, param_direction=not args.no_param_direction,
                      compile_cache=args.compile_cache or None)
        print(f"{len(seeds)} seeds in {time.time() - t0:.0f}s")
        if args.no_report:
            return 0
    loaded = run.load_seeds(os.path.join(args.out, "seeds"))
    if not loaded:
        print(f"no saved seeds under {os.path.join(args.out, 'seeds')}", file=sys.stderr)
        return 1
    report.write_report(loaded, args.out, spec=report_spec(loaded))
    print("\n".join(report.readings(loaded)))
    print(f"report written to {os.path.join(args.out, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
