"""Every command the README and docs/*.md show runs as written: its config loads and passes validation.

The commands are extracted from fenced blocks (continuation lines joined, ``#`` comments and ``&&`` chains split)
and from inline code spans: ``python -m pdm_jax.train ...``, ``python launch/sweep.py ...`` and
``launch/tpu_pod.sh ...``. Nothing trains:

* a train command's ``--config=FILE[:ARG]`` is loaded, its ``--config.<field>=`` overrides are checked and applied as
  the command line does, and the result goes through `pdm_jax.config.validate_config` (``--dry_run``: its dry-run
  checks) and `check_sampler_workdir` against its ``--workdir``. Checkpoint and data paths the docs write as
  placeholders (``CKPT``, ``/ckpt/...``) are not required to exist (``paths_exist=False``);
* a sweep command's definition is loaded and expanded; with ``--print_only`` its printed commands (local train
  commands, or ``tpu_pod.sh`` commands with ``--pod``) are checked in turn, otherwise each grid point's train command;
* a ``tpu_pod.sh`` command runs with ``--dry-run`` and the train command it would run on the workers is checked.
"""

import contextlib
import glob
import io
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from pdm_jax.config import (apply_arg, check_override_value, check_sampler_workdir, load_config_file,
                            validate_config)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
PREFIXES = ("python -m pdm_jax.train ", "python3 -m pdm_jax.train ", "python launch/sweep.py ",
            "launch/tpu_pod.sh ")

sys.path.insert(0, os.path.join(REPO, "launch"))
import sweep as sweep_mod  # noqa: E402


def _fragments(text: str):
    """Shell command candidates of a markdown text: fenced blocks' lines (continuations joined) and code spans."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        yield from block.replace("\\\n", " ").splitlines()
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", outside.replace("`\n", "` ")):
        yield span
    # inline commands broken over two lines of prose (`python -m pdm_jax.train --config=...\n--dry_run`)
    for span in re.findall(r"`([^`]+)`", outside):
        if "\n" in span:
            yield " ".join(span.split())


def doc_commands() -> list:
    """``(file, argv)`` of every documented command (`PREFIXES`); fragments with ``...`` placeholders left out."""
    found = []
    for path in DOCS:
        with open(path) as f:
            text = f.read()
        for frag in _fragments(text):
            for part in frag.split("&&"):
                part = part.strip()
                if not part.startswith(PREFIXES):
                    continue
                argv = shlex.split(part, comments=True)
                if any("..." in a or "<" in a for a in argv):  # a sketch of a command, not one to paste
                    continue
                item = (os.path.relpath(path, REPO), argv)
                if item not in found:
                    found.append(item)
    return found


COMMANDS = doc_commands()


def check_train(argv: list) -> None:
    """Loads, overrides and validates the config of a ``python -m pdm_jax.train`` argv (no training)."""
    args = argv[argv.index("pdm_jax.train") + 1:]
    spec = next(a[len("--config="):] for a in args if a.startswith("--config="))
    workdir = next((a[len("--workdir="):] for a in args if a.startswith("--workdir=")), "")
    config = load_config_file(spec)
    for a in args:
        if a.startswith("--config."):
            path, _, raw = a[len("--config."):].partition("=")
            check_override_value(path, raw)
            apply_arg(config, f"{path}={raw}")
        else:
            assert a.startswith(("--config=", "--workdir=")) or a == "--dry_run", f"unknown argument {a!r}"
    if "--dry_run" in args:
        validate_config(config, dry_run=True)
        return
    assert workdir, f"no --workdir in {shlex.join(argv)}"
    validate_config(config, paths_exist=False)
    check_sampler_workdir(config, workdir, backend="tpu" if "--config.distributed=True" in args else None)


def check_tpu_pod(argv: list) -> None:
    """Runs a ``launch/tpu_pod.sh`` argv with ``--dry-run`` and checks the train command it would run."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    p = subprocess.run(["bash", "launch/tpu_pod.sh", "--dry-run"] + argv[1:], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PDM_BUCKET"})
    assert p.returncode == 0, p.stderr
    train = [line for line in p.stdout.splitlines() if line.startswith("+ ") and "pdm_jax.train" in line]
    assert len(train) == 1, p.stdout
    remote = next(w for w in shlex.split(train[0][2:]) if w.startswith("--command="))  # gcloud ssh --command=...
    inner = shlex.split(remote[len("--command="):])[-1]  # bash -o pipefail -c '<cd ... && python3 -m ...>'
    words = shlex.split(next(part for part in inner.split("&&") if "pdm_jax.train" in part))
    end = next((j for j, w in enumerate(words) if w in ("2>&1", "|")), len(words))
    check_train(words[:end])


def check_sweep(argv: list) -> list:
    """Checks a ``launch/sweep.py`` argv's commands; returns the argvs it checked."""
    if "--aggregate_only" in argv:
        sweep_mod.load_sweep(next(a.split("=", 1)[1] for a in argv if a.startswith("--sweep=")))
        return []
    if "--print_only" not in argv:  # a running sweep: each grid point's train command
        opts = dict(a[2:].split("=", 1) for a in argv[2:] if a.startswith("--") and "=" in a)
        runs = sweep_mod.expand(sweep_mod.load_sweep(opts["sweep"], opts.get("sweep_arg")))
        cmds = [sweep_mod.train_command(r, os.path.join(opts["out"], r["name"])) for r in runs]
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert sweep_mod.main(argv[2:]) == 0
        cmds = [shlex.split(line) for line in buf.getvalue().splitlines()]
    for cmd in cmds:
        (check_tpu_pod if cmd[0].endswith("tpu_pod.sh") else check_train)(cmd)
    return cmds


def test_the_docs_show_the_commands_this_test_checks():
    """The extractor finds the documented commands (a change of markdown layout must not make the test vacuous)."""
    by_kind = {p: [a for _, a in COMMANDS if shlex.join(a).startswith(p.strip())] for p in PREFIXES}
    assert len(by_kind["python -m pdm_jax.train "]) >= 20, COMMANDS
    assert by_kind["python launch/sweep.py "] and by_kind["launch/tpu_pod.sh "]
    files = {f for f, _ in COMMANDS}
    assert {"README.md", "docs/launching.md", "docs/models.md", "docs/scaling.md"} <= files, files


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[f"{f}:{' '.join(a)[:90]}" for f, a in COMMANDS])
def test_documented_command_is_valid(where, argv, monkeypatch):
    monkeypatch.chdir(REPO)
    if argv[0] == "launch/tpu_pod.sh":
        check_tpu_pod(argv)
    elif "launch/sweep.py" in argv:
        check_sweep(argv)
    else:
        check_train(argv)


def test_the_pod_sweep_example_runs_the_sampler_colocated(monkeypatch):
    """docs/launching.md's pod sweep: the local sweep's in_process flag is left out of the pod commands, whose
    workdir is a bucket (the trainer refuses a file-mode sampler there), and each pod's train command passes."""
    monkeypatch.chdir(REPO)
    argv = ["python", "launch/sweep.py", "--sweep=launch/sweeps/tiny_delta_estimator.py", "--out=gs://bucket/sweep",
            "--print_only", "--pod", "--only=criterion=ratio_seed=0"]
    cmds = check_sweep(argv)
    assert len(cmds) == 2 and all(c[0] == "launch/tpu_pod.sh" for c in cmds)
    assert not any("sampler.mode" in w for c in cmds for w in c)
    # what the docs' example generated before: the trainer's check names the field and the bucket
    config = load_config_file(cmds[0][[w.startswith("--config=") for w in cmds[0]].index(True)][len("--config="):])
    apply_arg(config, "sampler.mode=in_process")
    with pytest.raises(ValueError, match=r"sampler.mode = 'in_process'.*gs://bucket/sweep/delta=0.05"):
        check_sampler_workdir(config, "gs://bucket/sweep/delta=0.05_criterion=ratio_seed=0")


def test_the_command_line_refuses_a_file_mode_sampler_with_a_bucket_workdir():
    """`python -m pdm_jax.train` says so before any work (exit 2, no traceback), not after the model loads."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py", "--workdir=gs://b/run",
                        "--config.sampler.mode=in_process"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "config error: sampler.mode = 'in_process'" in p.stderr and "gs://b/run" in p.stderr
    assert "Traceback" not in p.stderr
