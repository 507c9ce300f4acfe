"""Weights & Biases as a metrics sink (`pdm_jax.wandb_log`), in offline mode (no network), read back from the
offline run's own record file.

Fast tier: a `MetricsWriter` with the sink writes records, the run's end and a resume; what W&B holds is compared
with metrics.jsonl record by record. Failures (wandb missing, ``wandb.init`` raising, a call raising mid-run) are
warnings and metrics.jsonl goes on. Slow tier: a tiny in-process training run with ``log.wandb=True``, resumed.
"""
import math
import sys
import warnings

import pytest

from pdm_jax import wandb_log
from pdm_jax.metrics import MetricsWriter, plot_curves, read_metrics
from pdm_jax.wandb_log import WandbLoggingWarning, WandbSpec, offline_history, offline_runs, open_wandb

wandb = pytest.importorskip("wandb")

OFFLINE = WandbSpec(enabled=True, project="pdm-tests", run_name="", mode="offline")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B's own directories (config, cache, artifacts staging) inside the test's; no network, no console capture."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        d = tmp_path / "wandb_home" / name.lower()
        d.mkdir(parents=True)
        monkeypatch.setenv(name, str(d))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


def logged(rows, phase):
    """{step: {name: value}} of the W&B history rows of one phase (names without the phase prefix)."""
    out = {}
    for row in rows:
        if f"{phase}/step" in row:
            out[row[f"{phase}/step"]] = {k.split("/", 1)[1]: v for k, v in row.items()
                                        if k.startswith(f"{phase}/") and k != f"{phase}/step"}
    return out


def assert_same_as_metrics(rows, records):
    """Every finite scalar of every metrics.jsonl record is in W&B under ``phase/name`` at ``phase/step``."""
    for phase in {r["phase"] for r in records}:
        got = logged(rows, phase)
        want = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "phase") and v is not None}
                for r in records if r["phase"] == phase}
        assert got == want, phase  # the same floats: both are JSON of the same doubles


def test_records_run_end_and_resume_reach_the_offline_run(wandb_env):
    workdir = wandb_env / "run"
    workdir.mkdir()
    sink = open_wandb(OFFLINE, str(workdir), {"sampler": {"token": "<redacted>"}, "rl": {"steps": 2}})
    assert sink is not None
    w = MetricsWriter(str(workdir), tensorboard=False, wandb=sink)
    w.write(10, "sft", {"loss": 2.5})
    w.write(0, "eval", {"eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5, "eval_reward": 0.3})
    w.write(1, "rl", {"reward": 0.5, "frac_masked": float("nan")})  # null in metrics.jsonl, absent in W&B
    w.write(2, "rl", {"reward": 0.75, "frac_masked": 0.01})
    records = read_metrics(w.path)
    plot_curves(records, str(workdir / "curves.png"))
    summary = {"final_accuracy": 0.625, "steps": 2, "trust_region": {"delta": 0.05},
               "evaluations": [{"rl_step": 0, "eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5, "eval_reward": 0.3},
                               {"rl_step": 2, "eval_accuracy": 0.625, "eval_greedy_accuracy": 0.75,
                                "eval_reward": 0.6}]}
    w.log_run_end(summary, str(workdir / "curves.png"))
    w.close()
    rows = offline_history(str(workdir / "wandb"))
    assert_same_as_metrics(rows, records)
    assert "frac_masked" not in logged(rows, "rl")[1] and records[2]["frac_masked"] is None
    end = rows[-1]
    assert end["evaluations/_type"] == "table-file" and end["evaluations/nrows"] == 2
    assert end["evaluations/ncols"] == len(wandb_log.EVAL_COLUMNS) and end["curves/_type"] == "image-file"
    run_id = (workdir / wandb_log.RUN_ID_FILE).read_text().strip()
    [(rid, project, config)] = offline_runs(str(workdir / "wandb"))
    assert (rid, project) == (run_id, "pdm-tests") and config["sampler"] == {"token": "<redacted>"}
    assert config["rl"] == {"steps": 2}
    # a resumed run continues the same W&B run
    sink = open_wandb(OFFLINE, str(workdir), {"rl": {"steps": 3}})
    w = MetricsWriter(str(workdir), tensorboard=False, resume_from_step=3, wandb=sink)
    w.write(3, "rl", {"reward": 1.0})
    w.close()
    assert [r[0] for r in offline_runs(str(workdir / "wandb"))] == [run_id, run_id]
    assert logged(offline_history(str(workdir / "wandb")), "rl")[3] == {"reward": 1.0}


def test_wandb_failures_are_named_warnings_and_the_other_sinks_go_on(wandb_env, monkeypatch):
    workdir = str(wandb_env)
    assert open_wandb(WandbSpec(), workdir, {}) is None  # off: nothing imported, nothing written
    assert not (wandb_env / wandb_log.RUN_ID_FILE).exists()

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.warns(WandbLoggingWarning, match="wandb.init .*UsageError.*api_key"):
        assert open_wandb(OFFLINE, workdir, {}) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.warns(WandbLoggingWarning, match=r"not installed: pip install -e '\.\[wandb\]'"):
        assert open_wandb(OFFLINE, workdir, {}) is None

    class FullDisk:
        def __init__(self):
            self.logged, self.finished = [], 0

        def define_metric(self, *args, **kwargs):
            pass

        def log(self, data):
            if len(self.logged) == 1:
                raise OSError(28, "No space left on device")
            self.logged.append(data)

        def finish(self):
            self.finished += 1

    run = FullDisk()
    w = MetricsWriter(workdir, tensorboard=True, wandb=wandb_log.WandbSink(run, None))
    w.write(1, "rl", {"reward": 0.5})
    with pytest.warns(WandbLoggingWarning, match="logging rl step 2.*No space left on device"):
        w.write(2, "rl", {"reward": 0.25})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off now: no more calls, no more warnings
        w.write(3, "rl", {"reward": 0.125})
        w.log_run_end({"evaluations": []})
        w.close()
    assert run.logged == [{"rl/step": 1, "rl/reward": 0.5}] and run.finished == 0
    assert [(r["step"], r["reward"]) for r in read_metrics(w.path)] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert (wandb_env / "tensorboard").is_dir()


def test_config_fields_are_validated():
    from pdm_jax.config import get_base_config, validate_config

    for field, value, needle in (("wandb_mode", "shared", "log.wandb_mode = 'shared'"),
                                 ("wandb_project", "a/b", "log.wandb_project = 'a/b'"),
                                 ("wandb_project", "", "log.wandb_project = ''"),
                                 ("wandb_run_name", "x" * 129, "log.wandb_run_name")):
        c = get_base_config()
        c.log[field] = value
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            validate_config(c)


@pytest.mark.slow
def test_a_training_run_logs_to_wandb_offline_and_its_resume_continues_the_run(wandb_env, monkeypatch):
    from test_trainer import tiny_test_config

    from pdm_jax.trainer import Trainer

    workdir = wandb_env / "run"
    c = tiny_test_config(**{"sampler.mode": "in_process", "rl.steps": 2, "eval.every_steps": 1, "log.wandb": True,
                            "log.wandb_mode": "offline", "log.wandb_project": "pdm-tests", "log.tensorboard": True,
                            "sampler.token": "s3cret"})
    summary = Trainer(c, str(workdir)).run()
    records = read_metrics(str(workdir / "metrics.jsonl"))
    rows = offline_history(str(workdir / "wandb"))
    assert {r["phase"] for r in records} == {"sft", "eval", "rl"}
    assert_same_as_metrics(rows, records)
    assert rows[-1]["evaluations/nrows"] == len(summary["evaluations"]) == 3
    assert rows[-1]["curves/_type"] == "image-file"
    [(run_id, _, config)] = offline_runs(str(workdir / "wandb"))
    assert config["sampler"]["token"] == "<redacted>" and config["rl"]["steps"] == 2
    # resumed for one more step, W&B failing mid-run: a warning, and training and metrics.jsonl go on
    real_log = wandb.Run.log

    def log_fails_at_step_3(self, data, *args, **kwargs):
        if data.get("rl/step") == 3:
            raise OSError(28, "No space left on device")
        return real_log(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", log_fails_at_step_3)
    c.rl.steps = 3
    with pytest.warns(WandbLoggingWarning, match="rl step 3"):
        summary = Trainer(c, str(workdir)).run()
    assert summary["steps"] == 3 and [r["step"] for r in read_metrics(str(workdir / "metrics.jsonl"))
                                      if r["phase"] == "rl"] == [1, 2, 3]
    assert [r[0] for r in offline_runs(str(workdir / "wandb"))] == [run_id, run_id]
    assert not math.isnan(summary["final_accuracy"])
