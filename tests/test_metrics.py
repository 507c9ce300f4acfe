"""`pdm_jax.metrics`: what the run summary and the logs say about the run."""

import re

import pytest

from pdm_jax import workdir as wd
from pdm_jax.config import get_base_config
from pdm_jax.metrics import sampler_weights_format


def test_the_weights_format_names_vllm_where_our_quantization_does_not_apply():
    c = get_base_config()
    assert sampler_weights_format(c.sampler) == c.sampler.quantization == "fp8"
    c.sampler.backend = "vllm"
    assert sampler_weights_format(c.sampler) == "vllm-managed"  # the vLLM server quantizes (or not) by its own flags


def test_a_full_disk_fails_the_write_at_once_naming_enospc_and_the_file(tmp_path, monkeypatch):
    import errno

    import pytest

    from pdm_jax import metrics

    w = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
    w.write(1, "rl", {"reward": 0.5})
    w._file = open("/dev/full", "a")  # every flush: ENOSPC, as on a full disk
    with pytest.raises(wd.RunWriteError, match=r"cannot write .*metrics.jsonl: ENOSPC: No space left"):
        w.write(2, "rl", {"reward": 0.6})
    w._file = open(w.path, "a")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(w._tb, "add", full)  # the TensorBoard events: raised at the write, never a hung queue
    with pytest.raises(wd.RunWriteError, match=r"cannot write .*tensorboard: ENOSPC"):
        w.write(3, "rl", {"reward": 0.7})


def test_resume_restores_a_lost_record_once_and_a_fresh_start_drops_stale_ones(tmp_path):
    import json

    from pdm_jax.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 50, "phase": "sft", "loss": 1.0}] + [
        {"step": s, "phase": p, "x": s} for s in range(1, 8) for p in ("rl",)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 8, "phase": "rl", "x"')  # torn: step 8
    restore = {"step": 8, "x": 8.0}  # the checkpoint of RL step 8 keeps its record
    MetricsWriter(str(tmp_path), tensorboard=False, resume_from_step=9, restore=restore).close()
    recs = read_metrics(str(path))
    assert [r["step"] for r in recs if r["phase"] == "rl"] == list(range(1, 9))
    assert recs[-1] == {"step": 8, "x": 8.0, "phase": "rl", "restored_from_checkpoint": 1.0}
    MetricsWriter(str(tmp_path), tensorboard=False, resume_from_step=9, restore=restore).close()  # again: once
    assert [r["step"] for r in read_metrics(str(path)) if r["phase"] == "rl"] == list(range(1, 9))
    # a run that starts over (no checkpoint survived, e.g. a kill during the end-of-SFT save) keeps no old line
    w = MetricsWriter(str(tmp_path), tensorboard=False, fresh=True)
    w.write(50, "sft", {"loss": 1.0})
    w.close()
    assert read_metrics(str(path)) == [{"step": 50, "phase": "sft", "loss": 1.0}]


def test_tensorboard_events_hold_every_scalar_of_every_record(tmp_path):
    """The synchronous writer's event file, read back as TFRecords of `Event` protos (what TensorBoard reads)."""
    import glob
    import os
    import struct

    from tensorboardX.proto.event_pb2 import Event

    from pdm_jax.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path), tensorboard=True)
    w.write(1, "rl", {"reward": 0.5, "loss": float("nan")})
    w.write(2, "eval", {"eval_accuracy": 0.25})
    (path,) = glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))
    data, events, at = open(path, "rb").read(), [], 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        events.append(Event.FromString(data[at + 12:at + 12 + n]))
        at += 12 + n + 4
    w.close()
    scalars = [(e.step, v.tag, round(v.simple_value, 6)) for e in events for v in e.summary.value]
    assert events[0].file_version == "brain.Event:2"
    assert scalars == [(1, "rl/reward", 0.5), (2, "eval/eval_accuracy", 0.25)]  # the NaN is skipped


def test_a_summary_that_cannot_be_read_is_treated_as_missing(tmp_path):
    """`read_summary` of a finished run's summary.json: torn, nested too deep, not a map, a directory or a FIFO
    (which would block a reader) all read as missing, so the run writes it again; none raises or hangs."""
    import os

    from pdm_jax.metrics import read_summary

    path = tmp_path / "summary.json"
    assert read_summary(str(path)) is None
    for body in (b'{"steps": 3', b"[" * 100_000, b"[1, 2]", b"\xff\xfe"):
        path.write_bytes(body)
        assert read_summary(str(path)) is None, body[:10]
    path.write_bytes(b'{"steps": 3}')
    assert read_summary(str(path)) == {"steps": 3}
    path.unlink()
    os.mkfifo(path)
    assert read_summary(str(path)) is None
    path.unlink()
    path.mkdir()
    assert read_summary(str(path)) is None


def test_close_after_a_write_error_keeps_the_first_error_and_notes_the_cleanups(tmp_path):
    """metrics.jsonl unwritable mid-run: the write's RunWriteError is the one raised; the close, which fails again
    (its buffered line), is reported beside it as a note, named too; every sink is still closed."""
    from pdm_jax import metrics, workdir as wd

    w = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
    w.write(1, "rl", {"reward": 0.5})
    w._file = open("/dev/full", "a", buffering=1 << 16)  # ENOSPC at every flush
    closed = []
    tb_close = w._tb.close
    w._tb.close = lambda: (closed.append("tb"), tb_close())
    with pytest.raises(wd.RunWriteError) as e:
        with wd.close_after(w, "the metrics writer"):
            w.write(2, "rl", {"reward": 0.6})
    assert re.fullmatch(r"\[Errno 28\] cannot write \S*metrics.jsonl: ENOSPC: No space left on device .*", str(e.value))
    assert e.value.__notes__ == [
        f"also, closing the metrics writer after it failed: RunWriteError: {e.value}"]  # the same file, named
    assert closed == ["tb"] and w._file.closed
    w2 = metrics.MetricsWriter(str(tmp_path / "b"), tensorboard=False)
    w2._file = open("/dev/full", "a", buffering=1 << 16)
    w2._file.write("pending\n")
    with pytest.raises(wd.RunWriteError, match=r"cannot write \S*b/metrics.jsonl: ENOSPC"):  # named, not OSError
        w2.close()
    with pytest.raises(KeyError, match="first"):  # a non-write error of the body wins too
        with wd.close_after(metrics.MetricsWriter(str(tmp_path / "c"), tensorboard=False), "w") as w3:
            w3._file = open("/dev/full", "a", buffering=1 << 16)
            w3._file.write("pending\n")
            raise KeyError("first")


def test_directory_creation_goes_through_the_write_error_path(tmp_path):
    """weights/ unwritable (here a file in its place, which even root cannot write through): save_weights raises
    RunWriteError naming the version directory, not a bare FileExistsError/NotADirectoryError; so does the
    metrics writer's directory."""
    import numpy as np

    from pdm_jax import metrics, workdir as wd
    from pdm_jax.sampler.weights import save_weights

    (tmp_path / "weights").write_text("not a directory")
    with pytest.raises(wd.RunWriteError, match=r"cannot write \S*weights/v000001: (ENOTDIR|EEXIST)"):
        save_weights({"w": np.zeros(2, np.float32)}, str(tmp_path / "weights" / "v000001"), version=1)
    with pytest.raises(wd.RunWriteError, match=r"cannot write \S*weights/run: (ENOTDIR|EEXIST)"):
        metrics.MetricsWriter(str(tmp_path / "weights" / "run"), tensorboard=False)


def test_read_metrics_skips_a_torn_last_line_quietly_and_names_damaged_ones(tmp_path, caplog):
    """A torn last line is a crash's mark (skipped quietly); a damaged line inside the file (a byte that is not
    UTF-8, or JSON that is no object) is skipped with a warning naming the file and the line, never a bare
    UnicodeDecodeError."""
    import logging

    from pdm_jax.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": \xff3}\n[4]\n{"step": 5}\n{"step": 6, "x')
    with caplog.at_level(logging.WARNING, logger="pdm_jax.metrics"):
        assert read_metrics(str(path)) == [{"step": 1}, {"step": 2}, {"step": 5}]
    assert re.search(r"metrics.jsonl: 2 damaged line\(s\) skipped \(not a JSON object\), line\(s\) 3, 4", caplog.text)
    caplog.clear()
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x')
    with caplog.at_level(logging.WARNING, logger="pdm_jax.metrics"):
        assert read_metrics(str(path)) == [{"step": 1}]
    assert "damaged" not in caplog.text
