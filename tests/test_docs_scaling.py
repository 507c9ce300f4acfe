"""docs/scaling.md's dry-run commands, run as written, print the figures of its tables.

Every flag that sets a figure is spelled out in the commands (``--config.dry_run.num_devices=64``, the
chunk size). The checks read the page's "Dry run: does a config fit?" section (its analytic tables).
The 4B compiled check (minutes of XLA compilation) is run with its analytic estimate only
(``--config.dry_run.compiler=none`` appended: the last flag wins).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import doc_section

REPO = Path(__file__).resolve().parents[1]


def dry_run_section() -> str:
    """The "Dry run: does a config fit?" section of docs/scaling.md (up to the next ``## `` heading)."""
    return doc_section("scaling.md", "Dry run: does a config fit?")


def docs_dry_run_commands(text: str | None = None) -> list[list[str]]:
    """Every `python -m pdm_jax.train ... --dry_run` command of the section's bash blocks, as argv lists."""
    text = dry_run_section() if text is None else text
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("python -m pdm_jax.train") and "--dry_run" in command:
                commands.append(shlex.split(command))
    return commands


def _run(argv):
    """The command's analytic figures (``--config.dry_run.compiler=none`` appended unless it names a compiler:
    with XLA:TPU installed the default would compile for the slice)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    if not any(a.startswith("--config.dry_run.compiler=") for a in argv):
        argv = argv + ["--config.dry_run.compiler=none"]
    out = subprocess.run([sys.executable] + argv[1:], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\w+) +([0-9.]+)$", out.stdout, re.MULTILINE)}


def test_docs_show_every_table_command():
    commands = docs_dry_run_commands()
    assert len(commands) == 4
    eight_b = [c for c in commands if "configs/qwen3_dapo.py:size=8b" in c[3] and len(c) > 6]
    assert len(eight_b) == 2 and all("--config.dry_run.num_devices=64" in c for c in eight_b)
    assert ["python", "-m", "pdm_jax.train", "--config=configs/qwen3_dapo.py:size=8b", "--dry_run",
            "--config.dry_run.compiler=none"] in commands
    assert sum("--config.rl.logits_chunk_size=512" in c for c in eight_b) == 1


def test_every_dry_run_command_on_the_page_names_known_fields():
    """The compiled-recipe commands further down the page parse too (an unknown --config. field exits 2)."""
    from pdm_jax.config import check_field_path

    commands = docs_dry_run_commands((REPO / "docs" / "scaling.md").read_text())
    assert len(commands) > 4
    for argv in commands:
        for arg in argv:
            if arg.startswith("--config."):
                check_field_path(arg[len("--config."):].split("=", 1)[0])


@pytest.mark.slow
def test_docs_dry_run_commands_print_the_table_figures():
    commands = docs_dry_run_commands()
    unchunked, chunked = [c for c in commands if "size=8b" in c[3] and len(c) > 6]
    a, b = _run(unchunked), _run(chunked)
    # | params / AdamW / grads | 0.48 / 0.96 / 0.48 | same |
    for plan in (a, b):
        assert (round(plan["params"], 2), round(plan["optimizer"], 2), round(plan["gradients"], 2)) == (
            0.48, 0.96, 0.48)
        assert round(plan["activations"]) == 2982
    assert (round(a["loss"], 1), round(b["loss"], 1)) == (74.2, 5.1)
    defaults = _run(["python", "-m", "pdm_jax.train", "--config=configs/qwen3_dapo.py:size=8b", "--dry_run"])
    assert round(defaults["total"], 2) == 12.47 and round(defaults["activations"], 1) == 6.3
    (four_b,) = [c for c in commands if "size=4b" in c[3]]
    assert "--config.dry_run.compiler=cpu" in four_b
    assert round(_run(four_b + ["--config.dry_run.compiler=none"])["total"]) == 92  # "analytic 92 GiB"
