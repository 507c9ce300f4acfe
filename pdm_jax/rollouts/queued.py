"""Rollout batches sampled ahead of a checkpoint, saved with it, so that a resumed async run trains on them.

With ``rl.max_staleness`` = s > 0 the producer samples up to s batches ahead with weights versions gone once the run
stops, so the trainer saves them with each RL checkpoint (``RolloutProducer.snapshot``) and hands them back on
resume. One file per process, ``queued_rollouts.p<process index>.npz`` in the checkpoint's directory (covered by its
manifest): ``np.savez`` of plain arrays (loaded with ``allow_pickle=False``) holding per step ``k`` the
`RolloutBatch` fields (``s<k>.<field>``), its examples as JSON, the generation seconds and, with dynamic sampling,
its ``Draw``, plus ``format``, ``max_staleness``, ``process_count``, ``steps`` and ``key`` (:func:`batch_key`). A
file written under another staleness, process count or key is not used (logged): those steps are sampled afresh."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from typing import Optional

import jax
import numpy as np

from pdm_jax import workdir as wd
from pdm_jax.data.tasks import Example
from pdm_jax.rollout import RolloutBatch
from pdm_jax.rollouts.dynamic_sampling import Draw

log = logging.getLogger(__name__)

FORMAT = 1
_FIELDS = [f.name for f in dataclasses.fields(RolloutBatch)]


def file_name(process_index: int) -> str:
    """The file of process ``process_index`` in a checkpoint's directory."""
    return f"queued_rollouts.p{int(process_index)}.npz"


def batch_key(rl, temperature: float, dynamic_sampling: bool) -> dict:
    """The settings a queued batch was sampled under that a resumed run must share to train on it: its rows
    (``rl.prompts_per_step`` x ``rl.group_size``, grouped by G), widths (``rl.max_new_tokens``, ``rl.top_k_logprobs``),
    distribution (the sampling ``temperature``) and item layout (``dynamic_sampling``: a ``Draw`` and the data position
    it carries). ``rl``: the validated config's ``rl`` section (or any object with those attributes). JSON values,
    compared after a JSON round trip."""
    return dict(prompts_per_step=int(rl.prompts_per_step), group_size=int(rl.group_size),
                max_new_tokens=int(rl.max_new_tokens), top_k=int(rl.top_k_logprobs), temperature=float(temperature),
                dynamic_sampling=bool(dynamic_sampling))


def encode(items: dict, *, max_staleness: int, process_count: int, key: Optional[dict] = None) -> bytes:
    """``{step: (RolloutBatch, [Example], generation seconds[, Draw])}`` as the bytes of one ``.npz`` file (the
    `pdm_jax.rollouts.dynamic_sampling.Draw` with ``rl.dynamic_sampling``).

    Raises:
      TypeError: an item that is not such a tuple (naming its step).
    """
    arrays = dict(format=np.int64(FORMAT), max_staleness=np.int64(max_staleness),
                  process_count=np.int64(process_count), steps=np.asarray(sorted(items), np.int64))
    if key is not None:
        arrays["key"] = np.asarray(json.dumps(key, sort_keys=True))
    for step, item in items.items():
        rb, examples, seconds, *draw = item
        if not isinstance(rb, RolloutBatch) or not (draw == [] or (len(draw) == 1 and isinstance(draw[0], Draw))):
            raise TypeError(f"queued step {step}: expected (RolloutBatch, examples, seconds[, Draw]), got "
                            f"({', '.join(type(x).__name__ for x in item)})")
        if draw:
            arrays[f"s{step}.draw"] = np.asarray(json.dumps(dict(data_end=int(draw[0].data_end),
                                                                 counts=draw[0].counts)))
            if draw[0].filler is not None:
                arrays[f"s{step}.filler"] = np.asarray(draw[0].filler, bool)
        for name in _FIELDS:
            value = getattr(rb, name)
            if value is not None:
                arrays[f"s{step}.{name}"] = np.asarray(value, str) if name == "finish_reason" else value
        arrays[f"s{step}.examples"] = np.asarray(json.dumps([dataclasses.asdict(e) for e in examples]))
        arrays[f"s{step}.seconds"] = np.float64(seconds)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode(data: bytes, *, max_staleness: int, process_count: int, where: str = "",
           key: Optional[dict] = None) -> dict:
    """The ``{step: (RolloutBatch, [Example], seconds[, Draw])}`` of :func:`encode`, or ``{}`` (logged) when written
    under another ``max_staleness``, process count or ``key``; ValueError for an unknown format (naming ``where``)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        if int(z["format"]) != FORMAT:
            raise ValueError(f"{where}: queued rollouts of format {int(z['format'])}, expected {FORMAT}")
        saved = (int(z["max_staleness"]), int(z["process_count"]))
        if saved != (int(max_staleness), int(process_count)):
            log.warning("%s: queued rollouts written with rl.max_staleness = %d on %d process(es), this run has %d "
                        "on %d: not used, those steps are sampled again from the checkpoint's weights version",
                        where, *saved, max_staleness, process_count)
            return {}
        if key is not None:
            saved_key = json.loads(str(z["key"])) if "key" in z.files else {}
            want = json.loads(json.dumps(key, sort_keys=True))
            if saved_key != want:
                diff = sorted(k for k in set(saved_key) | set(want) if saved_key.get(k) != want.get(k))
                log.warning("%s: queued rollouts written with %s, this run has %s: not used, those steps are sampled "
                            "again from the checkpoint's weights version", where,
                            {k: saved_key.get(k) for k in diff}, {k: want.get(k) for k in diff})
                return {}
        items = {}
        for step in z["steps"].tolist():
            fields = {name: z[f"s{step}.{name}"] for name in _FIELDS if f"s{step}.{name}" in z.files}
            fields["finish_reason"] = fields["finish_reason"].astype(object)
            examples = [Example(**e) for e in json.loads(str(z[f"s{step}.examples"]))]
            item = (RolloutBatch(**fields), examples, float(z[f"s{step}.seconds"]))
            if f"s{step}.draw" in z.files:
                d = json.loads(str(z[f"s{step}.draw"]))
                filler = z[f"s{step}.filler"] if f"s{step}.filler" in z.files else None
                item += (Draw(data_end=d["data_end"], filler=filler, counts=d["counts"]),)
            items[int(step)] = item
        return items


def checkpoint_files(snapshot: Optional[dict], max_staleness: int, *, key: Optional[dict] = None,
                     process_index: Optional[int] = None, process_count: Optional[int] = None) -> Optional[dict]:
    """``{file name: bytes}`` to save with an RL checkpoint (None with ``max_staleness`` = 0: nothing to keep). ``key``:
    the run's :func:`batch_key`. ``process_index`` / ``process_count`` default to JAX's."""
    if max_staleness <= 0 or snapshot is None:
        return None
    index, count = _process(process_index, process_count)
    return {file_name(index): encode(snapshot, max_staleness=max_staleness, process_count=count, key=key)}


def _process(index, count):
    return (jax.process_index() if index is None else int(index), jax.process_count() if count is None else int(count))


def read(checkpointer, step: Optional[int], max_staleness: int, *, key: Optional[dict] = None,
         process_index: Optional[int] = None, process_count: Optional[int] = None) -> dict:
    """The queued batches saved with checkpoint ``step`` of ``checkpointer`` (a `pdm_jax.checkpointing.Checkpointer`)
    for this process: ``{}`` when there is no checkpoint, no file, ``max_staleness`` = 0, or a file of another
    :func:`batch_key` than ``key`` (:func:`decode`). ``process_index`` / ``process_count`` default to JAX's."""
    if step is None or max_staleness <= 0:
        return {}
    index, count = _process(process_index, process_count)
    data = checkpointer.read_file(step, file_name(index))
    if data is None:
        return {}
    items = decode(data, max_staleness=max_staleness, process_count=count, key=key,
                   where=wd.join(checkpointer.step_path(step), file_name(index)))
    if items:
        log.info("resuming with the %d rollout batch(es) sampled ahead of the checkpoint (steps %s)",
                 len(items), sorted(items))
    return items
