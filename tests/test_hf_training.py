"""Training from a Hugging Face checkpoint: f32 master weights under bf16 compute (issue #12).

At lr 1e-6 an AdamW step moves a weight by ~1e-6 (relative ~1e-5 for unit-size
weights); bf16 has 8 mantissa bits (relative spacing ~4e-3), so bf16-stored
parameters would mostly not move at all. The trainer must keep ``model.param_dtype``
(f32) masters and compute in ``model.dtype`` (bf16).
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models import Qwen3Config, save_pretrained
from pdm_jax.models.qwen3 import init_model
from pdm_jax.models.tokenizer import build_char_tokenizer
from pdm_jax.trainer import Trainer
from test_trainer import tiny_test_config


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 in HF format plus a char tokenizer in the same directory (one for the module: the tests
    only read it); returns its path and f32 params."""
    path = tmp_path_factory.mktemp("hf_checkpoint") / "hf"
    tok = build_char_tokenizer("0123456789+-=", str(path))
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    model = init_model(cfg, seed=3)  # one compiled init (an eager one builds dozens of small programs)
    save_pretrained(model, str(path))
    return path, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.slow  # a trainer run (2 RL steps), as every end-to-end run is
def test_bf16_compute_keeps_f32_masters_that_move_at_lr_1e6(tmp_path, hf_checkpoint):
    ckpt, initial = hf_checkpoint
    c = tiny_test_config(**{
        "model.hf_path": str(ckpt), "model.dtype": "bfloat16", "model.param_dtype": "float32",
        "tokenizer.kind": "path", "tokenizer.path": str(ckpt), "sft.steps": 0, "rl.steps": 2,
        "rl.learning_rate": 1e-6, "sampler.mode": "in_process", "eval.num_prompts": 4, "eval.greedy": False,
        "checkpoint.every_steps": 100, "profile.steps": "2:2"})
    t = Trainer(c, str(tmp_path / "run"))
    assert {str(x.dtype) for x in jax.tree.leaves(t.params)} == {"float32"}
    np.testing.assert_array_equal(  # loaded exactly (f32 checkpoint, f32 masters)
        np.asarray(nnx.to_pure_dict(t.params)["embed_tokens"]["embedding"]), initial["embed_tokens"]["embedding"])
    t.run()
    after = nnx.to_pure_dict(t.params)
    assert {str(x.dtype) for x in jax.tree.leaves(after)} == {"float32"}
    moved = [np.mean(np.asarray(a) != np.asarray(b)) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(initial))]
    total = sum(np.asarray(a).size for a in jax.tree.leaves(initial))
    frac = sum(m * np.asarray(a).size for m, a in zip(moved, jax.tree.leaves(initial))) / total
    assert frac > 0.9, frac  # bf16 masters moved ~2% of the weights at this lr
    # profile.steps = "2:2": a jax.profiler trace of RL step 2 (same run, to save a compile)
    traces = [f for _, _, files in os.walk(tmp_path / "run" / "profile") for f in files]
    assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in traces), traces


def test_a_checkpoint_that_ships_a_tokenizer_refuses_a_built_one(tmp_path, hf_checkpoint):
    """The tiny config's character tokenizer with a checkpoint that ships its own: a config error naming both
    (exit 2 from the command line), before any work; the checkpoint's own tokenizer passes."""
    import subprocess
    import sys


    from pdm_jax.config import validate_config

    ckpt, _ = hf_checkpoint
    c = tiny_test_config(**{"model.hf_path": str(ckpt)})
    with pytest.raises(ValueError, match=rf"model.hf_path = '{ckpt}': ships its own tokenizer \(tokenizer.json\), "
                                         r"and tokenizer.kind = 'char' builds another one.*tokenizer.kind=path"):
        validate_config(c)
    validate_config(tiny_test_config(**{"model.hf_path": str(ckpt), "tokenizer.kind": "path",
                                        "tokenizer.path": str(ckpt)}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "pdm_jax.train", "--config=configs/tiny.py",
                        f"--config.model.hf_path={ckpt}", f"--workdir={tmp_path / 'run'}"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "config error: model.hf_path" in p.stderr and "tokenizer.kind = 'char'" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "run").exists()


def test_a_tokenizer_must_fit_the_model_and_match_the_checkpoints_vocabulary(tmp_path, caplog, hf_checkpoint):
    """`check_tokenizer_fits_model`: more token ids than the model's rows is refused naming both sizes; fewer is
    fine (Qwen3: 151,669 tokens, 151,936 rows); a tokenizer.path other than the checkpoint's own passes with the
    same vocabulary and is refused with another mapping, naming a token whose ids differ."""
    import shutil


    from pdm_jax.models.tokenizer import load_tokenizer
    from pdm_jax.text import check_tokenizer_fits_model

    ckpt, _ = hf_checkpoint  # 13 symbols + its special tokens
    tok = load_tokenizer(str(ckpt))
    n = len(tok)
    char = tiny_test_config().tokenizer
    with pytest.raises(ValueError, match=rf"tokenizer.kind = 'char': its {n} token ids do not fit the model "
                                         rf"\(model.preset / model.vocab_size\) with vocab_size {n - 1}"):
        check_tokenizer_fits_model(tok, n - 1, char)
    check_tokenizer_fits_model(tok, n, char)
    check_tokenizer_fits_model(tok, n + 267, char)
    with caplog.at_level("WARNING", logger="pdm_jax.text"):
        check_tokenizer_fits_model(tok, 2 * n, char, str(tmp_path / "no_tokenizer_files"))
        assert not caplog.records  # half the rows used: no warning
        check_tokenizer_fits_model(tok, 151_936, char, str(tmp_path / "no_tokenizer_files"))
    assert f"its {n} token ids use under half of the 151936 embedding rows of model.hf_path" in caplog.text
    path = tiny_test_config(**{"tokenizer.kind": "path", "tokenizer.path": str(ckpt)}).tokenizer
    with pytest.raises(ValueError, match=rf"model.hf_path = '{ckpt}' with vocab_size {n - 1}.*tokenizer.path={ckpt}"):
        check_tokenizer_fits_model(tok, n - 1, path, str(ckpt))
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    same = tiny_test_config(**{"tokenizer.kind": "path", "tokenizer.path": str(copy)}).tokenizer
    check_tokenizer_fits_model(load_tokenizer(str(copy)), n, same, str(ckpt))
    other_dir = tmp_path / "other"
    build_char_tokenizer("=-+9876543210", str(other_dir))  # the same symbols, other ids
    other = tiny_test_config(**{"tokenizer.kind": "path", "tokenizer.path": str(other_dir)}).tokenizer
    with pytest.raises(ValueError, match=rf"its vocabulary \({n} tokens\) is not the one model.hf_path = '{ckpt}' "
                                         rf"ships \({n} tokens; '\+' is id \d+ in tokenizer.path and \d+ in the "
                                         rf"checkpoint\): set tokenizer.path={ckpt}"):
        check_tokenizer_fits_model(load_tokenizer(str(other_dir)), n, other, str(ckpt))
