"""Command-line entry point: ``python -m pdm_jax.train --config=configs/tiny.py --workdir=DIR``.

Every config field can be overridden (``--config.trust_region.delta=0.1``), and a
config file takes a big_vision-style argument (``configs/tiny.py:delta=0.1,estimator=uniform_tail``).
An existing ``--workdir`` is resumed from its latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys

# transformers warns on import that PyTorch is absent; it is optional here (tokenizers and configs only).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pdm_jax.checkpointing import CheckpointError  # noqa: E402
from pdm_jax.config import (check_field_path, check_override_value, check_sampler_workdir, load_config_file,  # noqa: E402
                            validate_config)
from pdm_jax.workdir import RunWriteError, WorkdirLockedError, run_path  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py[:arg]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, summary); resumed if it exists.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the per-device memory plan of the sharded train step for "
                             "config.dry_run.{chip,num_devices} and exit (no checkpoint, data or workdir needed).")


def run(config, workdir: str, *, callbacks=(), freeze_gc: bool = False) -> dict:
    """Validates ``config`` and runs (or resumes) the job in ``workdir``; returns its summary.

    The programmatic entry point (the token-level analysis runs training through it
    with its callbacks). Raises ValueError naming a bad config field. ``freeze_gc`` (the command line's run, one per
    process) moves what the imports and the run's setup made into the cyclic GC's permanent generation
    (`gc.freeze`), so its full collections stop walking them: a quarter of a tiny run's CPU went to them.
    """
    import gc

    from pdm_jax.trainer import Trainer  # here, not at the top: --dry_run must set up devices before JAX work

    if freeze_gc:
        gc.freeze()
    trainer = Trainer(config, workdir, callbacks=callbacks)
    if freeze_gc:
        gc.freeze()
    return trainer.run()


def main(argv):
    """Runs the configured job and prints its summary as JSON."""
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (e.g. --config=configs/tiny.py)")
    if _DRY_RUN.value:  # before anything starts JAX: the fake CPU devices are set up first
        from pdm_jax import dry_run, dry_run_fit  # lazy: --dry_run sets up fake devices first

        dry_run.prepare_devices(int(_CONFIG.value.dry_run.num_devices))
        try:
            (dry_run_fit.main if _CONFIG.value.dry_run.fit else dry_run.main)(_CONFIG.value)  # fit: the knobs first
        except ValueError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        except dry_run.aot.CompilerUnavailable as e:  # e.g. dry_run.compiler=tpu without libtpu: how to install it
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
    logging.getLogger("pdm_jax").setLevel(logging.INFO)
    config = _CONFIG.value
    from pdm_jax.host_memory import reuse_freed_host_memory  # first: before any thread of JAX's backend allocates

    if config.host_memory.reuse_freed:
        reuse_freed_host_memory()
    if config.distributed:  # config.multihost, then JAX_* env vars, then auto-detection
        from pdm_jax.distributed import settings_from  # lazy: before other JAX work
        from pdm_jax.run_spec import initialize_distributed, multihost_spec

        try:
            settings_from(multihost_spec(config))  # its fields named before any use (validate_config needs devices)
        except ValueError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        initialize_distributed(config)
    try:
        validate_config(config)
        check_sampler_workdir(config, _WORKDIR.value)  # a file-mode sampler with a gs:// workdir: before any work
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    from pdm_jax.rollouts.supervisor import SamplerFailure  # lazy, as the trainer: imports JAX

    try:
        summary = run(config, _WORKDIR.value, freeze_gc=True)
    except KeyboardInterrupt:  # Ctrl-C: what is saved and how to go on, not a traceback
        print(interrupted_note(_WORKDIR.value, sys.argv[1:]), file=sys.stderr)
        sys.exit(130)
    except (WorkdirLockedError, RunWriteError, CheckpointError, ValueError, SamplerFailure) as e:  # named: no traceback
        print(f"error: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", ()):  # errors of the cleanup after it (`workdir.close_after`)
            print(f"  {note}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary, indent=2))
    print(f"summary written to {os.path.join(run_path(_WORKDIR.value), 'summary.json')}")


def interrupted_note(workdir: str, args) -> str:
    """What an interrupted run (Ctrl-C) kept: its newest complete checkpoint, read from ``WORKDIR/checkpoints``
    (`pdm_jax.checkpointing.last_saved`), and the command that resumes from it (this command again, `args` being
    its arguments)."""
    from pdm_jax.checkpointing import last_saved  # lazy, as the trainer: imports JAX

    command = "python -m pdm_jax.train " + shlex.join(args)
    saved = last_saved(os.path.join(run_path(workdir), "checkpoints"))
    if saved is None:
        return (f"interrupted: no checkpoint was saved yet in {run_path(workdir)} (the first one comes at the end of "
                f"the warm start); running the same command starts the run over:\n  {command}")
    meta = saved.meta
    if int(meta.get("rl_step", 0)) > 0:
        what = f"RL step {int(meta['rl_step'])}"
    elif meta.get("warmstart") is not None:
        what = "the evaluated warm start (before RL step 1)"
    else:
        what = f"the warm start (SFT step {int(meta.get('sft_step', 0))}), before its evaluation"
    return (f"interrupted: the last checkpoint is {saved.step} ({what}), in "
            f"{os.path.join(run_path(workdir), 'checkpoints', str(saved.step))}; the work after it is not kept. "
            f"Resume from it with the same command:\n  {command}")


def _check_overrides(argv) -> None:
    """Names an unknown ``--config.<field>=`` override, a value that does not parse as the field's kind, or a bad
    key or value of the config's argument string (``--config=FILE:ARG``), before absl applies them (exit 2, as every
    other config error; absl itself would exit 1 with a traceback)."""
    for arg in argv[1:]:
        if arg.startswith("--config=") and ":" in arg:
            try:
                load_config_file(arg[len("--config="):])  # the file's get_config(ARG), as absl will call it
            except ValueError as e:
                print(f"config error: {e} (from {arg!r})", file=sys.stderr)
                sys.exit(2)
        if arg.startswith("--config."):
            path, eq, raw = arg[len("--config."):].partition("=")
            try:
                check_field_path(path)
                if eq:
                    check_override_value(path, raw)
            except ValueError as e:
                print(f"config error: {e} (from {arg!r})", file=sys.stderr)
                sys.exit(2)


if __name__ == "__main__":
    _check_overrides(sys.argv)
    app.run(main)
