"""docs/sampler.md's sampler-by-hand block, run as pasted (curl must run only once the server listens).

The test builds what a finished default run leaves in ``runs/tiny`` (the character tokenizer, the
model's ``config.json``, sampler weights ``v000300`` of a freshly initialised tiny model), points the
block's ``runs/tiny`` at it, runs the block with bash and checks each step: the server was waited for,
/health and /v1/generate answered, the ids were decoded with the run's tokenizer, and the server stopped.
"""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flax import nnx

from pdm_jax.config import model_config_from_fields
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.models.tokenizer import build_char_tokenizer
from pdm_jax.sampler.weights import save_weights

REPO = Path(__file__).resolve().parents[1]


def docs_sampler_block() -> str:
    """The first ```bash block of docs/sampler.md's "Serving a run by hand" section."""
    text = (REPO / "docs" / "sampler.md").read_text()
    section = text[text.index("## Serving a run by hand"):]
    end = section.find("\n## ", 1)
    section = section[: end if end >= 0 else len(section)]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, "no bash block in docs/sampler.md's 'Serving a run by hand' section"
    return match.group(1)


def fake_finished_run(run_dir: Path) -> None:
    """runs/tiny as the default run leaves it, with a randomly initialised model instead of the trained one."""
    spec = importlib.util.spec_from_file_location("tiny_config", REPO / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    tokenizer = build_char_tokenizer(config.tokenizer.symbols, run_dir / "tokenizer")
    model_config = model_config_from_fields(config.model, len(tokenizer))
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text(json.dumps(model_config.to_hf_dict()))
    model = Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(0))
    save_weights(model, str(run_dir / "weights" / "v000300"), version=300)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("bash") is None, reason="needs bash and curl")
def test_docs_sampler_block_runs_as_pasted(tmp_path):
    block = docs_sampler_block()
    assert "SAMPLER_LISTENING" in block and "AutoTokenizer" in block and "kill" in block
    run_dir = tmp_path / "runs" / "tiny"
    fake_finished_run(run_dir)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    # The block is run exactly as written, from a directory whose runs/tiny is the fake run.
    proc = subprocess.run(["bash", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    log = (run_dir / "sampler.log").read_text()
    assert not (tmp_path / "sampler.log").exists()  # the log stays in the run's directory
    assert proc.returncode == 0, (out, proc.stderr, log)
    port = int(re.search(r"^SAMPLER_LISTENING port=(\d+)$", log, re.MULTILINE).group(1))
    health = json.loads(out.splitlines()[0])
    assert health["status"] == "ok" and health["version"] == 300 and health["max_prompt_length"] == 64
    lines = out.splitlines()[1:]
    assert len(lines) == 2, out  # n = 2 choices, one decoded line each
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    assert tok("57+87=")["input_ids"] == [7, 9, 12, 10, 9, 14]  # the ids the block sends
    for line in lines:
        ids_text, decoded, finish = re.fullmatch(r"(\[[0-9, ]*\]) ('.*'|\".*\") (stop|length)", line).groups()
        ids = json.loads(ids_text)
        assert 1 <= len(ids) <= 6 and (finish == "stop") == (ids[-1] == 1)
        assert eval(decoded) == tok.decode(ids, skip_special_tokens=True)  # noqa: S307 (a repr we printed)
    # The server was stopped: within a few seconds nothing listens on its port any more.
    deadline = time.monotonic() + 20
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break
        assert time.monotonic() < deadline, "the sampler still listens after the block's kill"
        time.sleep(0.5)
