"""The main job: config validation, a short end-to-end run, resume after SIGKILL, sampler failure."""

import dataclasses
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from pdm_jax import trainer as trainer_mod
from pdm_jax.checkpointing import Checkpointer
from pdm_jax.config import apply_arg, get_base_config, validate_config
from pdm_jax.metrics import run_summary
from pdm_jax.run_spec import run_spec
from pdm_jax.rollouts.launcher import SamplerStartupError, start_sampler_server
from pdm_jax.rollouts.supervisor import SamplerFailure
from pdm_jax.trainer import Trainer
from pdm_jax.workdir import LOCK_NAME, WorkdirLock, WorkdirLockedError

from conftest import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_test_config(**overrides):
    """The tiny task with a smaller model and very few steps (seconds of compute)."""
    c = get_base_config()
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_hidden_layers = 1
    c.model.num_attention_heads = 2
    c.model.num_key_value_heads = 1
    c.model.head_dim = 16
    c.sft.steps = 10
    c.sft.batch_size = 32
    c.rl.steps = 4
    c.rl.prompts_per_step = 4
    c.rl.group_size = 4
    c.rl.num_minibatches = 2
    c.rl.max_new_tokens = 5
    c.rl.top_k_logprobs = 4
    c.rl.learning_rate = 1e-3
    c.eval.every_steps = 100
    c.eval.num_prompts = 8
    c.eval.samples_per_prompt = 2
    c.data.num_eval = 16
    c.checkpoint.every_steps = 1
    c.log.progress = False
    c.log.tensorboard = False
    c.sampler.startup_timeout_s = 240.0
    for k, v in overrides.items():
        node = c
        parts = k.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = v
    return c


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"trust_region.estimator": "gaussian_tail"}, "estimator"),
        ({"trust_region.delta": 0.0}, "delta"),
        ({"trust_region.delta": -0.1}, "delta"),
        ({"trust_region.mask": "trpo"}, "mask"),
        ({"rl.group_size": 1}, "rl.group_size"),
        ({"rl.num_minibatches": 3}, "rl.num_minibatches"),
        ({"model.hf_path": "/nonexistent/qwen3"}, "model.hf_path"),
        ({"data.kind": "gsm8k", "data.path": "/nonexistent/gsm8k.jsonl"}, "data.path"),
        ({"sampler.quantization": "int3"}, "sampler.quantization"),
        ({"rl.max_staleness": -1}, "rl.max_staleness"),
        ({"rl.pack_sequences": True, "rl.packed_length": 16}, "rl.packed_length = 16: must be 0"),
        ({"rl.pack_sequences": True, "trust_region.direction": "param_jvp"},
         "rl.pack_sequences = True: is not implemented with trust_region.direction = param_jvp"),
        ({"rl.pack_sequences": True, "model.moe_routing_replay": True, "model.num_experts": 4,
          "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16}, "rl.pack_sequences = True"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    c = tiny_test_config(**overrides)
    with pytest.raises(ValueError, match=field):
        validate_config(c)


def test_topk_larger_than_vocab_is_rejected():
    c = tiny_test_config(**{"rl.top_k_logprobs": 17})
    with pytest.raises(ValueError, match="rl.top_k_logprobs"):
        validate_config(c, vocab_size=16)


def test_config_argument_string():
    c = apply_arg(get_base_config(), "delta=0.15,estimator=uniform_tail,seed=3")
    assert c.trust_region.delta == 0.15 and c.trust_region.estimator == "uniform_tail" and c.seed == 3
    with pytest.raises(ValueError, match="nosuchfield"):
        apply_arg(get_base_config(), "nosuchfield=1")


def _run_cli(workdir, args, timeout=900):
    cmd = [sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", f"--workdir={workdir}"] + args
    env = dict(os.environ, XLA_FLAGS=xla_flags())  # one CPU device, as a user's run
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


SMALL = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1",
    "--config.model.num_attention_heads=2", "--config.model.num_key_value_heads=1", "--config.model.head_dim=16",
    "--config.sft.steps=20", "--config.sft.batch_size=32", "--config.rl.steps=4", "--config.rl.prompts_per_step=4",
    "--config.rl.group_size=4", "--config.eval.num_prompts=8", "--config.eval.samples_per_prompt=2",
    "--config.data.num_eval=16", "--config.checkpoint.every_steps=1", "--config.eval.every_steps=2",
    "--config.log.progress=False",
]

DETERMINISTIC_KEYS = ("reward", "loss", "frac_masked", "frac_outside", "mean_divergence", "entropy", "grad_norm",
                      "response_length", "mean_tail_mass")


def _sampler_pids(workdir):
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "pdm_jax.sampler.server" in cmd and str(workdir) in cmd:
            pids.append(int(pid))
    return pids


def _assert_no_sampler_left(workdir, timeout_s=20.0):
    deadline = time.time() + timeout_s
    while _sampler_pids(workdir) and time.time() < deadline:
        time.sleep(0.5)
    assert not _sampler_pids(workdir), "sampler subprocess outlived its SIGKILLed trainer"


def _rl_records(workdir):
    recs = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    return {r["step"]: r for r in recs if r["phase"] == "rl"}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted SMALL run of the README command (fp8 sampler subprocess), shared by the slow tests here.

    Returns ``(workdir, rl records by step, compile-cache flags)``; the cache directory is the tests' own, so the
    later runs load the programs this run compiled (and the tests stay independent of ``~/.cache``).
    """
    root = tmp_path_factory.mktemp("reference_run")
    cache = [f"--config.compile_cache.dir={root / 'jax_cache'}"]
    r = _run_cli(root / "full", SMALL + cache)
    assert r.returncode == 0, r.stderr[-4000:]
    # The CLI sets the allocator before JAX starts its threads (pdm_jax.host_memory; late, the step is ~40% slower).
    assert "applied after JAX started its backend" not in r.stderr
    return root / "full", _rl_records(root / "full"), cache


@pytest.mark.slow
def test_cli_end_to_end_then_resume_after_sigkill(reference_run, tmp_path):
    """A short run of the README command through the fp8 sampler subprocess, then a SIGKILLed run resumed.

    The resumed run must reproduce the uninterrupted run's metrics for the steps after the kill.
    """
    full, ref, cache = reference_run
    summary = json.load(open(full / "summary.json"))
    assert summary["steps"] == 4
    for key in ("warmstart_accuracy", "final_accuracy", "wall_seconds"):
        assert summary[key] is not None
    assert (full / "curves.png").stat().st_size > 1000
    assert sorted(ref) == [1, 2, 3, 4]
    assert all(ref[s]["staleness"] == 0 for s in ref)

    _check_step_timing(ref)
    assert ref[1]["compiles"] > 0 and ref[1]["sampler_compiles"] > 0 and ref[1]["sampler_compile_seconds"] > 0

    killed = tmp_path / "killed"  # a new workdir with the same compilation cache: programs are loaded
    r = _run_cli(killed, SMALL + cache + ["--config.debug.kill_after_rl_step=2"])
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    _assert_no_sampler_left(killed)  # the orphaned sampler notices its parent is gone and exits
    hits = _rl_records(killed)[1]
    assert hits["compile_cache_hits"] > 0 and hits["sampler_compile_cache_hits"] > 0, hits
    r = _run_cli(killed, SMALL + cache)
    assert r.returncode == 0, r.stderr[-4000:]
    got = _rl_records(killed)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        for k in DETERMINISTIC_KEYS:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-6), (s, k)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--config.rl.dynamic_sampling=True"]], ids=["plain", "dynamic_sampling"])
def test_a_resumed_async_run_trains_on_the_batches_sampled_ahead_of_its_checkpoint(reference_run, tmp_path, extra):
    """``rl.max_staleness`` = 2, SIGKILLed after RL step 2 and resumed: the checkpoint of step 2 holds the batches
    sampled ahead of it (at least batch 3's, sampled with a weights version <= 1 while step 2 trained), and the
    resumed run trains on them: its step-3 staleness is the saved batch's (>= 1), as uninterrupted, not the 0 of
    a batch sampled afresh from the checkpoint's version 2. With dynamic sampling the run goes on from the saved
    batches' data position (their `Draw`)."""
    import numpy as np
    from pdm_jax.rollouts import queued

    run = tmp_path / "run"
    args = SMALL + reference_run[2] + ["--config.rl.max_staleness=2"] + extra  # the reference run's programs
    r = _run_cli(run, args + ["--config.debug.kill_after_rl_step=2"])
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    _assert_no_sampler_left(run)
    ckpt = Checkpointer(str(run / "checkpoints"))
    step_id = ckpt.latest_step()
    assert step_id == 20 + 1 + 2  # sft.steps + the warm start's evaluation + 2 RL steps
    saved = queued.read(ckpt, step_id, 2)
    ckpt.close()
    assert 2 in saved and set(saved) <= {2, 3}  # 0-based RL steps: the third step's batch onwards
    r = _run_cli(run, args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resuming with the {len(saved)} rollout batch(es) sampled ahead of the checkpoint" in r.stderr
    got = _rl_records(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step, (rb, *_) in saved.items():  # record step + 1 trained on batch `step`: staleness = step - its version
        assert got[step + 1]["staleness"] == pytest.approx(float(np.mean(step - rb.weights_version)))
    assert got[3]["staleness"] >= 1
    if extra:  # the data position goes on from the saved draws' end (no prompt drawn twice or skipped)
        meta = json.loads((run / "checkpoints" / "25" / "meta" / "metadata").read_text())
        rounds_after = sum(int(got[s + 1]["dynamic_sampling_rounds"]) for s in range(max(saved) + 1, 4))
        assert meta["data_position"] == saved[max(saved)][3].data_end + rounds_after * 4  # 4 prompts a round


@pytest.mark.slow
def test_packed_sequences_train_the_run_the_padded_step_trains(reference_run, tmp_path):
    """``rl.pack_sequences`` from the CLI: the same RL records as the padded reference run, step by step.

    The packed step's loss and gradient are the padded step's (tests/test_packing.py), so the weights, the
    rollouts they sample and every metric follow the same path; ``packed_fill`` says how full the rows were.
    """
    _, ref, cache = reference_run
    packed = tmp_path / "packed"
    r = _run_cli(packed, SMALL + cache + ["--config.rl.pack_sequences=True"])
    assert r.returncode == 0, r.stderr[-4000:]
    got = _rl_records(packed)
    assert sorted(got) == sorted(ref)
    for s in ref:
        for k in DETERMINISTIC_KEYS:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-4, abs=1e-5), (s, k)
        assert 0.0 < got[s]["packed_fill"] < 1.0 and "packed_fill" not in ref[s]


def _check_step_timing(records):
    """Every phase of every step is timed; the phases and time_other add up to the step's wall time."""
    for step, r in records.items():
        phases = [r[f"time_{p}"] for p in ("sampling", "scoring", "advantages", "optimizer", "weight_sync", "eval",
                                           "checkpoint")]
        assert all(t >= 0 for t in phases) and r["time_other"] >= 0
        assert sum(phases) + r["time_other"] == pytest.approx(r["step_seconds"] + r["time_eval"]
                                                              + r["time_checkpoint"], rel=1e-6)
        assert r["time_optimizer"] > 0 and r["time_sampling"] > 0 and r["time_checkpoint"] > 0  # every_steps=1
        assert (r["time_eval"] > 0) == (step % 2 == 0)  # eval.every_steps=2
        assert r["time_weight_sync"] >= r["time_weight_save"] + r["time_weight_load"] > 0
        assert r["generate_seconds"] == r["time_sampling"] and r["train_seconds"] == r["time_optimizer"]


@pytest.mark.slow
def test_sampler_killed_mid_run_is_restarted_without_losing_a_batch(reference_run, tmp_path):
    # The learning rate is constant after warm-up (no decay over rl.steps), so a 3-step run's steps equal the
    # 4-step reference's first three.
    _, ref, cache = reference_run
    broken = tmp_path / "broken"
    r = _run_cli(broken, SMALL + cache + ["--config.rl.steps=3", "--config.debug.kill_sampler_after_rl_step=1"])
    assert r.returncode == 0, r.stderr[-4000:]
    got = _rl_records(broken)
    assert sorted(got) == [1, 2, 3]
    assert got[3]["sampler_restarts"] >= 1
    for s in (2, 3):
        for k in DETERMINISTIC_KEYS:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-6), (s, k)


def _run_fault(workdir, fault, args, timeout=900):
    """`_run_cli` with one fault of `tests/fault_run.py` injected (``PDM_FAULT``)."""
    cmd = [sys.executable, os.path.join(REPO, "tests", "fault_run.py"), "--config=configs/tiny.py",
           f"--workdir={workdir}"] + args
    env = dict(os.environ, PDM_FAULT=fault, XLA_FLAGS=xla_flags())
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _records(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]


def _assert_same_records(got, ref):
    """Every record of the uninterrupted run once, in its order, with its values (timings aside)."""
    assert [(r["phase"], r["step"]) for r in got] == [(r["phase"], r["step"]) for r in ref]
    for g, r in zip(got, ref):
        keys = [k for k in r if k not in ("phase", "step") and not k.startswith("time_")
                and not any(w in k for w in ("seconds", "compile", "tokens_per"))]  # timings and caches aside
        assert keys and set(keys) <= set(g), (r["phase"], r["step"])
        for k in keys:
            assert g[k] == pytest.approx(r[k], rel=1e-5, abs=1e-6), (r["phase"], r["step"], k)
        assert "restored_from_checkpoint" not in g or g["phase"] == "rl"


@pytest.mark.slow
def test_sigkill_while_orbax_writes_the_end_of_sft_checkpoint_resumes_with_every_record_once(reference_run,
                                                                                             tmp_path):
    """Killed with the warm start's checkpoint in orbax's temporary directory (arrays and meta written, no commit):
    the same command starts over (no checkpoint is intact), and the SFT record is in the file once."""
    full, _, cache = reference_run
    killed = tmp_path / "killed"
    r = _run_fault(killed, "kill_in_checkpoint=20", SMALL + cache)  # sft.steps=20: the end of the warm start
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert [n for n in os.listdir(killed / "checkpoints")] == ["20.orbax-checkpoint-tmp"]
    assert [x["phase"] for x in _records(killed)] == ["sft"]  # written before the kill
    _assert_no_sampler_left(killed)
    r = _run_cli(killed, SMALL + cache)
    assert r.returncode == 0, r.stderr[-4000:]
    _assert_same_records(_records(killed), _records(full))


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_once_naming_it_and_the_same_command_resumes_it(reference_run, small_disk):
    """The workdir's file system fills after RL step 2 (a real tmpfs, the kernel's ENOSPC): the run stops with
    exit 2 naming the file and ENOSPC, without hanging; a torn last record is left as a crash would; once the space
    is freed the same command resumes to the uninterrupted run's records, each once. A torn summary.json of the
    finished run is written again."""
    full, _, cache = reference_run
    workdir = os.path.join(small_disk.root, "run")
    t0 = time.time()
    r = _run_fault(workdir, f"fill_disk_after_rl_step=2:{small_disk.ballast}", SMALL + cache, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert re.search(r"error: .*cannot write .*/run/\S+: ENOSPC: No space left on device", r.stderr), r.stderr[-3000:]
    assert time.time() - t0 < 120  # stopped, not hung (a whole run of these shapes takes ~10 s)
    assert [x["step"] for x in _records(workdir) if x["phase"] == "rl"] == [1, 2]
    small_disk.free()
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "phase": "rl", "rew')  # torn: a crash in the middle of step 3's record
    r = _run_cli(workdir, SMALL + cache)
    assert r.returncode == 0, r.stderr[-4000:]
    _assert_same_records(_records(workdir), _records(full))
    summary_path = os.path.join(workdir, "summary.json")
    summary = json.load(open(summary_path))
    with open(summary_path, "r+") as f:
        f.truncate(40)  # torn
    r = _run_cli(workdir, SMALL + cache)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "summary.json is unreadable" in r.stderr
    again = json.load(open(summary_path))
    assert {k: v for k, v in again.items() if k != "wall_seconds"} == {
        k: v for k, v in summary.items() if k != "wall_seconds"}
    _assert_same_records(_records(workdir), _records(full))


@pytest.mark.slow
def test_an_unwritable_metrics_sink_keeps_its_error_and_the_same_command_resumes(reference_run, tmp_path):
    """metrics.jsonl, then the TensorBoard events, unwritable after RL step 2: the run exits 2 with the first
    RunWriteError naming the file (not the close's bare OSError, which is reported below it as a note), no
    traceback; the same command then resumes to the uninterrupted run's records, each once."""
    full, _, cache = reference_run
    for sink, name, why in (("metrics", "metrics.jsonl", "ENOSPC: No space left on device"),
                            ("tensorboard", "tensorboard", "EACCES: Permission denied")):
        workdir = tmp_path / sink
        r = _run_fault(workdir, f"sink_unwritable_after_rl_step=2:{sink}", SMALL + cache, timeout=600)
        assert r.returncode == 2, (sink, r.returncode, r.stderr[-3000:])
        assert re.search(rf"\nerror: .*cannot write \S*/{sink}/{name}: {why} .*\n  also, closing the metrics writer "
                         rf"after it failed: RunWriteError: .*cannot write \S*/{name}: {why}",
                         r.stderr), r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        rl_steps = [x["step"] for x in _records(workdir) if x["phase"] == "rl"]
        assert rl_steps == ([1, 2] if sink == "metrics" else [1, 2, 3])  # step 3's line precedes its events
        r = _run_cli(workdir, SMALL + cache)
        assert r.returncode == 0, r.stderr[-4000:]
        _assert_same_records(_records(workdir), _records(full))


@pytest.mark.parametrize("sampler_temperature,expected", [(None, 0.9), (1.3, 1.3)])
def test_rollouts_are_drawn_at_the_sampler_temperature(tmp_path, monkeypatch, sampler_temperature, expected):
    """sampler.temperature (the behaviour/trainer mismatch lever) reaches the sampler's generate call; None draws
    the rollouts at rl.temperature, the trainer's pi's temperature."""
    t = Trainer(tiny_test_config(**{"sampler.mode": "in_process", "rl.temperature": 0.9,
                                    "sampler.temperature": sampler_temperature}), str(tmp_path))
    asked = {}

    def generate(prompts, params):
        asked.update(dataclasses.asdict(params))
        raise InterruptedError("captured")
    try:
        monkeypatch.setattr(t.sampler, "generate", generate)
        with pytest.raises(InterruptedError, match="captured"):
            t._make_rollouts(0, 1)
    finally:
        t.close()
    assert asked["temperature"] == expected and asked["n"] == 4


def test_unreachable_sampler_fails_fast_with_a_clear_error(tmp_path):
    with socket.socket() as s:  # a free loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = tiny_test_config(**{"sampler.mode": "remote", "sampler.address": f"http://127.0.0.1:{port}",
                            "sampler.retries": 1, "sampler.request_timeout_s": 5.0})
    t = Trainer(c, str(tmp_path))
    try:
        t.sampler.push_weights(t.params, 0)
        t0 = time.time()
        with pytest.raises(SamplerFailure, match=f"127.0.0.1:{port}"):
            t.sampler.start(0)
        assert time.time() - t0 < 30
    finally:
        t.close()


def test_sampler_that_never_comes_up_is_an_error_within_the_timeout(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    t0 = time.time()
    with pytest.raises(SamplerStartupError):
        start_sampler_server(model_config=str(bad), weights=None, checkpoint_root=str(tmp_path),
                             startup_timeout_s=60)
    assert time.time() - t0 < 60


# ---------------------------------------------------------------- workdir lock, warm start, damaged checkpoints
def test_second_trainer_on_a_locked_workdir_is_refused_naming_the_holder(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": "gone"}))  # stale: does not block
    c = tiny_test_config(**{"sampler.mode": "in_process", "sampler.token": "s3cret-token"})
    first = trainer_mod.Trainer(c, str(tmp_path))
    written = (tmp_path / "config.json").read_text()  # the run's own copy of its config: no secret in clear
    assert json.loads(written)["sampler"]["token"] == "<redacted>" and "s3cret" not in written
    with pytest.raises(WorkdirLockedError, match=rf"workdir {tmp_path} is in use by another run \(pid {os.getpid()} "):
        trainer_mod.Trainer(c, str(tmp_path))
    # Multi-host: the workdir is shared, only process 0 locks it.
    monkeypatch.setattr(trainer_mod.jax, "process_index", lambda: 1)
    monkeypatch.setattr(trainer_mod.Trainer, "_setup", lambda self: None)
    assert trainer_mod.Trainer(c, str(tmp_path))._lock is None
    monkeypatch.undo()
    first.close()
    WorkdirLock(str(tmp_path)).acquire().release()  # released by close()


def test_trainer_setup_failure_releases_the_workdir_lock(tmp_path, monkeypatch):
    def fail(self):
        raise ValueError("setup failed")

    monkeypatch.setattr(Trainer, "_setup", fail)
    with pytest.raises(ValueError, match="setup failed"):
        Trainer(tiny_test_config(), str(tmp_path))
    WorkdirLock(str(tmp_path)).acquire().release()


def test_run_summary_fields_against_hand_computed_values():
    c = tiny_test_config()
    records = [
        {"step": 10, "phase": "sft", "loss": 1.0},
        {"step": 0, "phase": "eval", "eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5, "eval_reward": 0.3},
        {"step": 1, "phase": "rl", "frac_masked": 0.1, "frac_outside": 0.2},
        {"step": 2, "phase": "rl", "frac_masked": 0.3, "frac_outside": None},  # non-finite, written as null
        {"step": 2, "phase": "eval", "eval_accuracy": 0.75, "eval_reward": 0.8},
        {"step": 3, "phase": "rl", "frac_masked": 0.5, "frac_outside": 0.4},
    ]
    meta = {"rl_step": 3, "warmstart": {"eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5},
            "checkpoint_fallbacks": [{"refused_step": 14}]}
    s = run_summary(records[::-1], spec=run_spec(c), meta=meta, last_eval={"eval_accuracy": 0.75}, wall_seconds=12.5)
    assert s["frac_masked_mean"] == pytest.approx(0.3) and s["frac_outside_mean"] == pytest.approx(0.3)
    assert (s["frac_masked_last"], s["frac_outside_last"]) == (0.5, 0.4)
    assert s["evaluations"] == [
        {"rl_step": 0, "eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5, "eval_reward": 0.3},
        {"rl_step": 2, "eval_accuracy": 0.75, "eval_greedy_accuracy": None, "eval_reward": 0.8}]
    assert (s["warmstart_accuracy"], s["final_accuracy"], s["final_greedy_accuracy"]) == (0.25, 0.75, None)
    assert (s["steps"], s["sft_steps"], s["checkpoint_fallbacks"], s["wall_seconds"]) == (3, 10, 1, 12.5)
    empty = run_summary([], spec=run_spec(c), meta={"rl_step": 0}, last_eval={}, wall_seconds=0.0)
    assert empty["frac_masked_mean"] is None and empty["evaluations"] == [] and empty["checkpoint_fallbacks"] == 0


def _flip_bytes(path, n=16):
    b = bytearray(open(path, "rb").read())
    start = max(0, len(b) // 2 - n // 2)
    for i in range(start, min(len(b), start + n)):
        b[i] ^= 0xFF
    open(path, "wb").write(bytes(b))


@pytest.mark.slow
def test_failed_warmstart_eval_resumes_without_sft_and_damaged_checkpoint_falls_back(tmp_path, monkeypatch, caplog):
    """Two failures of trainer state, in one run to save compute.

    1. The first evaluation of the warm start fails: the warm start was checkpointed before it,
       so the resumed run redoes no SFT step and evaluates it to the value the failed call computed.
    2. The latest checkpoint is then damaged (16 flipped bytes in its largest file): the resumed run
       falls back to the previous one (logged, counted in summary.json, recorded in the meta) and
       redoes the last RL step to the uninterrupted run's values.
    """
    c = tiny_test_config(**{"sampler.mode": "in_process", "rl.steps": 2, "eval.every_steps": 1})
    real_evaluate = Trainer.evaluate
    computed = []

    def evaluate_then_fail(self, version):
        computed.append(real_evaluate(self, version))
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(Trainer, "evaluate", evaluate_then_fail)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        Trainer(c, str(tmp_path)).run()
    ckpts = Checkpointer(str(tmp_path / "checkpoints"))
    assert ckpts.steps() == [c.sft.steps]  # the warm start, before its evaluation
    monkeypatch.setattr(Trainer, "evaluate", real_evaluate)

    def no_sft(self, tx, writer):
        raise AssertionError("the warm start was redone")

    monkeypatch.setattr(Trainer, "_run_sft", no_sft)
    summary = Trainer(c, str(tmp_path)).run()
    assert summary["warmstart_accuracy"] == computed[0]["eval_accuracy"]
    assert summary["evaluations"][0] == dict(rl_step=0, **{k: computed[0][k] for k in
                                                           ("eval_accuracy", "eval_greedy_accuracy", "eval_reward")})
    assert [e["rl_step"] for e in summary["evaluations"]] == [0, 1, 2]
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if line.strip()]
    assert [(r["phase"], r["step"]) for r in recs if r["phase"] != "rl"] == [
        ("sft", 10), ("eval", 0), ("eval", 1), ("eval", 2)]
    ref = _rl_records(tmp_path)
    assert summary["frac_masked_mean"] == pytest.approx((ref[1]["frac_masked"] + ref[2]["frac_masked"]) / 2)
    assert summary["frac_outside_last"] == ref[2]["frac_outside"] and summary["checkpoint_fallbacks"] == 0

    latest = os.path.join(ckpts.directory, str(ckpts.latest_step()))  # RL step 2
    files = [os.path.join(d, f) for d, _, fs in os.walk(latest) for f in fs]
    _flip_bytes(max(files, key=os.path.getsize))
    with caplog.at_level(logging.WARNING, logger="pdm_jax"):
        summary = Trainer(c, str(tmp_path)).run()
    assert "FALLBACK" in caplog.text and latest in caplog.text
    assert summary["checkpoint_fallbacks"] == 1 and summary["steps"] == 2
    got = _rl_records(tmp_path)
    assert sorted(got) == [1, 2]
    for k in DETERMINISTIC_KEYS:
        assert got[2][k] == pytest.approx(ref[2][k], rel=1e-5, abs=1e-6), k
    meta = json.load(open(os.path.join(latest, "meta", "metadata")))  # the new checkpoint of RL step 2
    assert [(f["refused_step"], f["restored_step"]) for f in meta["checkpoint_fallbacks"]] == [
        (c.sft.steps + 3, c.sft.steps + 2)]


@pytest.mark.slow
def test_over_long_prompts_are_dropped_at_load_not_mid_run(tmp_path):
    """chain_sum with up to 5 terms and sampler.max_prompt_length = 10 (issue #15): the warm-start evaluation
    used to die on the first over-long held-out prompt; now such prompts never reach the sampler."""
    c = tiny_test_config(**{"data.task_config.max_terms": 5, "sampler.max_prompt_length": 10,
                            "sampler.mode": "in_process"})
    t = Trainer(c, str(tmp_path))
    try:
        lengths = [len(t.codec.encode_prompt(e.prompt)) for e in t.source.eval_examples()]
        assert max(lengths) <= 10 and len(lengths) >= c.eval.num_prompts
        assert t.source.num_eval_dropped > 0 and t.source.train_scan_dropped > 0
        assert all(len(t.codec.encode_prompt(e.prompt)) <= 10 for e in t.source.train_batch(0, 64))
        t.sampler.push_weights(t.params, 0)
        assert 0.0 <= t.evaluate(0)["eval_accuracy"] <= 1.0
    finally:
        t.close()


@pytest.mark.parametrize("mesh, needle", [
    ((1, 3), r"sampler.mesh = 1 x 3: .*num_attention_heads = 2 is not divisible by the mesh's tensor axis \(3\)"),
    ((3, 1), r"sampler.mesh = 3 x 1: .*max_batch_size = 64 is not divisible by the mesh's row shards"),
    ((4, 4), r"sampler.mesh = 4 x 4: needs 16 devices but this process has 8"),
])
def test_a_sampler_mesh_the_engine_cannot_split_is_refused_before_the_warm_start(tmp_path, mesh, needle):
    c = tiny_test_config(**{"sampler.mode": "colocated", "sampler.mesh.data": mesh[0],
                            "sampler.mesh.tensor": mesh[1]})
    c.sft.steps = 10_000  # a warm start would take minutes: the refusal comes before it
    with pytest.raises(ValueError, match=needle):
        Trainer(c, str(tmp_path))
    assert not os.path.exists(os.path.join(str(tmp_path), "metrics.jsonl"))


@pytest.mark.slow
def test_an_unreachable_remote_sampler_is_a_named_error_exit_2(tmp_path):
    """sampler.mode=remote at an address nothing listens on: one line naming the address, exit 2, no traceback."""
    # The warm start is evaluated (on the trainer's own engine) before the first rollout reaches the sampler:
    # SMALL's model, no SFT step and a 2-row evaluation keep that short.
    out = _run_cli(tmp_path / "w", SMALL + ["--config.sft.steps=0", "--config.eval.num_prompts=2",
                                            "--config.eval.samples_per_prompt=1", "--config.eval.greedy=False",
                                            "--config.sampler.mode=remote", "--config.sampler.address=http://127.0.0.1:9",
                                            "--config.sampler.retries=0"], timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: sampler.address = 'http://127.0.0.1:9' is not reachable" in out.stderr
    assert "Traceback" not in out.stderr
