"""Multi-host runs on JAX's own distributed runtime: initialisation, per-process batches, primary process.

One trainer process runs per host (TPU VM worker, GPU node, or several CPU
processes on one machine for tests). Every process executes the same program
on the same global mesh; ``jax.devices()`` lists the devices of ALL processes
once ``jax.distributed.initialize`` has run, ``jax.local_devices()`` this
process's.

* :func:`initialize` starts the runtime from explicit arguments, from the
  ``multihost`` record (:func:`settings_from`), from the environment
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
  ``JAX_LOCAL_DEVICE_IDS``) or, when those are absent, from JAX's cluster
  auto-detection (Cloud TPU, SLURM, Open MPI, ...). On CPU the cross-process
  collectives are JAX's gloo TCP collectives (``jax_cpu_collectives_implementation``).
* :func:`put_global_batch` turns host arrays into global ``jax.Array`` batches
  sharded over the mesh's batch axes with
  ``jax.make_array_from_process_local_data``: each process contributes only
  the rows held by its own devices (:func:`local_batch_rows`).
* :func:`is_primary`: only process 0 writes metrics, TensorBoard events,
  ``summary.json`` and plots. Orbax checkpoints are saved collectively (every
  process calls save; orbax writes each shard once).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from pdm_jax.rl.packing import plan_packing

log = logging.getLogger("pdm_jax.distributed")

#: Environment variables read when the config leaves a field unset.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
CPU_COLLECTIVES = ("gloo", "mpi", "none")


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Where the runtime's coordinator is and who this process is (None = resolve from env / cluster).

    Fields: ``coordinator_address`` "host:port" of process 0's coordinator;
    ``num_processes`` >= 1; ``process_id`` in [0, num_processes);
    ``local_device_ids`` device ids this process uses (GPU) or None;
    ``cpu_collectives`` "gloo" | "mpi" | "none" (CPU cross-process collectives);
    ``initialization_timeout_s`` seconds to wait for all processes.

    Raises:
      ValueError: naming the field and value when a given field is invalid.
    """

    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[tuple] = None
    cpu_collectives: str = "gloo"
    initialization_timeout_s: int = 300

    def __post_init__(self):
        if self.coordinator_address is not None:
            host, sep, port = str(self.coordinator_address).rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"multihost.coordinator_address must be 'host:port', got {self.coordinator_address!r}")
        if self.num_processes is not None and not (isinstance(self.num_processes, int) and self.num_processes >= 1):
            raise ValueError(f"multihost.num_processes must be an int >= 1, got {self.num_processes!r}")
        if self.process_id is not None:
            if not (isinstance(self.process_id, int) and self.process_id >= 0):
                raise ValueError(f"multihost.process_id must be an int >= 0, got {self.process_id!r}")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(f"multihost.process_id = {self.process_id} must be < num_processes = "
                                 f"{self.num_processes}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(f"multihost.cpu_collectives must be one of {CPU_COLLECTIVES}, "
                             f"got {self.cpu_collectives!r}")
        if not (isinstance(self.initialization_timeout_s, int) and self.initialization_timeout_s > 0):
            raise ValueError(f"multihost.initialization_timeout_s must be an int > 0, "
                             f"got {self.initialization_timeout_s!r}")


def _env_int(name: str, environ: Mapping[str, str]) -> Optional[int]:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def settings_from(multihost, environ: Optional[Mapping[str, str]] = None) -> DistributedSettings:
    """Resolves :class:`DistributedSettings` from the ``multihost`` section's record (`pdm_jax.run_spec.MultihostSpec`,
    read before validation: its timeout is checked here) then the environment.

    Config fields win; empty / sentinel values (``""``, ``0`` processes, ``-1``
    process id) fall back to ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID`` and ``JAX_LOCAL_DEVICE_IDS`` (comma-separated ints); what
    is still unset is left to JAX's cluster auto-detection.

    Raises:
      ValueError: naming the field (or environment variable) and the bad value.
    """
    environ = os.environ if environ is None else environ
    mh = multihost
    timeout = mh.initialization_timeout_s  # checked here, before any use (validate_config needs devices)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"multihost.initialization_timeout_s = {timeout!r}: must be a finite number of seconds > 0")
    address = mh.coordinator_address or environ.get(ENV_COORDINATOR) or None
    num = int(mh.num_processes) or _env_int(ENV_NUM_PROCESSES, environ)
    pid = int(mh.process_id)
    pid = pid if pid >= 0 else _env_int(ENV_PROCESS_ID, environ)
    ids_raw = mh.local_device_ids or environ.get(ENV_LOCAL_DEVICE_IDS, "")
    try:
        ids = tuple(int(x) for x in str(ids_raw).split(",") if x.strip()) or None
    except ValueError:
        raise ValueError(f"multihost.local_device_ids / {ENV_LOCAL_DEVICE_IDS} must be comma-separated ints, "
                         f"got {ids_raw!r}") from None
    return DistributedSettings(coordinator_address=address, num_processes=num, process_id=pid,
                               local_device_ids=ids, cpu_collectives=str(mh.cpu_collectives),
                               initialization_timeout_s=max(1, math.ceil(timeout)))


def initialize(settings: Optional[DistributedSettings] = None) -> None:
    """Starts JAX's distributed runtime (``jax.distributed.initialize``) with CPU collectives.

    Must run before anything touches a JAX backend (device lists, arrays, jit).
    Already-initialised runtimes are left alone (a second call is a no-op).

    Raises:
      RuntimeError: a JAX backend was already initialised in this process (too late).
      ValueError: from :class:`DistributedSettings` or JAX (missing coordinator etc.).
    """
    from jax._src import distributed as _jax_distributed  # private JAX API, only when initializing multi-host
    from jax._src import xla_bridge  # private JAX API, only when initializing multi-host

    settings = settings or DistributedSettings()
    if _jax_distributed.global_state.client is not None:
        log.info("jax.distributed already initialised (process %d)", jax.process_index())
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jax.distributed must be initialised before any JAX computation or device query "
                           "(call pdm_jax.distributed.initialize first thing in the process)")
    jax.config.update("jax_cpu_collectives_implementation",
                      None if settings.cpu_collectives == "none" else settings.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=settings.coordinator_address, num_processes=settings.num_processes,
        process_id=settings.process_id,
        local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
        initialization_timeout=settings.initialization_timeout_s)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def is_primary() -> bool:
    """True on process 0 (the one that writes logs, summaries and plots)."""

    return jax.process_index() == 0


def batch_sharding(mesh, ndim: int, batch_axes: Sequence[str] = ("data", "fsdp")):
    """``NamedSharding`` splitting the leading axis of an ``ndim``-d array over ``batch_axes``."""

    return NamedSharding(mesh, P(tuple(batch_axes), *([None] * (ndim - 1))))


def local_batch_rows(num_rows: int, mesh, batch_axes: Sequence[str] = ("data", "fsdp")) -> slice:
    """The rows [start, stop) of a global batch of ``num_rows`` that this process's devices hold.

    The batch is split over ``batch_axes`` of ``mesh``; rows held by several
    local devices (replication over the other axes) count once.

    Raises:
      ValueError: ``num_rows`` not divisible by the number of batch shards, or
        this process's rows are not one contiguous block (a mesh whose device
        order interleaves processes along the batch axes).
    """

    n_shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if num_rows % n_shards:
        raise ValueError(f"batch of {num_rows} rows is not divisible by the {n_shards} batch shards "
                         f"of mesh axes {tuple(batch_axes)} {dict(mesh.shape)}")
    index_map = batch_sharding(mesh, 1, batch_axes).addressable_devices_indices_map((num_rows,))
    starts = sorted({idx[0].indices(num_rows)[0] for idx in index_map.values()})
    size = num_rows // n_shards
    start, stop = starts[0], starts[-1] + size
    if stop - start != size * len(starts):
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows (shard starts {starts}); "
                         "order the mesh devices so each process owns a contiguous block of the batch axes")
    return slice(start, stop)


def put_global_batch(arrays, mesh, *, batch_axes: Sequence[str] = ("data", "fsdp"), process_local: bool = False):
    """Global, batch-sharded ``jax.Array``s from host arrays, correct with one or many processes.

    Args:
      arrays: a pytree of host arrays ``[N, ...]`` (a ``pdm_jax.rl.step_batch.StepBatch``
        or a name -> array mapping; None fields stay None).
      mesh: the global mesh.
      batch_axes: mesh axes the leading (row) axis is split over.
      process_local: False (default): every process passes the same GLOBAL
        batch and contributes the rows of :func:`local_batch_rows`; True: each
        process passes only its own rows (``N / process_count`` of them, in
        process order), e.g. from a per-host data loader.

    Arrays whose leading size does not divide into the batch shards (in
    global mode) are replicated on every device; every process must then pass
    the same full array.

    Returns:
      the same pytree of ``jax.Array`` with the global shapes, built by
      ``jax.make_array_from_process_local_data``.
    """

    n_shards = int(np.prod([mesh.shape[a] for a in batch_axes]))

    def put(value):
        value = np.asarray(value)
        if value.ndim == 0:
            return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), value, value.shape)
        if process_local:
            return jax.make_array_from_process_local_data(batch_sharding(mesh, value.ndim, batch_axes), value)
        if value.shape[0] % n_shards == 0:
            rows = local_batch_rows(value.shape[0], mesh, batch_axes)
            sharding = batch_sharding(mesh, value.ndim, batch_axes)
            return jax.make_array_from_process_local_data(sharding, value[rows], value.shape)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), value, value.shape)

    return jax.tree.map(put, arrays)


def with_packing(batch, mesh, *, row_length: int, rows_per_micro_batch: int, host_batch=None,
                 batch_axes: Sequence[str] = ("data", "fsdp")):
    """The device mini-batch ``batch`` with its packing plan (``rl.pack_sequences``) on the mesh.

    The plan (``pdm_jax.rl.packing.plan_packing``) is made from the host copy of the masks, the same
    on every process: ``host_batch``'s when given (every process holds the global host batch),
    otherwise gathered from the devices (per-host rollouts: each process holds only its rows). Its
    ``[N, L]`` arrays are split over ``batch_axes`` by rows (N is a multiple of the batch shards), its
    ``unpack_index`` like the batch.

    Raises:
      ValueError: from ``plan_packing`` (a sequence longer than ``row_length``, a micro-batch row count
        that does not divide into the batch shards, masks not padded on their side).
    """
    if host_batch is not None:  # every process's own copy of the global rows: no collective (it would tile them)
        masks = dict(prompt=np.asarray(host_batch.prompt_mask), completion=np.asarray(host_batch.completion_mask))
    else:
        masks = to_host(dict(prompt=batch.prompt_mask, completion=batch.completion_mask))
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    plan = plan_packing(masks["prompt"], masks["completion"], row_length=row_length,
                        rows_per_micro_batch=rows_per_micro_batch, row_multiple=shards)
    return batch.replace(packing=put_global_batch(plan, mesh, batch_axes=batch_axes))


def opt_state_shardings(tx, params, mesh):
    """Shardings of ``tx.init(params)``: each parameter-shaped leaf like its parameter, the rest replicated.

    ``jax.jit(tx.init)(params)`` alone leaves the optimizer state on ONE device
    (its zeros do not depend on the inputs' shardings), which breaks multi-device
    and multi-host steps and replicates AdamW's moments; use
    ``jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))``.
    ``params`` may be arrays or ``jax.ShapeDtypeStruct`` with ``.sharding``
    (``optax.tree_map_params`` matches the state's leaves to the parameters).
    """

    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
                                 transform_non_params=lambda _: replicated)


def to_host(tree):
    """Host numpy copies of (possibly not fully addressable) global arrays, on every process.

    Uses ``multihost_utils.process_allgather(tiled=True)`` when there are
    several processes (a collective: every process must call it), else
    ``jax.device_get``.
    """

    if jax.process_count() == 1:
        return jax.device_get(tree)

    return multihost_utils.process_allgather(tree, tiled=True)


class NullMetricsWriter:
    """Drop-in for ``pdm_jax.metrics.MetricsWriter`` on non-primary processes: writes nothing."""

    def __init__(self, path: str = os.devnull):
        self.path = path

    def write(self, *args, **kwargs) -> None:
        """Ignores the record."""

    def log_run_end(self, *args, **kwargs) -> None:
        """Ignores the run's end (process 0 logs it)."""

    def close(self) -> None:
        """Nothing to close."""
