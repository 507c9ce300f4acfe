"""`pdm_jax.models.stand_in`: the stand-in checkpoint is Qwen3-0.6B's configuration narrowed to `STAND_IN_SHAPE`, and
reads back as that config with the weights it wrote (the tokenizer's build is the slow docs test's,
tests/test_docs_models.py; here it is stubbed)."""

import dataclasses
import json

import jax
import numpy as np
from flax import nnx

from pdm_jax.models import Qwen3ForCausalLM, build_qwen3_tokenizer, from_pretrained, stand_in
from pdm_jax.models.presets import get_preset


def test_the_stand_in_is_the_narrowed_preset_and_reads_back(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(build_qwen3_tokenizer, "main", lambda argv: built.append(argv) or 0)
    cfg = stand_in.write_stand_in(str(tmp_path), seed=3)
    assert built == [["--out", str(tmp_path)]]
    preset = get_preset("qwen3_0p6b")
    assert cfg == dataclasses.replace(preset, **stand_in.STAND_IN_SHAPE)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (151_936, preset.rope_theta, True)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    model = from_pretrained(str(tmp_path))
    want = nnx.state(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    got = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
