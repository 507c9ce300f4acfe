"""Per-host rollouts: in a multi-process run each process samples only its own share of an RL step.

An RL step's N = P x G rows (prompt-major) are split over the mesh's batch axes in contiguous blocks, each process
holding its devices' blocks (`pdm_jax.distributed.local_batch_rows`). With ``sampler.per_host_rollouts`` process p
samples exactly the prompts ``[lo, hi)`` whose rows land on its devices: whole groups, so advantages are computed
locally (`host_prompt_range` refuses a block that cuts a group); ``first_prompt_index = lo`` keys the samples by
global prompt, so the tokens equal a single-process run's; the process's host `StepBatch` becomes the global batch
(`assemble`), minibatches are gathered on the devices (`select_rows`) and per-row metric values back to every process
(`gather_rows`). Evaluation is split the same way (`eval_prompt_range`, `gather_ragged`); process 0 writes it."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from pdm_jax.distributed import batch_sharding, local_batch_rows, put_global_batch, to_host

BATCH_AXES = ("data", "fsdp")


def enabled(distributed: bool, per_host_rollouts: bool) -> bool:
    """Whether this run samples per host: a ``distributed`` run with ``sampler.per_host_rollouts`` and more than one
    process."""
    return bool(distributed) and bool(per_host_rollouts) and jax.process_count() > 1


def host_prompt_range(num_prompts: int, group_size: int, mesh, batch_axes: Sequence[str] = BATCH_AXES) -> tuple:
    """``(lo, hi)``: the prompts of an RL step whose rows this process's devices hold.

    Args:
      num_prompts: P (``rl.prompts_per_step``).
      group_size: G (``rl.group_size``).
      mesh: the global train mesh; rows are split over ``batch_axes``.

    Raises:
      ValueError: naming rl.prompts_per_step, rl.group_size, mesh.data / mesh.fsdp and the process count, when N does
        not split over the batch shards, a process's rows are not contiguous, or its block cuts a group."""
    n = num_prompts * group_size
    shards = {a: int(mesh.shape[a]) for a in batch_axes}
    what = (f"per-host rollouts (sampler.per_host_rollouts): rl.prompts_per_step = {num_prompts} x "
            f"rl.group_size = {group_size} = {n} rows over the batch shards "
            + " x ".join(f"mesh.{a} = {s}" for a, s in shards.items()) + f" of {jax.process_count()} processes")
    try:
        rows = local_batch_rows(n, mesh, batch_axes)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if rows.start % group_size or rows.stop % group_size:
        raise ValueError(f"{what}: process {jax.process_index()} holds rows [{rows.start}, {rows.stop}), which "
                         f"cut a group of {group_size} samples; each process must hold whole groups (make "
                         "rl.prompts_per_step a multiple of the process count x the batch shards per process, or "
                         "set sampler.per_host_rollouts=False to sample every prompt on every process)")
    return rows.start // group_size, rows.stop // group_size


def assemble(batch, mesh, batch_axes: Sequence[str] = BATCH_AXES):
    """The global device batch from each process's own rows (a host `StepBatch` of its block)."""
    return put_global_batch(batch, mesh, batch_axes=batch_axes, process_local=True)


def _replicated(x: np.ndarray, mesh) -> jax.Array:
    """The same host array on every process as a replicated global array."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x, x.shape)


@functools.lru_cache(maxsize=None)
def _take_program(mesh, batch_axes: tuple, split: bool):
    """One jitted row gather per (mesh, batch axes, split or replicated output): compiled once per shape."""

    def take(batch, idx):
        def one(x):
            rows = jnp.take(x, idx, axis=0)
            sharding = batch_sharding(mesh, rows.ndim, batch_axes) if split else NamedSharding(mesh, P())
            return jax.lax.with_sharding_constraint(rows, sharding)
        return jax.tree.map(one, batch)

    return jax.jit(take)


def select_rows(batch, rows: np.ndarray, mesh, batch_axes: Sequence[str] = BATCH_AXES):
    """Rows ``rows`` (host ints, the same on every process) of a global device batch, gathered on the devices and split
    over ``batch_axes`` as `put_global_batch` would split ``host_batch.select(rows)``."""
    rows = np.asarray(rows, np.int32)
    n_shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    program = _take_program(mesh, tuple(batch_axes), rows.shape[0] % n_shards == 0)
    return program(batch, _replicated(rows, mesh))


def gather_rows(arrays: dict, mesh, batch_axes: Sequence[str] = BATCH_AXES) -> dict:
    """Host copies of the global ``[N, ...]`` arrays whose rows each process holds a block of (a collective)."""
    return to_host(assemble(arrays, mesh, batch_axes))


def gather_max(value: float) -> float:
    """The largest ``value`` over all processes (a collective)."""
    return float(np.max(multihost_utils.process_allgather(np.asarray([value], np.float64))))


def eval_prompt_range(num_prompts: int) -> tuple:
    """``(lo, hi)``: this process's contiguous share of ``num_prompts`` held-out prompts (``np.array_split``)."""
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(num_prompts), jax.process_count())])
    p = jax.process_index()
    return int(bounds[p]), int(bounds[p + 1])


def gather_ragged(values: np.ndarray, total: int, per_item: int = 1) -> np.ndarray:
    """All processes' ``values`` (each ``[(hi - lo) * per_item]`` of its `eval_prompt_range` of ``total``), in order: a
    collective; shares are padded to the largest for the all-gather."""
    sizes = [len(a) * per_item for a in np.array_split(np.arange(total), jax.process_count())]
    width = max(sizes)
    padded = np.zeros((width,), np.asarray(values).dtype)  # the dtype kept: means equal a single process's
    padded[:len(values)] = values
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), width)
    return np.concatenate([every[p, :s] for p, s in enumerate(sizes)])

