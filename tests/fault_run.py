"""The main job (``python -m pdm_jax.train`` and its flags) with one fault injected, for the fault tests.

``PDM_FAULT`` names the fault:

- ``kill_in_checkpoint=<id>``: SIGKILL the trainer while orbax holds checkpoint ``<id>`` in its temporary
  directory, every array and the meta written, before the commit marker and the rename (the end of the warm start
  is id ``sft.steps``).
- ``fill_disk_after_rl_step=<N>:<ballast path>``: right after RL step ``N``'s record is written, fill the file
  system holding ``<ballast path>`` (the test's small tmpfs, which holds the workdir too) until the kernel answers
  ENOSPC, so that whatever the run writes next meets a full disk. Deleting the ballast frees the space.
- ``sink_unwritable_after_rl_step=<N>:<sink>``: right after RL step ``N``'s record is written, one sink of the
  metrics writer fails on every later write and at its close, as a file made read-only, immutable or full would:
  ``metrics`` (metrics.jsonl: ENOSPC at each flush, /dev/full) or ``tensorboard`` (the events file: EACCES).

Only the tests run this; the production code has no fault hook of its own for these.
"""

import errno
import os
import signal
import sys


def _kill_in_checkpoint(step_id: str) -> None:
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killing_finalize(self, *args, **kwargs):
        if self._final_path.name == step_id:
            os.kill(os.getpid(), signal.SIGKILL)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize


def fill_disk(ballast: str, leave: int = 0) -> None:
    """Writes the file `ballast` until the kernel answers ENOSPC: its file system is full; then gives `leave`
    bytes back (room for small files, not for large ones)."""
    chunk = b"\0" * (1 << 16)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        if leave:
            f.truncate(max(0, f.tell() - leave))


def _fill_disk_after(rl_step: int, ballast: str) -> None:
    from pdm_jax import metrics

    write = metrics.MetricsWriter.write

    def filling_write(self, step, phase, values):
        rec = write(self, step, phase, values)
        if phase == "rl" and int(step) == rl_step:
            fill_disk(ballast)
            print(f"fault: filled the disk under {ballast} after RL step {rl_step}", file=sys.stderr, flush=True)
        return rec

    metrics.MetricsWriter.write = filling_write


def _sink_unwritable_after(rl_step: int, sink: str) -> None:
    from pdm_jax import metrics

    write = metrics.MetricsWriter.write

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    def breaking_write(self, step, phase, values):
        rec = write(self, step, phase, values)
        if phase == "rl" and int(step) == rl_step:
            if sink == "metrics":
                self._file = open("/dev/full", "a", buffering=1 << 16)
            else:
                self._tb.add = self._tb.close = denied
            print(f"fault: {sink} unwritable after RL step {rl_step}", file=sys.stderr, flush=True)
        return rec

    metrics.MetricsWriter.write = breaking_write


def install(fault: str) -> None:
    kind, _, arg = fault.partition("=")
    if kind == "kill_in_checkpoint":
        _kill_in_checkpoint(arg)
    elif kind == "fill_disk_after_rl_step":
        step, _, ballast = arg.partition(":")
        _fill_disk_after(int(step), ballast)
    elif kind == "sink_unwritable_after_rl_step":
        step, _, sink = arg.partition(":")
        _sink_unwritable_after(int(step), sink)
    else:
        raise ValueError(f"PDM_FAULT: unknown fault {fault!r}")


if __name__ == "__main__":
    install(os.environ["PDM_FAULT"])
    from absl import app

    from pdm_jax import train

    train._check_overrides(sys.argv)
    app.run(train.main)
