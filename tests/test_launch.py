"""launch/: sweep expansion, local runner (shared warm start), table aggregation, tpu_pod.sh --dry-run."""

import contextlib
import gzip
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from pdm_jax.rl import trust_region as tr
from pdm_jax.config import apply_arg, get_base_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep_module():
    spec = importlib.util.spec_from_file_location("launch_sweep", os.path.join(REPO, "launch", "sweep.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sweep = _sweep_module()


def test_issue_sweep_expands_to_18_config_strings():
    d = sweep.load_sweep(os.path.join(REPO, "launch", "sweeps", "tiny_delta_estimator.py"))
    runs = sweep.expand(d)
    assert len(runs) == 18
    assert len({r["name"] for r in runs}) == 18
    first = runs[0]
    assert first["point"] == {"delta": 0.05, "criterion": "ratio", "seed": 0}
    assert first["config_arg"].startswith("configs/tiny.py:")
    assert first["arg"].endswith("delta=0.05,mask=dppo,seed=0")
    by_name = {r["name"]: r for r in runs}
    r = by_name["delta=0.15_criterion=pdm_bucket_exact_seed=2"]
    assert r["arg"].endswith("delta=0.15,mask=pdm,estimator=bucket_exact,seed=2")
    # Every argument string is accepted by the config's own parser and sets what it says.
    c = apply_arg(get_base_config(), r["arg"])
    tr = c.trust_region
    assert (tr.delta, tr.mask, tr.estimator, c.seed) == (0.15, "pdm", "bucket_exact", 2)
    assert c.rl.max_staleness == 1 and c.rl.num_iterations == 2
    cmd = sweep.train_command(r, "/tmp/wd")
    assert cmd[1:3] == ["-m", "pdm_jax.train"] and "--workdir=/tmp/wd" in cmd
    assert "--config.sampler.mode=in_process" in cmd


def test_criterion_axis_selects_the_trust_region_direction_criteria():
    """The sweep's criterion names map onto pdm_jax.rl.trust_region's criteria and their config fields."""
    assert list(sweep.CRITERIA) == ["ratio", "pdm_aggregated_tail", "pdm_uniform_tail", "pdm_bucket_exact", "ppo",
                                    "ppo_clip_higher", "none", "pdm_param_jvp"]
    for name in tr.DIRECTION_CRITERIA:
        items = sweep.CRITERIA[name if name == "ratio" else f"pdm_{name}"]
        c = apply_arg(get_base_config(), items)
        assert {k: c.trust_region[k] for k in tr.criterion_settings(name)} == tr.criterion_settings(name)
    assert sweep.CRITERIA["pdm_uniform_tail"] == "mask=pdm,estimator=uniform_tail"
    assert (sweep.CRITERIA["ratio"], sweep.CRITERIA["ppo"], sweep.CRITERIA["none"]) == ("mask=dppo", "mask=ppo",
                                                                                         "mask=none")
    c = apply_arg(get_base_config(), sweep.CRITERIA["ppo_clip_higher"])  # GRPO + DAPO clip-higher
    assert (c.trust_region.mask, c.trust_region.clip_eps_low, c.trust_region.clip_eps_high) == ("ppo", 0.2, 0.28)
    c = apply_arg(get_base_config(), sweep.CRITERIA["pdm_param_jvp"])
    assert (c.trust_region.mask, c.trust_region.direction) == ("pdm", "param_jvp")


def _recording_fake(tmp_path, warm_accuracy=0.1, weights=""):
    """A fake `python -m pdm_jax.train --config=SPEC --workdir=DIR ...` for run_local: records each call's SPEC in
    DIR/calls.txt (preceded by "resumed" when DIR holds a warm start) and in all_calls.txt beside the script, its
    cwd and PYTHONPATH, and writes two checkpoints, a weights copy, metrics.jsonl and summary.json."""
    fake = tmp_path / "fake_python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        "for a in \"$@\"; do case \"$a\" in --workdir=*) wd=\"${a#*=}\";; --config=*) cfg=\"${a#*=}\";; esac; done\n"
        "mkdir -p \"$wd\"; if [[ -f \"$wd/warm.txt\" ]]; then echo resumed >> \"$wd/calls.txt\"; fi\n"
        "echo \"$cfg\" >> \"$wd/calls.txt\"; echo \"$cfg\" >> \"$(dirname \"$0\")/all_calls.txt\"\n"
        "if [[ \"$cfg\" == *rl.steps=0 ]]; then echo warm > \"$wd/warm.txt\"; fi\n"
        "pwd > \"$wd/cwd.txt\"; echo \"$PYTHONPATH\" > \"$wd/pp.txt\"\n"
        "mkdir -p \"$wd/checkpoints/1\" \"$wd/checkpoints/2\" \"$wd/weights/v000000\"\n"
        "touch \"$wd/checkpoints/1/state\" \"$wd/checkpoints/2/state\" \"$wd/weights/v000000/params\"\n"
        + (f"echo {weights} > \"$wd/checkpoints/2/state\"\n" if weights else "") +
        "echo '{\"phase\": \"rl\", \"step\": 1, \"reward\": 0.5}' > \"$wd/metrics.jsonl\"\n"
        f"echo '{{\"warmstart_accuracy\": {warm_accuracy}, \"final_accuracy\": 0.2, \"steps\": 1}}' "
        "> \"$wd/summary.json\"\n")
    fake.chmod(0o755)
    return fake


def test_keep_filter_and_one_shared_warm_start(tmp_path):
    """`keep` drops grid points (e.g. delta for masks without a radius); share_warmstart_by=() = one warm start."""
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("delta", [0.05, 0.15]),
                                                                   ("criterion", ["none", "ratio"]), ("seed", [0, 1])],
                                  keep=lambda p: p["criterion"] != "none" or p["delta"] == 0.05,
                                  share_warmstart_by=()))
    runs = sweep.expand(d)
    assert [r["name"] for r in runs] == [
        "delta=0.05_criterion=none_seed=0", "delta=0.05_criterion=none_seed=1", "delta=0.05_criterion=ratio_seed=0",
        "delta=0.05_criterion=ratio_seed=1", "delta=0.15_criterion=ratio_seed=0", "delta=0.15_criterion=ratio_seed=1"]
    with pytest.raises(ValueError, match="keep"):
        sweep.validate_sweep(dict(d, keep=3))
    fake = _recording_fake(tmp_path)
    out = str(tmp_path / "sweep")
    res = sweep.run_local(runs, out, python=str(fake), share_warmstart_by=(), log=lambda *_: None)
    assert [r["returncode"] for r in res] == [0] * 6
    assert os.listdir(os.path.join(out, "_warmstart")) == ["all"]
    for r in runs:  # each run's workdir started as a copy of the one warm start
        assert open(os.path.join(out, r["name"], "calls.txt")).read().count("rl.steps=0") == 1


@pytest.mark.parametrize("bad, field", [
    (dict(axes=[]), "axes"),
    (dict(axes=[("criterion", ["ratio", "magic"])]), "criterion"),
    (dict(axes=[("delta", [0.1]), ("delta", [0.2])]), "twice"),
    (dict(axes=[("delta", ["0.1,seed=3"])]), "may not contain"),
    (dict(axes=[("data.path", ["a/x", "b/x"])]), "may not contain"),  # two runs named x
    (dict(axes=[("delta", [0.1])], share_warmstart_by=("seed",)), "share_warmstart_by"),
])
def test_bad_sweep_definitions_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        sweep.validate_sweep(dict(dict(config="configs/tiny.py"), **bad))


def test_print_only_and_pod_commands():
    path = os.path.join(REPO, "launch", "sweeps", "tiny_delta_estimator.py")
    out = subprocess.run([sys.executable, "launch/sweep.py", f"--sweep={path}", "--out=runs/x", "--print_only"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 18 and all(line.startswith("python -m pdm_jax.train --config=configs/tiny.py:") for line in out)
    pod = subprocess.run([sys.executable, "launch/sweep.py", f"--sweep={path}", "--out=gs://b/s", "--print_only",
                          "--pod", "--tpu_name=pdm", "--only=criterion=ratio_seed=0"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(pod) == 2  # delta 0.05 and 0.15
    assert pod[0].startswith("launch/tpu_pod.sh --name=pdm-000 ") and "--workdir=gs://b/s/delta=0.05" in pod[0]
    assert "--results" not in pod[0]  # a bucket workdir: every host's shards there, resumable
    local = subprocess.run([sys.executable, "launch/sweep.py", f"--sweep={path}", "--out=runs/s", "--print_only",
                            "--pod", "--only=criterion=ratio_seed=0"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert "--workdir=/tmp/pdm_run --results=runs/s/delta=0.05" in local[0]
    bare = subprocess.run([sys.executable, "launch/sweep.py", f"--sweep={path}", "--out=gs://", "--print_only",
                           "--pod"], cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 2 and "--out='gs://'" in bare.stderr and "Traceback" not in bare.stderr


def test_aggregate_only_without_runs_says_so(tmp_path):
    path = os.path.join(REPO, "launch", "sweeps", "tiny_delta_estimator.py")
    done = subprocess.run([sys.executable, "launch/sweep.py", f"--sweep={path}", f"--out={tmp_path}",
                           "--aggregate_only"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no finished runs under {tmp_path}: none of the sweep's 18 run directories" in done.stderr


def _fake_run(workdir, rewards, evals, warm=0.30, final=None):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "phase": "eval", "eval_accuracy": warm}) + "\n")
        for i, r in enumerate(rewards):
            f.write(json.dumps({"step": i + 1, "phase": "rl", "reward": r, "frac_masked": 0.1 * (i + 1),
                                "frac_outside": 0.2, "frac_direction_disagree": 0.01 * (i + 1),
                                "mean_topk_kl": 0.002}) + "\n")
        for step, acc in evals:
            f.write(json.dumps({"step": step, "phase": "eval", "eval_accuracy": acc}) + "\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(dict(warmstart_accuracy=warm, final_accuracy=evals[-1][1] if final is None else final,
                       final_greedy_accuracy=0.5, steps=len(rewards), wall_seconds=12.0), f)


def test_aggregate_table_by_hand(tmp_path):
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("criterion", ["ratio"]), ("seed", [0, 1])]))
    runs = sweep.expand(d)
    out = str(tmp_path)
    # seed 0: rewards 0.2, 0.4 -> area 0.3; evals 0.25 (not a collapse: 0.30 - 0.1 = 0.2), 0.15 (collapse).
    _fake_run(os.path.join(out, runs[0]["name"]), [0.2, 0.4], [(1, 0.25), (2, 0.15)])
    # seed 1: area 0.5; no collapse; final 0.45.
    _fake_run(os.path.join(out, runs[1]["name"]), [0.4, 0.6], [(1, 0.35), (2, 0.45)])
    table = sweep.aggregate(runs, out)
    rows = {r["name"]: r for r in table["rows"]}
    r0 = rows[runs[0]["name"]]
    assert r0["reward_area"] == pytest.approx(0.3)
    assert r0["mean_frac_masked"] == pytest.approx(0.15)
    assert r0["mean_frac_direction_disagree"] == pytest.approx(0.015)  # the mean over RL steps of 0.01, 0.02
    assert r0["collapse_events"] == 1 and r0["eval_points"] == 2
    assert r0["accuracy_gain"] == pytest.approx(-0.15)
    assert rows[runs[1]["name"]]["collapse_events"] == 0
    (g,) = table["groups"]
    m, ci = g["final_accuracy"]
    assert m == pytest.approx(0.30)
    t975 = 12.706204736174698  # Student's t, 97.5% quantile, 1 degree of freedom
    assert ci == pytest.approx(t975 * math.sqrt(((0.15 - 0.3) ** 2 + (0.45 - 0.3) ** 2) / 1) / math.sqrt(2))
    assert os.path.exists(os.path.join(out, "sweep_runs.csv"))
    md = open(os.path.join(out, "sweep_table.md")).read()
    assert "| ratio | 2 |" in md and "0.300 ± " in md
    assert r0["collapsed"] == 1 and rows[runs[1]["name"]]["collapsed"] == 0
    assert g["collapsed"][0] == pytest.approx(0.5)  # collapse rate: 1 of 2 seeds
    assert g["gained"] == 1 and "| 1/2 |" in md  # seed 1 ends 0.15 above its warm start
    assert "| 2.00e-03 ± 0.000 |" in md  # top-K KL column
    assert sweep.plot_sweep(runs, out).endswith("sweep_curves.png")
    assert sweep.collapse_events([0.1, None, 0.5], None, 0.1) == 0


def test_local_runner_shares_the_warm_start(tmp_path):
    """run_local with a fake trainer: one warm start per seed, copied into each run's workdir."""
    fake = _recording_fake(tmp_path)
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("criterion", ["ratio", "pdm_bucket_exact"]),
                                                                   ("seed", [0, 1])], share_warmstart_by=("seed",)))
    runs = sweep.expand(d)
    out = str(tmp_path / "sweep")
    res = sweep.run_local(runs, out, python=str(fake), share_warmstart_by=("seed",), log=lambda *_: None)
    assert [r["returncode"] for r in res] == [0, 0, 0, 0]
    assert sorted(os.listdir(os.path.join(out, "_warmstart"))) == ["seed=0", "seed=1"]
    for r in runs:
        calls = open(os.path.join(out, r["name"], "calls.txt")).read().split()
        # the copy carries the warm start's own call; then the run is resumed from it
        assert calls[0].endswith("rl.steps=0") and calls[1] == "resumed" and calls[2] == r["config_arg"]
    # A second invocation skips finished runs.
    res = sweep.run_local(runs, out, python=str(fake), share_warmstart_by=("seed",), log=lambda *_: None)
    assert all(r["skipped"] for r in res)
    meta = json.loads(open(os.path.join(out, runs[0]["name"], "sweep_run.json")).read().splitlines()[-1])
    assert meta["code_dir"] == REPO and meta["command"][0] == str(fake)
    assert meta["machine"] == sweep.machine() and f"{os.cpu_count()} cores" in meta["machine"]


def test_local_runner_pinned_code_dir_with_relative_out(tmp_path, monkeypatch):
    """Runs execute in code_dir, but a relative --out still means relative to where the sweep was started."""
    fake = _recording_fake(tmp_path)
    code = tmp_path / "pinned"
    code.mkdir()
    (code / "COMMIT").write_text("abc1234\n")
    start = tmp_path / "start"
    start.mkdir()
    monkeypatch.chdir(start)
    runs = sweep.expand(sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0])])))
    sweep.run_local(runs, "rel_out", python=str(fake), code_dir=str(code), log=lambda *_: None)
    wd = start / "rel_out" / runs[0]["name"]
    assert (wd / "summary.json").exists()
    assert (wd / "cwd.txt").read_text().strip() == str(code)
    assert (wd / "pp.txt").read_text().strip().split(os.pathsep)[0] == str(code)
    assert json.loads((wd / "sweep_run.json").read_text())["code_version"] == "abc1234"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("accelerator,version", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5p-128", "v2-alpha-tpuv5"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v6e-8", "v2-alpha-tpuv6e"), ("tpu7x-8", None)])
def test_tpu_pod_runtime_image_follows_the_generation(accelerator, version):
    """Cloud TPU lists a runtime image per TPU generation: the default image follows the accelerator type's
    generation, a type the script has no image for is refused naming --accelerator and --version, and --version
    always wins."""
    cmd = ["bash", "launch/tpu_pod.sh", "--dry-run", "--name=pdm-img", "--project=p", "--zone=z",
           f"--accelerator={accelerator}", "--workdir=/tmp/run_img"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    if version is None:
        assert p.returncode == 2 and f"--accelerator='{accelerator}'" in p.stderr and "--version=" in p.stderr
    else:
        assert p.returncode == 0, p.stderr
        assert f"--accelerator-type={accelerator} --version={version}" in p.stdout
    p = subprocess.run(cmd + ["--version=my-image"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"--accelerator-type={accelerator} --version=my-image" in p.stdout, p.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tpu_pod_dry_run_prints_every_step():
    cmd = ["bash", "launch/tpu_pod.sh", "--dry-run", "--name=pdm-test", "--project=proj-1", "--zone=us-central2-b",
           "--accelerator=v4-32", "--config=configs/tiny.py:delta=0.05,seed=1", "--workdir=/tmp/run1",
           "--results=runs/pod1", "--flag=--config.rl.steps=10"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("+ ")]
    gc = "+ gcloud compute tpus tpu-vm "
    assert lines[0] == (gc + "create pdm-test --project=proj-1 --zone=us-central2-b --accelerator-type=v4-32 "
                        "--version=tpu-ubuntu2204-base")
    assert lines[1].startswith("+ git -C ") and "archive" in lines[1]
    assert lines[2].startswith(gc + "scp ") and lines[2].endswith("--worker=all")
    assert lines[3].startswith(gc + "ssh pdm-test") and "--worker=all" in lines[3] and "tar xzf" in lines[3]
    assert "--worker=all" in lines[4] and "pip install -q -e ." in lines[4] and "jax[tpu]==0.10.2" in lines[4]
    train = [line for line in lines if "pdm_jax.train" in line]
    assert len(train) == 1
    t = train[0]
    assert t.startswith(gc + "ssh pdm-test --project=proj-1 --zone=us-central2-b --worker=all ")
    assert ("python3 -m pdm_jax.train --config=configs/tiny.py:delta=0.05,seed=1 --workdir=/tmp/run1 "
            "--config.distributed=True --config.sampler.mode=colocated --config.rl.steps=10") in t
    assert t.endswith("| tee runs/pod1/pod.log")  # streamed here and kept
    assert lines[-4] == gc + ("scp --recurse pdm-test:/tmp/run1 pdm-test:/tmp/run1.log runs/pod1/ --project=proj-1 "
                              "--zone=us-central2-b --worker=0")
    # the workdir's files move up out of the folder scp made, so runs/pod1 is the run directory (summary.json there)
    assert lines[-3:-1] == ["+ cp -r runs/pod1/run1/. runs/pod1/", "+ rm -rf runs/pod1/run1"]
    assert lines[-1] == gc + "delete pdm-test --project=proj-1 --zone=us-central2-b --quiet"
    order = [i for i, line in enumerate(lines) if any(s in line for s in ("create", "pip install", "pdm_jax.train",
                                                                    "scp --recurse", "delete"))]
    assert order == sorted(order) and len(order) == 5
    assert not os.path.exists(os.path.join(REPO, "runs", "pod1"))  # --dry-run ran nothing


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("args, msg", [
    (["--project=p", "--zone=z", "--accelerator=v4-8"], "--name is required"),
    (["--name=x1", "--zone=z", "--accelerator=v4-8"], "--project is required"),
    (["--name=Bad_Name", "--project=p", "--zone=z", "--accelerator=v4-8"], "--name='Bad_Name'"),
    (["--name=x1", "--project=p", "--zone=z", "--accelerator=v4-8", "--bogus=1"], "unknown argument"),
    (["--name=x1", "--project=p", "--zone=z", "--accelerator=v4-8", "--workdir=runs/x"], "--workdir='runs/x'"),
])
def test_tpu_pod_bad_flags(args, msg):
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run"] + args, cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and msg in p.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tpu_pod_dry_run_gcs_results_and_git_repo():
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run", "--name=pdm-x", "--project=p", "--zone=z",
                        "--accelerator=v5litepod-16", "--results=gs://bucket/run", "--repo=https://example.com/r.git",
                        "--spot", "--keep", "--workdir=/tmp/pdm_run//"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("+ ")]
    assert lines[0].endswith("--spot")
    assert "git clone --depth 1 --branch main https://example.com/r.git" in lines[1]
    # the trailing slashes are dropped: the worker's log is /tmp/pdm_run.log beside the workdir, not inside it
    assert "--workdir=/tmp/pdm_run --config.distributed=True" in p.stdout and "| tee /tmp/pdm_run.log" in p.stdout
    assert "gsutil -m cp -r /tmp/pdm_run/* /tmp/pdm_run.log gs://bucket/run/" in lines[-2] and "--worker=0" in lines[-2]
    assert lines[-1] == "+ gsutil cp /tmp/pdm-x_pod.log gs://bucket/run/pod.log"  # every worker's output, from here
    assert not any(" delete " in line for line in lines) and "--keep" in p.stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
def test_tpu_pod_failed_training_still_copies_results_and_deletes(tmp_path):
    """A fake gcloud on PATH: the training ssh fails; the script copies worker 0's workdir, deletes the VM."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env bash\n"
                    f"echo \"$*\" >> {calls}\n"
                    "case \"$*\" in *pdm_jax.train*) echo 'worker 0: Traceback' ; exit 3;; esac\n"
                    "exit 0\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    results = tmp_path / "results"
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--name=pdm-fail", "--project=p", "--zone=z",
                        "--accelerator=v4-8", f"--results={results}", "--workdir=/tmp/pdm_run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3
    log = calls.read_text().splitlines()
    verbs = [line.split()[3] for line in log]  # compute tpus tpu-vm <verb>
    assert verbs == ["describe", "create", "scp", "ssh", "ssh", "ssh", "scp", "delete"]
    assert "pdm_jax.train" in log[5] and "--recurse" in log[6] and "--worker=0" in log[6]
    assert "worker 0: Traceback" in (results / "pod.log").read_text()
    assert not os.path.exists("/tmp/pdm-fail_src.tar.gz")  # the code tarball is cleaned up


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
@pytest.mark.parametrize("train_rc", [0, 3])
def test_tpu_pod_remote_pipe_keeps_the_training_exit_status(tmp_path, train_rc):
    """The worker runs the training piped into `tee`: a fake gcloud runs that --command for real (through
    `sh -c`, as a login shell without pipefail would) with a fake python3 exiting `train_rc`. A failed
    training fails the script (not "done") and deletes the VM; a good one reports done. Both keep the log, and the
    copy-back (the fake's scp copies on this machine) leaves the workdir's files directly in --results."""
    worker_home = tmp_path / "worker"
    (worker_home / "pdm_jax_src").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f"#!/usr/bin/env bash\necho \"train: $*\"\necho 'Traceback: boom' >&2\nexit {train_rc}\n")
    python3.chmod(0o755)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text("#!/usr/bin/env bash\n"
                      "for a in \"$@\"; do case \"$a\" in --command=*) cmd=\"${a#--command=}\";; esac; done\n"
                      "case \"$*\" in *pdm_jax.train*) cd " + str(worker_home) + " && exec sh -c \"$cmd\";; esac\n"
                      "case \"$*\" in *'scp --recurse'*)\n"
                      "  for a in \"$@\"; do case \"$a\" in */) dest=\"$a\";; esac; done\n"
                      "  for a in \"$@\"; do case \"$a\" in pdm-pipe:*) cp -r \"${a#pdm-pipe:}\" \"$dest\";; "
                      "esac; done;;\n"
                      "esac\n"
                      "exit 0\n")
    gcloud.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    results, workdir = tmp_path / "results", tmp_path / "wd"
    (workdir / "checkpoints").mkdir(parents=True)  # what worker 0's run leaves (the same disk here)
    (workdir / "summary.json").write_text("{}")
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--name=pdm-pipe", "--project=p", "--zone=z",
                        "--accelerator=v4-8", f"--results={results}", f"--workdir={workdir}",
                        "--flag=--config.data.instruction=it's fine"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == train_rc, (p.stdout, p.stderr)
    assert ("# done: results in" in p.stdout) == (train_rc == 0)
    assert "delete pdm-pipe" in p.stdout
    remote_log = (tmp_path / "wd.log").read_text()  # the worker's tee copy, with stderr
    assert "Traceback: boom" in remote_log
    assert "--config.data.instruction=it's fine" in remote_log  # the quoting survives two shells
    assert (results / "summary.json").exists() and (results / "checkpoints").is_dir() and (results / "wd.log").exists()
    assert not (results / "wd").exists()  # the files, not a folder inside --results
    assert "Traceback: boom" in (results / "pod.log").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tpu_pod_bucket_workdir_dry_run():
    """--bucket (or PDM_BUCKET): the workdir is <bucket>/<name> on every worker, colocated sampler, no copy-back."""
    base = ["bash", "launch/tpu_pod.sh", "--dry-run", "--name=pdm-b", "--project=p", "--zone=z", "--accelerator=v4-32"]
    for args, env in ((["--bucket=gs://bkt/runs/"], {}), ([], {"PDM_BUCKET": "gs://bkt/runs"})):
        p = subprocess.run(base + args + ["--flag=--config.rl.steps=3"], cwd=REPO, capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, **env))
        assert p.returncode == 0, p.stderr
        lines = [line for line in p.stdout.splitlines() if line.startswith("+ ")]
        train = [line for line in lines if "pdm_jax.train" in line]
        assert len(train) == 1
        assert ("--workdir=gs://bkt/runs/pdm-b --config.distributed=True --config.sampler.mode=colocated "
                "--config.rl.steps=3 2>&1 | tee /tmp/pdm-b_train.log") in train[0]
        assert not any("scp --recurse" in line or "gsutil" in line for line in lines)  # nothing copied back
        assert "# done: results in gs://bkt/runs/pdm-b" in p.stdout
        assert lines[-1].endswith("delete pdm-b --project=p --zone=z --quiet")
    p = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PDM_BUCKET"})
    assert p.returncode == 2 and "needs a bucket" in p.stderr
    p = subprocess.run(base + ["--bucket=/tmp/x"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--bucket='/tmp/x'" in p.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
@pytest.mark.parametrize("state, verbs", [
    ("READY", ["describe", "scp", "ssh", "ssh", "ssh", "delete"]),  # a re-run on a live VM reuses it
    ("PREEMPTED", ["describe", "delete", "create", "scp", "ssh", "ssh", "ssh", "delete"]),  # recreated
    ("", ["describe", "create", "scp", "ssh", "ssh", "ssh", "delete"]),  # no VM: created
])
def test_tpu_pod_rerun_reuses_or_recreates_the_vm(tmp_path, state, verbs):
    """A fake gcloud answers `describe` with the VM's state; with a bucket workdir the same command re-runs
    the training (which resumes from the bucket) and never copies anything back."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env bash\n"
                    f"echo \"$*\" >> {calls}\n"
                    f"case \"$*\" in *describe*) [ -n '{state}' ] && echo '{state}' && exit 0; exit 1;; esac\n"
                    "exit 0\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--name=pdm-re", "--project=p", "--zone=z", "--accelerator=v4-8",
                        "--bucket=gs://bkt/r", f"--results={tmp_path / 'results'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    log = calls.read_text().splitlines()
    assert [line.split()[3] for line in log] == verbs
    assert any("--workdir=gs://bkt/r/pdm-re" in line for line in log)


def test_stress_config_and_comparison_sweep():
    """configs/tiny_stress.py validates; the comparison grid has the issue-16 arms, radius-free arms once, and
    every argument string parses to the fields it names."""
    import runpy

    from pdm_jax.config import validate_config

    get = runpy.run_path(os.path.join(REPO, "configs", "tiny_stress.py"))["get_config"]
    c = get("mask=dppo,seed=3")
    validate_config(c)
    assert (c.rl.num_minibatches, c.rl.num_iterations, c.rl.max_staleness, c.sampler.quantization, c.seed) == (
        4, 4, 1, "int8", 3)
    d = sweep.load_sweep(os.path.join(REPO, "launch", "sweeps", "stress_comparison.py"))
    runs = sweep.expand(d)
    crit = {(r["point"]["delta"], r["point"]["criterion"]) for r in runs}
    assert ("0.15", "none") not in {(str(a), b) for a, b in crit} and (0.05, "none") in crit
    assert len(runs) == 8 * (2 + 2 * 5) and d["share_warmstart_by"] == ()
    assert len(sweep.expand(sweep.load_sweep(os.path.join(REPO, "launch", "sweeps", "stress_comparison.py"),
                                             "core"))) == 8 * 5
    for r in runs[:10]:
        c = get(r["arg"])
        assert c.seed == r["point"]["seed"] and c.trust_region.delta == r["point"]["delta"]
        if r["point"]["criterion"] == "ppo_clip_higher":
            assert (c.trust_region.mask, c.trust_region.clip_eps_high) == ("ppo", 0.28)


def test_bpe_testbed_sweeps_expand_into_valid_runs():
    """launch/sweeps/bpe_testbed.py: the temperature pilot and the int4 pilot expand into 4 x 3 and 2 x 3 runs whose
    configs validate and set the lever; a bad argument is named."""
    import runpy

    from pdm_jax.config import validate_config

    path = os.path.join(REPO, "launch", "sweeps", "bpe_testbed.py")
    get = runpy.run_path(os.path.join(REPO, "configs", "tiny_bpe.py"))["get_config"]
    for arg, field, values in (("pilot", "temperature", {1.0, 1.3, 1.6, 2.0}),
                               ("int4", "quantization", {"fp8", "int4"})):
        runs = sweep.expand(sweep.load_sweep(path, arg))
        assert len(runs) == len(values) * 3
        seen = set()
        for r in runs:
            c = get(r["arg"])
            validate_config(c)
            seen.add(getattr(c.sampler, field))
            assert c.rl.steps == 200 and c.tokenizer.kind == "bpe"
        assert seen == values
    with pytest.raises(ValueError, match="'int2'"):
        sweep.load_sweep(path, "int2")


def test_between_testbed_pilot_expands_into_valid_runs():
    """launch/sweeps/between_testbed.py: 2 seeds x 3 arms of configs/tiny_between.py that validate, with the
    weight-noise lever set and 200 RL steps; a bad argument is named."""
    import runpy

    from pdm_jax.config import validate_config

    path = os.path.join(REPO, "launch", "sweeps", "between_testbed.py")
    get = runpy.run_path(os.path.join(REPO, "configs", "tiny_between.py"))["get_config"]
    runs = sweep.expand(sweep.load_sweep(path, "pilot"))
    assert len(runs) == 6
    for r in runs:
        c = get(r["arg"])
        validate_config(c)
        assert c.sampler.weight_noise == 0.45 and c.rl.steps == 200 and c.data.task == "number_between"
    coarse = sweep.expand(sweep.load_sweep(path, "pilot_int2"))
    assert len(coarse) == 6
    for r in coarse:
        c = get(r["arg"])
        validate_config(c)
        assert (c.sampler.quantization, c.sampler.weight_noise, c.trust_region.delta) == ("int2", 0.0, 0.05)
    wide = sweep.expand(sweep.load_sweep(path, "pilot_delta_0.15"))
    assert len(wide) == 4 and {get(r["arg"]).trust_region.delta for r in wide} == {0.15}
    stale = sweep.expand(sweep.load_sweep(path, "pilot_stale"))  # drift instead of an offset: no noise, fp8
    assert len(stale) == 6
    for r in stale:
        c = get(r["arg"])
        validate_config(c)
        assert (c.rl.max_staleness, c.rl.num_iterations, c.rl.learning_rate, c.sampler.weight_noise,
                c.sampler.quantization, c.trust_region.delta) == (8, 4, 5e-4, 0.0, "fp8", 0.05)
    assert {get(r["arg"]).rl.learning_rate for r in sweep.expand(sweep.load_sweep(path, "pilot_stale_slow"))} == {3e-4}
    tempered = [get(r["arg"]) for r in sweep.expand(sweep.load_sweep(path, "pilot_stale_temp"))]
    assert len(tempered) == 6  # drift plus the sampler's own temperature; the loss's pi stays at temperature 1
    assert {(c.rl.max_staleness, c.rl.learning_rate, c.sampler.temperature, c.rl.temperature, c.sampler.weight_noise)
            for c in tempered} == {(8, 3e-4, 1.15, 1.0, 0.0)}
    comparison = sweep.load_sweep(path, "comparison")
    assert comparison["paired_baseline"] == ("criterion", "ratio") and comparison["paired_change"] == ("delta", 0.05)
    grid = sweep.expand(comparison)  # the lever of pilot_stale_temp, 33 paired seeds
    assert len(grid) == 8 * 10 + 25 * 8  # none / clip-higher at delta 0.05 for the first 8 seeds only
    assert [r["point"]["seed"] for r in grid] == sorted(r["point"]["seed"] for r in grid)  # seed outermost
    first = [get(r["arg"]) for r in grid if r["point"]["seed"] == 0]
    for c in first:
        validate_config(c)
    assert {(c.trust_region.mask, c.trust_region.delta) for c in first} == {
        ("none", 0.05), ("ppo", 0.05), ("dppo", 0.05), ("dppo", 0.15), ("pdm", 0.05), ("pdm", 0.15)}
    assert {c.trust_region.estimator for c in first if c.trust_region.mask == "pdm"} == {
        "aggregated_tail", "uniform_tail", "bucket_exact"}
    assert {(c.rl.max_staleness, c.rl.learning_rate, c.sampler.temperature) for c in first} == {(8, 3e-4, 1.15)}
    # the token-level analysis of the comparison (`--setting=between_comparison`) runs its aggregated_tail arm's
    # first 9 RL steps: the same config but for the steps, the evaluation and the checkpoints
    from pdm_jax.analysis.run import SETTINGS

    arm = next(r for r in grid if r["point"] == dict(seed=0, delta=0.05, criterion="pdm_aggregated_tail"))
    analysed = get(SETTINGS["between_comparison"][1] + ",seed=0")
    for c in (analysed, ran := get(arm["arg"])):
        c.rl.steps, c.eval, c.checkpoint, c.log, c.sampler.mode = 9, None, None, None, "in_process"
    assert analysed.to_dict() == ran.to_dict()
    assert {get(r["arg"]).trust_region.delta for r in runs} == {0.05}
    with pytest.raises(ValueError, match="'full'"):
        sweep.load_sweep(path, "full")


def test_seeds_for_power_matches_gpower_and_a_simulation():
    """The paired table's power column against G*Power 3.1's matched-pairs t-test tables (two-tailed, alpha 0.05,
    power 0.8: d_z 0.2 / 0.5 / 0.8 need 199 / 34 / 15 pairs, actual power 0.8078 at 34 and 0.8213 at 15) and a
    Monte Carlo of the t-test itself; the cases it cannot read are None."""
    from scipy import stats

    unit = 1 / math.sqrt(2)  # two differences d +- unit have mean d and standard deviation 1
    assert [sweep.seeds_for_power([d + unit, d - unit]) for d in (0.2, 0.5, 0.8)] == [199, 34, 15]
    assert sweep.seeds_for_power([-0.5 - unit, -0.5 + unit]) == 34  # the sign of the difference does not matter
    assert sweep.paired_power(34, 0.5) == pytest.approx(0.8078, abs=1e-4)
    assert sweep.paired_power(15, 0.8) == pytest.approx(0.8213, abs=1e-4)
    rng = np.random.default_rng(0)
    rejected = np.mean([stats.ttest_1samp(rng.normal(0.5, 1.0, 34), 0.0).pvalue < 0.05 for _ in range(4000)])
    assert rejected == pytest.approx(sweep.paired_power(34, 0.5), abs=0.02)  # 4,000 draws: sd of the share 0.006
    assert sweep.seeds_for_power([0.3, 0.3]) == 2  # no spread
    assert sweep.seeds_for_power([0.1]) is None and sweep.seeds_for_power([0.2, -0.2]) is None  # one pair; mean 0
    assert sweep.seeds_for_power([1e-6 + 0.1, 1e-6 - 0.1]) == sweep.POWER_MAX_SEEDS + 1  # beyond the search
    with pytest.raises(ValueError, match="n must be >= 2"):
        sweep.paired_power(1, 0.5)
    rows = [dict(criterion=c, n=2, wins=1, seeds_for_power=need, p=p, p_holm=p,
                 **{m: (0.01, 0.1) for m in sweep.PAIRED_METRICS})
            for c, need, p in (("a", 33, 0.012), ("b", None, None), ("c", sweep.POWER_MAX_SEEDS + 1, 0.5))]
    md = sweep._paired_markdown(rows, ("criterion", "ratio"))
    assert "| 33 | 0.012 | 0.012 |" in md and "| – | – | – |" in md and "| > 10,000 | 0.5 | 0.5 |" in md
    assert "seeds for 80% power" in md and "Holm" in md


def test_paired_t_p_and_holm_by_hand():
    """The paired t-test's p against a hand computation (diffs 1..4: t = 2.5 / (1.291 / 2) = 3.873, 3 df, two-sided
    p = 0.0305), and Holm's step-down adjustment against the textbook example (sorted p x 4, x 3, x 2, x 1, then
    made monotone, capped at 1), None entries left out of the family."""
    assert sweep.paired_t_p([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.03047, abs=5e-5)
    assert sweep.paired_t_p([-1.0, -2.0, -3.0, -4.0]) == pytest.approx(0.03047, abs=5e-5)
    assert sweep.paired_t_p([0.2]) is None and sweep.paired_t_p([0.1, 0.1]) is None
    assert sweep.holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert sweep.holm_adjust([0.01, None, 0.04]) == [pytest.approx(0.02), None, pytest.approx(0.04)]
    assert sweep.holm_adjust([0.6, 0.7]) == [1.0, 1.0] and sweep.holm_adjust([]) == []


def test_paired_differences_by_hand(tmp_path):
    """Arm - baseline per seed at the same other axis values; mean ± t half-width; wins counted."""
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1]), ("criterion", ["ratio", "none"])],
                                  paired_baseline=("criterion", "ratio")))
    runs = sweep.expand(d)
    out = str(tmp_path)
    finals = {("ratio", 0): 0.30, ("none", 0): 0.10, ("ratio", 1): 0.40, ("none", 1): 0.45}
    for r in runs:
        f = finals[(r["point"]["criterion"], r["point"]["seed"])]
        _fake_run(os.path.join(out, r["name"]), [0.2, 0.4], [(1, 0.3), (2, f)])
    table = sweep.aggregate(runs, out, paired_baseline=d["paired_baseline"])
    (p,) = table["paired"]
    assert p["criterion"] == "none" and p["n"] == 2 and p["wins"] == 1
    m, ci = p["final_accuracy"]
    assert m == pytest.approx((-0.2 + 0.05) / 2)
    t975 = 12.706204736174698  # Student's t, 97.5% quantile, 1 degree of freedom
    assert ci == pytest.approx(t975 * math.sqrt(((-0.2 + 0.075) ** 2 + (0.05 + 0.075) ** 2)) / math.sqrt(2))
    assert p["reward_area"] == (0.0, 0.0)
    assert "arm − criterion=ratio" in table["markdown"] and "| none | 2 | 1/2 |" in table["markdown"]
    assert p["p"] == pytest.approx(sweep.paired_t_p([-0.2, 0.05])) and p["p_holm"] == p["p"]  # a family of one
    # diffs -0.2 and +0.05: d_z = -0.075 / 0.177 = -0.42, which needs 46 pairs
    assert p["seeds_for_power"] == sweep.seeds_for_power([-0.2, 0.05])
    assert 40 < p["seeds_for_power"] < 50 and f"| {p['seeds_for_power']} |" in table["markdown"]
    with pytest.raises(ValueError, match="paired_baseline"):
        sweep.validate_sweep(dict(d, paired_baseline=("delta", 0.1)))


def test_step_means_by_hand(tmp_path):
    """step_means: per arm and metric, the seed mean ± 95% t half-width at chosen RL steps; a seed without the step
    or the metric is left out of that cell (n counts the rest). Seed 0's rewards 0.2 / 0.4 / 0.6, seed 1's 0.4 / 0.6
    (two steps): step 1 -> 0.3 ± t(0.975, 1) * 0.1414 / sqrt(2); step 3 -> seed 0 alone; step 5 -> nobody."""
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1]), ("criterion", ["ratio"])],
                                  step_means=dict(metrics=["reward", "frac_masked", "absent"], steps=[1, 3, 5])))
    runs = sweep.expand(d)
    _fake_run(os.path.join(str(tmp_path), runs[0]["name"]), [0.2, 0.4, 0.6], [(3, 0.5)])
    _fake_run(os.path.join(str(tmp_path), runs[1]["name"]), [0.4, 0.6], [(2, 0.5)])
    table = sweep.aggregate(runs, str(tmp_path), step_table=d["step_means"])
    rows = {r["metric"]: r for r in table["step_means"]}
    assert list(rows) == ["reward", "frac_masked", "absent"] and rows["reward"]["criterion"] == "ratio"
    (m1, h1, n1), (m3, h3, n3), (m5, h5, n5) = rows["reward"]["cells"]
    assert (m1, n1) == (pytest.approx(0.3), 2) and h1 == pytest.approx(12.706204736174698 * math.sqrt(0.02) / 2 ** 0.5)
    assert (m3, n3) == (pytest.approx(0.6), 1) and math.isnan(h3)
    assert n5 == 0 and math.isnan(m5)
    assert rows["frac_masked"]["cells"][0][:2] == pytest.approx((0.1, 0.0))  # 0.1 x step in both seeds
    assert all(n == 0 for _, _, n in rows["absent"]["cells"])
    assert "| ratio | reward | 0.300 ± 1.271 | 0.600 | – |" in table["markdown"]
    assert "| criterion | metric | step 1 | step 3 | step 5 |" in table["markdown"]
    assert sweep.aggregate(runs, str(tmp_path))["step_means"] == []  # only when asked for
    for bad in [dict(metrics=[], steps=[1]), dict(metrics=["reward"], steps=[0]), dict(metrics=["reward"]),
                dict(metrics="reward", steps=[1]), dict(metrics=["reward"], steps=[1.5]), [("reward", 1)]]:
        with pytest.raises(ValueError, match="sweep.step_means"):
            sweep.validate_sweep(dict(d, step_means=bad))


def test_metrics_are_parsed_once_per_aggregation_and_reread_when_they_change(tmp_path, monkeypatch):
    """Inside `_reading_once` a metrics.jsonl is parsed once for aggregate and plot_sweep (the same table as without
    it); a file whose size changes is parsed again; outside it nothing is kept."""
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1])],
                                  step_means=dict(metrics=["reward"], steps=[1, 2])))
    runs = sweep.expand(d)
    for i, run in enumerate(runs):
        _fake_run(os.path.join(str(tmp_path), run["name"]), [0.2 + i, 0.4, 0.6], [(3, 0.5)])
    plain = sweep.aggregate(runs, str(tmp_path), step_table=d["step_means"])["markdown"]
    parsed = []
    real = sweep._parse_jsonl
    monkeypatch.setattr(sweep, "_parse_jsonl", lambda path: parsed.append(path) or real(path))
    with sweep._reading_once():
        once = sweep.aggregate(runs, str(tmp_path), step_table=d["step_means"])["markdown"]
        sweep.plot_sweep(runs, str(tmp_path))
        metrics = [p for p in parsed if p.endswith("metrics.jsonl")]
        assert once == plain and len(metrics) == len(set(metrics)) == 2
        with open(metrics[0], "a") as f:
            f.write(json.dumps(dict(phase="rl", step=4, reward=1.0)) + "\n")
        assert sweep._read_jsonl(metrics[0])[-1]["step"] == 4 and parsed.count(metrics[0]) == 2
    assert sweep._JSONL_CACHE is None


def test_changes_across_delta_and_gap_changes_by_hand(tmp_path):
    """paired_change: each arm's per-seed change from delta 0.05 to 0.15; gap_changes: the change of its difference
    to the baseline arm (difference in differences). Finals by hand: ratio 0.50 / 0.60 at delta 0.05, 0.52 / 0.58 at
    0.15; pdm 0.40 / 0.45, then 0.50 / 0.55. pdm's change: +0.10, +0.10; ratio's: +0.02, -0.02; pdm's gap to
    ratio: -0.10 / -0.15 at 0.05, -0.02 / -0.03 at 0.15, so it narrows by +0.08 and +0.12."""
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1]), ("delta", [0.05, 0.15]),
                                                                  ("criterion", ["ratio", "pdm_bucket_exact"])],
                                  paired_baseline=("criterion", "ratio"), paired_change=("delta", 0.05)))
    runs = sweep.expand(d)
    finals = {(0.05, "ratio"): (0.50, 0.60), (0.15, "ratio"): (0.52, 0.58),
              (0.05, "pdm_bucket_exact"): (0.40, 0.45), (0.15, "pdm_bucket_exact"): (0.50, 0.55)}
    rewards = [0.1] * 20 + [0.3] * 10 + [0.4] * 20  # reward_rise over 20-step windows: 0.4 - 0.1
    for r in runs:
        f = finals[(r["point"]["delta"], r["point"]["criterion"])][r["point"]["seed"]]
        _fake_run(os.path.join(str(tmp_path), r["name"]), rewards, [(50, f)])
    table = sweep.aggregate(runs, str(tmp_path), paired_baseline=d["paired_baseline"],
                            paired_change=d["paired_change"])
    assert table["rows"][0]["reward_rise"] == pytest.approx(0.3)
    nan_run = os.path.join(str(tmp_path), "nan_reward")
    _fake_run(nan_run, rewards[:25] + [float("nan")] + rewards[26:], [(50, 0.5)])
    assert math.isnan(sweep.summarize_run(nan_run)["reward_rise"])  # as reward_area: a NaN step is not hidden
    assert math.isnan(sweep.summarize_run(nan_run)["reward_area"])
    assert table["groups"][0]["reward_rise"][0] == pytest.approx(0.3)
    changes = {c["criterion"]: c for c in table["changes"]}
    assert set(changes) == {"ratio", "pdm_bucket_exact"} and all(c["delta"] == 0.15 for c in changes.values())
    assert changes["pdm_bucket_exact"]["final_accuracy"] == pytest.approx((0.10, 0.0), abs=1e-12)
    assert changes["ratio"]["final_accuracy"][0] == pytest.approx(0.0, abs=1e-12) and changes["ratio"]["wins"] == 1
    (gap,) = table["gap_changes"]
    assert gap["criterion"] == "pdm_bucket_exact" and gap["delta"] == 0.15 and gap["n"] == 2 and gap["wins"] == 2
    m, ci = gap["final_accuracy"]
    assert m == pytest.approx(0.10)
    assert ci == pytest.approx(12.706204736174698 * math.sqrt(2 * 0.02 ** 2) / math.sqrt(2))
    assert gap["p"] == pytest.approx(sweep.paired_t_p([0.08, 0.12]))
    md = table["markdown"]
    assert "change from delta=0.05" in md and "(arm − ratio) at the row's delta − (arm − ratio) at delta=0.05" in md
    assert "| reward rise |" in md
    with pytest.raises(ValueError, match="paired_change"):
        sweep.validate_sweep(dict(d, paired_change=("criterion", "ratio")))
    for bad in [("lr", 0.1), ("delta", 0.1), ("delta", "0.05"), ("delta", [0.05]), (["delta"], 0.05), ("seed", 0)]:
        with pytest.raises(ValueError, match="sweep.paired_change"):  # each names the field and the value
            sweep.validate_sweep(dict(d, paired_change=bad))
    with pytest.raises(ValueError, match=r"sweep.paired_baseline \('criterion', 'bogus'\)"):
        sweep.validate_sweep(dict(d, paired_baseline=("criterion", "bogus")))
    # a run without a final accuracy is left out of the seed counts and the differences, not a crash
    first = os.path.join(str(tmp_path), runs[0]["name"], "summary.json")
    summary = json.load(open(first))
    json.dump(dict(summary, final_accuracy=None), open(first, "w"))
    table = sweep.aggregate(runs, str(tmp_path), paired_baseline=d["paired_baseline"],
                            paired_change=d["paired_change"])
    assert {c["criterion"]: c["n"] for c in table["changes"]} == {"ratio": 1, "pdm_bucket_exact": 2}


def test_subset_of_a_sweep_starts_from_the_whole_sweeps_warm_start(tmp_path):
    """--only: the warm start is run with the whole grid's first point (seed 0), not the subset's first (seed 1),
    and a group none of whose runs is in the subset gets no warm start."""
    fake = _recording_fake(tmp_path)
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1]), ("criterion", ["none", "ratio"])],
                                  share_warmstart_by=()))
    grid = sweep.expand(d)
    subset = [r for r in grid if "seed=1_" in r["name"]]
    out = str(tmp_path / "sweep")
    sweep.run_local(subset, out, python=str(fake), share_warmstart_by=(), grid=grid, log=lambda *_: None)
    warm_call = open(os.path.join(out, "_warmstart", "all", "calls.txt")).read()
    assert "seed=0" in warm_call and "seed=1" not in warm_call
    assert sorted(os.listdir(out)) == ["_warmstart"] + [r["name"] for r in subset]
    d2 = sweep.validate_sweep(dict(d, share_warmstart_by=("seed",)))
    out2 = str(tmp_path / "per_seed")
    sweep.run_local(subset, out2, python=str(fake), share_warmstart_by=("seed",), grid=sweep.expand(d2),
                    log=lambda *_: None)
    assert os.listdir(os.path.join(out2, "_warmstart")) == ["seed=1"]


def _write_sweep(tmp_path, d: dict) -> str:
    path = tmp_path / "sweep_def.py"
    path.write_text(f"def get_sweep(arg=None):\n    return dict(config={d['config']!r}, axes={d['axes']!r}, "
                    f"share_warmstart_by={d['share_warmstart_by']!r}, paired_baseline={d['paired_baseline']!r})\n")
    return str(path)


def test_run_records_carry_a_sweep_across_machines(tmp_path):
    """Records written by one machine's sweep are restored (not rerun) by another's, the tables read them, and a
    record from another warm start or a malformed one is refused by name."""
    fake = _recording_fake(tmp_path)
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1]), ("criterion", ["none", "ratio"])],
                                  share_warmstart_by=(), paired_baseline=("criterion", "ratio")))
    runs = sweep.expand(d)
    records = str(tmp_path / "records")
    sweep.run_local(runs[:2], str(tmp_path / "first"), python=str(fake), share_warmstart_by=(), grid=runs,
                    records=records, log=lambda *_: None)
    assert sorted(os.listdir(records)) == ["_warmstart"] + sorted(r["name"] + ".json.gz" for r in runs[:2])
    with tarfile.open(os.path.join(records, "_warmstart", "all.tar.gz")) as tar:  # the latest checkpoint only
        assert sorted(tar.getnames()) == [".warmstart_manifest.json", "calls.txt", "checkpoints", "checkpoints/2",
                                          "checkpoints/2/state", "cwd.txt", "metrics.jsonl", "pp.txt", "summary.json",
                                          "sweep_run.json", "warm.txt"]
    calls = tmp_path / "all_calls.txt"
    calls.unlink()
    out = str(tmp_path / "second")  # a fresh machine: no run directories, only the committed records
    res = sweep.run_local(runs, out, python=str(fake), share_warmstart_by=(), grid=runs, records=records,
                          log=lambda *_: None)
    assert [r["skipped"] for r in res] == [True, True, False, False]
    assert len(calls.read_text().splitlines()) == 2  # the two unrecorded runs: the warm start was restored
    assert open(os.path.join(out, runs[2]["name"], "calls.txt")).read().splitlines()[0].endswith("rl.steps=0")
    assert sorted(os.listdir(records)) == ["_warmstart"] + sorted(r["name"] + ".json.gz" for r in runs)
    table = sweep.aggregate(runs, out, paired_baseline=("criterion", "ratio"))
    assert len(table["rows"]) == 4 and all(r["reward_area"] == 0.5 for r in table["rows"])
    # --aggregate_only on a third machine rebuilds the same table from the records alone
    assert sweep.main(["--sweep", _write_sweep(tmp_path, d), "--out", str(tmp_path / "third"), "--records", records,
                       "--aggregate_only"]) == 0
    assert open(tmp_path / "third" / "sweep_runs.csv").read() == open(os.path.join(out, "sweep_runs.csv")).read()
    other = _recording_fake(tmp_path, warm_accuracy=0.3)  # a different warm start, built without the archive
    shutil.rmtree(os.path.join(records, "_warmstart"))
    with pytest.raises(ValueError, match=r"seed=0_criterion=none.json.gz: made from the warm start with sha256 "
                                         r"[0-9a-f]{64}, but .* has [0-9a-f]{64}: the record comes from another"):
        sweep.run_local(runs, str(tmp_path / "fourth"), python=str(other), share_warmstart_by=(), grid=runs,
                        records=records, log=lambda *_: None)
    with gzip.open(os.path.join(records, runs[0]["name"] + ".json.gz"), "wt") as f:
        json.dump({"train.log": "x"}, f)
    with pytest.raises(ValueError, match=r"seed=0_criterion=none.json.gz.*summary.json"):
        sweep.restore_records(runs, str(tmp_path / "fifth"), records)


def test_a_warm_start_archive_cannot_write_outside_its_workdir(tmp_path):
    """restore_warmstart extracts with tarfile's data filter: a member path leaving the workdir is refused, naming
    the archive, and nothing is left behind."""
    records = tmp_path / "records"
    (records / "_warmstart").mkdir(parents=True)
    evil = tmp_path / "evil.txt"
    evil.write_text("x")
    with tarfile.open(records / "_warmstart" / "all.tar.gz", "w:gz") as tar:
        tar.add(evil, arcname="../escaped.txt")
    with pytest.raises(ValueError, match=r"all.tar.gz: member '../escaped.txt' leaves its directory; refused"):
        sweep.restore_warmstart(str(tmp_path / "out" / "all"), str(records), "all")
    assert not (tmp_path / "out" / "escaped.txt").exists() and os.listdir(tmp_path / "out") == []
    assert sweep.restore_warmstart(str(tmp_path / "other"), str(records), "missing") is False


def _two_recorded_runs(tmp_path):
    fake = _recording_fake(tmp_path)
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1])], share_warmstart_by=()))
    runs = sweep.expand(d)
    records = str(tmp_path / "records")
    sweep.run_local(runs, str(tmp_path / "first"), python=str(fake), share_warmstart_by=(), grid=runs,
                    records=records, log=lambda *_: None)
    return fake, runs, records


def test_a_bad_warm_start_archive_leaves_no_half_warm_start(tmp_path):
    """A truncated archive is refused by name, and a retry does not take a partial unpack for a finished warm
    start; a link in the warm start is refused when archiving; a failed archive write leaves no file behind."""
    fake, runs, records = _two_recorded_runs(tmp_path)
    archive = os.path.join(records, "_warmstart", "all.tar.gz")
    data = open(archive, "rb").read()
    open(archive, "wb").write(data[: len(data) - 40])
    out = str(tmp_path / "second")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"warm-start archive .*all.tar.gz: cannot be unpacked"):
            sweep.run_local(runs, out, python=str(fake), share_warmstart_by=(), grid=runs, records=records,
                            log=lambda *_: None)
        assert not os.path.exists(os.path.join(out, "_warmstart", "all"))
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "summary.json").write_text("{}")
    (warm / "link").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="link is a link or special file"):
        sweep.save_warmstart(str(warm), str(tmp_path / "rec2"), "all")
    assert not os.path.exists(tmp_path / "rec2" / "_warmstart" / "all.tar.gz")
    with pytest.raises(ValueError, match="not finished"):
        sweep.save_warmstart(str(tmp_path / "nowhere"), str(tmp_path / "rec2"), "all")


def _deterministic_warm_start(tmp_path, name="warm"):
    """A finished warm start whose checkpoint holds 64 kB of random (incompressible) bytes: gzip stores them as
    they are, so a bit flipped in the archive flips one bit of the restored file (no inflate error would tell)."""
    warm = tmp_path / name
    (warm / "checkpoints" / "3").mkdir(parents=True)
    (warm / "summary.json").write_text('{"warmstart_accuracy": 0.0}')
    (warm / "checkpoints" / "3" / "state").write_bytes(np.random.default_rng(0).bytes(64 << 10))
    return warm


def test_a_bit_flipped_warm_start_archive_is_refused_and_leaves_nothing(tmp_path):
    """One bit flipped inside a stored member: refused by name (gzip's CRC and the member's sha256), with no
    corrupted file and no temporary left in the workdir's parent; the same for an archive without a manifest
    (gzip's CRC alone); an archive whose gzip is intact but a member differs from the manifest is refused too."""
    warm = _deterministic_warm_start(tmp_path)
    records = tmp_path / "records"
    archive = sweep.save_warmstart(str(warm), str(records), "all")
    good = open(archive, "rb").read()
    out = tmp_path / "out"
    assert sweep.restore_warmstart(str(out / "ok"), str(records), "all")
    assert (out / "ok" / "checkpoints" / "3" / "state").read_bytes() == (warm / "checkpoints/3/state").read_bytes()
    assert sweep.warmstart_digest(str(out / "ok")) == sweep.warmstart_digest(str(warm))
    legacy = tmp_path / "legacy.tar.gz"
    with tarfile.open(legacy, "w:gz") as tar:  # an archive written before manifests
        for name in sorted(os.listdir(warm)):
            tar.add(warm / name, arcname=name)
    for blob in (good, legacy.read_bytes()):
        flipped = bytearray(blob)
        flipped[len(blob) // 2] ^= 0x10  # inside the stored random bytes
        open(archive, "wb").write(bytes(flipped))
        with pytest.raises(ValueError, match=r"warm-start archive \S*all.tar.gz: cannot be unpacked \(BadGzipFile: "
                                             r"CRC check failed"):
            sweep.restore_warmstart(str(out / "bad"), str(records), "all")
        assert sorted(os.listdir(out)) == ["ok"]  # no corrupted warm start, no .restoring_ directory
    raw = bytearray(gzip.decompress(good))  # the tar inside, one byte of the state changed, gzip made again
    at = raw.index(b"checkpoints/3/state", 1024)  # the member's header (after the manifest's)
    raw[at + 512 + 100] ^= 0x01
    open(archive, "wb").write(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=r"all.tar.gz: 1 member\(s\) differ from its manifest .*'checkpoints/3/state'"):
        sweep.restore_warmstart(str(out / "bad"), str(records), "all")
    assert sorted(os.listdir(out)) == ["ok"]
    with tarfile.open(archive, "w:gz") as tar:  # `tar -czf ... -C warm .`: members named ./...
        tar.add(warm, arcname=".")
    assert sweep.restore_warmstart(str(out / "dotted"), str(records), "all")
    assert sweep.warmstart_digest(str(out / "dotted")) == sweep.warmstart_digest(str(warm))
    for name in ("a/../../x", "/abs", "a\\..\\x"):
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
        with pytest.raises(ValueError, match=rf"all.tar.gz: member {re.escape(repr(name))} leaves its directory"):
            sweep.restore_warmstart(str(out / "bad"), str(records), "all")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(warm / "summary.json", arcname="summary.json")
        tar.add(warm / "summary.json", arcname="./summary.json")
    with pytest.raises(ValueError, match=r"all.tar.gz: member './summary.json' appears twice"):
        sweep.restore_warmstart(str(out / "bad"), str(records), "all")
    assert sorted(os.listdir(out)) == ["dotted", "ok"]


def test_links_and_gzip_bombs_in_archives_and_records_are_refused(tmp_path, monkeypatch):
    """A symlink member (even one pointing inside) is refused; an archive or a record that inflates beyond its
    bound is refused by name before it is held whole; a flipped byte in a record is a ValueError naming it."""
    records = tmp_path / "records"
    (records / "_warmstart").mkdir(parents=True)
    warm = _deterministic_warm_start(tmp_path)
    with tarfile.open(records / "_warmstart" / "all.tar.gz", "w:gz") as tar:
        tar.add(warm / "summary.json", arcname="summary.json")
        link = tarfile.TarInfo("alias.json")
        link.type, link.linkname = tarfile.SYMTYPE, "summary.json"
        tar.addfile(link)
    with pytest.raises(ValueError, match=r"all.tar.gz: alias.json is a link or special file; refused"):
        sweep.restore_warmstart(str(tmp_path / "out" / "all"), str(records), "all")
    assert os.listdir(tmp_path / "out") == []
    zeros = tmp_path / "zeros"
    (zeros / "checkpoints").mkdir(parents=True)
    (zeros / "summary.json").write_text("{}")
    (zeros / "checkpoints" / "blob").write_bytes(bytes(4 << 20))  # 4 MB of zeros: a 4 kB archive
    sweep.save_warmstart(str(zeros), str(records), "bomb")
    size = os.path.getsize(records / "_warmstart" / "bomb.tar.gz")
    monkeypatch.setattr(sweep, "MAX_WARMSTART_BASE_BYTES", 1 << 20)
    monkeypatch.setattr(sweep, "WARMSTART_INFLATION", 16)
    reads = []
    real_read = sweep._CappedReader.read
    monkeypatch.setattr(sweep._CappedReader, "read", lambda self, n=-1: reads.append(self.n) or real_read(self, n))
    with pytest.raises(ValueError, match=rf"bomb.tar.gz: inflates to more than {(1 << 20) + 16 * size} bytes"):
        sweep.restore_warmstart(str(tmp_path / "out" / "bomb"), str(records), "bomb")
    assert max(reads) <= (1 << 20) + 16 * size and os.listdir(tmp_path / "out") == []
    monkeypatch.setattr(sweep, "MAX_RECORD_BYTES", 4096)
    rec = tmp_path / "recs"
    rec.mkdir()
    run = dict(name="r")
    (rec / "r.json.gz").write_bytes(gzip.compress(json.dumps({"summary.json": "{}", "metrics.jsonl": "x" * 5000})
                                                  .encode()))
    with pytest.raises(ValueError, match=r"r.json.gz: inflates to more than 4096 bytes"):
        sweep.restore_records([run], str(tmp_path / "o"), str(rec), log=lambda *_: None)
    body = json.dumps({"summary.json": json.dumps({"warmstart_accuracy": 0.25, "final_accuracy": 0.5})}).encode()
    blob = gzip.compress(body, mtime=0)
    flips = 0
    for at in range(10, len(blob)):  # every byte of the deflate data and the trailer, one at a time
        bad = bytearray(blob)
        bad[at] ^= 0x04
        with contextlib.suppress(Exception):
            if gzip.decompress(bytes(bad)) == body:
                continue  # the final block's padding bits: nothing of the record changes
        flips += 1
        (rec / "r.json.gz").write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=r"run record \S*r.json.gz: not a gzip-compressed JSON record"):
            sweep.restore_records([run], str(tmp_path / "o"), str(rec), log=lambda *_: None)
    assert flips >= len(blob) - 11 and not os.path.exists(tmp_path / "o" / "r" / "summary.json")


def test_records_are_paired_with_their_warm_start_by_content(tmp_path, capsys):
    """Two warm starts with the same accuracy but other weights: a record from one is refused by the other's sweep
    (by digest, not warmstart_accuracy); a record naming no digest is checked by accuracy and counted; the CLI shows a
    bad record as one line, exit 2."""
    fake = _recording_fake(tmp_path, weights="first")
    d = sweep.validate_sweep(dict(config="configs/tiny.py", axes=[("seed", [0, 1])], share_warmstart_by=()))
    runs = sweep.expand(d)
    records = str(tmp_path / "records")
    sweep.run_local(runs[:1], str(tmp_path / "first"), python=str(fake), share_warmstart_by=(), grid=runs,
                    records=records, log=lambda *_: None)
    digest = sweep.warmstart_digest(str(tmp_path / "first" / "_warmstart" / "all"))
    files = sweep._read_record(os.path.join(records, runs[0]["name"] + ".json.gz"))
    assert json.loads(files["sweep_run.json"].splitlines()[0])["warmstart_sha256"] == digest
    shutil.rmtree(os.path.join(records, "_warmstart"))
    other = _recording_fake(tmp_path, weights="second")  # same warmstart_accuracy 0.1, other checkpoint bytes
    with pytest.raises(ValueError, match=rf"made from the warm start with sha256 {digest}, but .* has (?!{digest})"):
        sweep.run_local(runs, str(tmp_path / "second"), python=str(other), share_warmstart_by=(), grid=runs,
                        records=records, log=lambda *_: None)
    path = os.path.join(records, runs[0]["name"] + ".json.gz")
    with gzip.open(path, "wt") as f:  # no digest: checked by accuracy, counted in the log
        json.dump({k: v for k, v in files.items() if k != "sweep_run.json"}, f)
    logged = []
    sweep.run_local(runs, str(tmp_path / "third"), python=str(other), share_warmstart_by=(), grid=runs,
                    records=records, log=logged.append)
    assert any("1 name no warm-start digest: checked by their warm-start accuracy only" in m for m in logged)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    sweep_file = _write_sweep(tmp_path, dict(d, paired_baseline=None))
    capsys.readouterr()
    assert sweep.main(["--sweep", sweep_file, "--out", str(tmp_path / "fourth"), "--records", records,
                       "--aggregate_only"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"sweep.py: run record \S*seed=0.json.gz: not a gzip-compressed JSON record \(.*\)\n", err)


def test_records_are_never_replaced_silently_and_bad_ones_are_named(tmp_path, capsys):
    """A committed record is not overwritten by a different local run (an --aggregate_only on a stale directory,
    here from another warm start); unchanged records keep their bytes; malformed records and a --records that is
    a file are refused by name; an --only matching nothing is an error."""
    fake, runs, records = _two_recorded_runs(tmp_path)
    path = os.path.join(records, runs[0]["name"] + ".json.gz")
    before = open(path, "rb").read()
    sweep.save_record(os.path.join(tmp_path, "first", runs[0]["name"]), records)
    assert open(path, "rb").read() == before  # no time stamp, no rewrite
    stale = tmp_path / "stale" / runs[0]["name"]
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text('{"warmstart_accuracy": 0.3, "final_accuracy": 0.2}')
    sweep_file = tmp_path / "def.py"
    sweep_file.write_text("def get_sweep(arg=None):\n"
                          "    return dict(config='configs/tiny.py', axes=[('seed', [0, 1])])\n")
    assert sweep.main(["--sweep", str(sweep_file), "--out", str(tmp_path / "stale"), "--records", records,
                       "--aggregate_only"]) == 2  # one line naming the record, no traceback
    assert re.fullmatch(r"sweep.py: run record \S*seed=0.json.gz exists and differs .* in \['metrics.jsonl', "
                        r"'summary.json'.*\n", capsys.readouterr().err)
    assert open(path, "rb").read() == before
    assert sweep.main(["--sweep", str(sweep_file), "--out", str(tmp_path / "x"), "--only", "seed=7"]) == 2
    bad_cases = {b"not gzip": "not a gzip-compressed JSON record", gzip.compress(b"[1]"): "got list",
                 gzip.compress(b'{"summary.json": 3}'): "every file must be a text, got {'summary.json': 'int'}",
                 gzip.compress(b'{"summary.json": "nope"}'): "its summary.json is not JSON",
                 gzip.compress(b'{"summary.json": "[1]"}'): "its summary.json is a list"}
    for blob, message in bad_cases.items():
        open(path, "wb").write(blob)
        with pytest.raises(ValueError, match=re.escape(message)):
            sweep.restore_records(runs, str(tmp_path / "fresh"), records, log=lambda *_: None)
        assert not os.path.exists(tmp_path / "fresh" / runs[0]["name"] / "summary.json")
    not_a_dir = tmp_path / "records_file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        sweep.restore_records(runs, str(tmp_path / "fresh"), str(not_a_dir), log=lambda *_: None)
