"""docs/models.md's one-host smoke run works as pasted: its two commands, run as written (paths moved under the
test's directory, one RL step instead of two), build the stand-in checkpoint and run the DAPO recipe on it."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import doc_section, xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_commands() -> list:
    """The argv of each line of the section's fenced block."""
    block = re.search(r"```bash\n(.*?)```", doc_section("models.md", "A one-host smoke run of the recipe"), re.S)
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_the_section_shows_the_stand_in_and_the_smoke_run():
    stand_in, train = smoke_commands()
    assert stand_in == ["python", "-m", "pdm_jax.models.stand_in", "--out=runs/qwen3_stand_in"]
    assert train[:3] == ["python", "-m", "pdm_jax.train"]
    assert "--config=configs/qwen3_dapo.py:smoke=True,hf_path=runs/qwen3_stand_in" in train
    section = doc_section("models.md", "A one-host smoke run of the recipe")
    assert "python -m pdm_jax.models.build_qwen3_tokenizer --out=DIR" in section


@pytest.mark.slow
def test_the_documented_smoke_run_works_as_pasted(tmp_path):
    """The stand-in is the real architecture (Qwen3-0.6B's V = 151,936, GQA 4 / 2) with the real tokenizer, and the
    recipe's smoke run on it (one CPU device, as a user's shell) finishes with a summary and its chat prompts."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ckpt, run = str(tmp_path / "qwen3_stand_in"), str(tmp_path / "qwen3_smoke")
    for argv in smoke_commands():
        argv = [sys.executable if a == "python" else a.replace("runs/qwen3_stand_in", ckpt)
                .replace("--workdir=runs/qwen3_smoke", f"--workdir={run}") for a in argv]
        if "pdm_jax.train" in argv:
            argv += ["--config.rl.steps=1", f"--config.compile_cache.dir={tmp_path / 'cache'}"]
        p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, (argv, p.stderr[-4000:])
    config = json.loads(open(os.path.join(ckpt, "config.json")).read())
    assert (config["vocab_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (151_936, 4, 2)
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(os.listdir(ckpt))
    summary = json.loads(open(os.path.join(run, "summary.json")).read())
    assert summary["steps"] == 1 and summary["eval_prompts"] == 2 and summary["sampler_quantization"] == "fp8"
    ran = json.loads(open(os.path.join(run, "config.json")).read())
    assert (ran["sampler"]["mesh"], ran["sampler"]["mode"], ran["tokenizer"]["path"]) == (
        {"data": 1, "tensor": 1}, "colocated", ckpt)
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    rl = [r for r in records if r.get("phase") == "rl"]
    assert len(rl) == 1 and 0 < rl[0]["response_length"] <= 16
