"""The DAPO recipe (``configs/qwen3_dapo.py``) end to end on a stand-in checkpoint, on 8 fake CPU devices.

The stand-in is the real Qwen3 architecture (Qwen3-0.6B's config: q/k RMSNorm, GQA, RoPE theta 1e6, tied
embeddings, V = 151,936) narrowed to d 128, 4 / 4 heads of 32, ffn 384 and 2 layers, with random weights,
written in Hugging Face format by the project's `save_pretrained` (at 0.6B's width, d 1024, the 8 fake
devices of one CPU host each hold the gathered [V, D] embedding and its gradient: more than this machine's
memory), beside the real Qwen3 BPE the project builds offline
(`pdm_jax.models.build_qwen3_tokenizer`), and the DAPO-Math fixture. The recipe's own choices are kept
(chat-formatted prompts, bf16 compute over f32 masters, remat, scanned layers, the chunked loss,
micro-batches, FSDP over every device, a colocated fp8 sampler on a 1 x 4 sub-mesh, the PDM mask,
evaluation with the rollout engine); only the sizes shrink to fit a CPU. Nothing is downloaded.
"""

import dataclasses
import json
import os

import jax
import pytest
from flax import nnx

from pdm_jax.models import Qwen3ForCausalLM, save_pretrained
from pdm_jax.models import build_qwen3_tokenizer as bq
from pdm_jax.models.presets import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "fixtures", "dapo_math_tiny.parquet")


def _stand_in(path):
    assert bq.main(["--out", str(path)]) == 0  # the real Qwen3 BPE, built and verified offline
    cfg = dataclasses.replace(get_preset("qwen3_0p6b"), num_hidden_layers=2, hidden_size=128, intermediate_size=384,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=32)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    save_pretrained(model, str(path))
    del model
    return cfg


def _recipe(ckpt, steps):
    import importlib.util

    spec = importlib.util.spec_from_file_location("qwen3_dapo", os.path.join(ROOT, "configs", "qwen3_dapo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(f"size=8b,hf_path={ckpt},data_path={FIXTURE},eval_path={FIXTURE}")
    # Sizes for a CPU; everything else is the recipe's.
    c.rl.steps = steps
    c.rl.prompts_per_step, c.rl.group_size, c.rl.num_minibatches = 4, 4, 2  # 8 rows per optimizer step
    c.rl.micro_batch_size = 4  # two micro-batches per optimizer step
    c.rl.max_new_tokens = 8
    c.rl.logits_chunk_size = 4  # two loss chunks per completion
    c.sampler.max_prompt_length = 128
    c.sampler.max_batch_size = 16
    c.sampler.mode = "colocated"  # what auto resolves to on a TPU
    c.data.num_eval = c.eval.num_prompts = 2
    c.eval.samples_per_prompt = 2
    c.eval.every_steps = 1
    c.checkpoint.every_steps = 1
    c.log.progress = False
    return c


@pytest.mark.slow
def test_dapo_recipe_runs_on_a_stand_in_checkpoint_and_resumes(tmp_path):
    from pdm_jax.trainer import Trainer

    ckpt = tmp_path / "Qwen3-standin"
    cfg = _stand_in(ckpt)
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == cfg.vocab_size == 151_936
    assert len(jax.devices()) == 8
    workdir = str(tmp_path / "run")
    first = Trainer(_recipe(ckpt, steps=1), workdir).run()
    # Chat prompts reached the sampler as token ids of the template (<|im_start|>user ... assistant).
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rl = [r for r in records if r.get("phase") == "rl"]
    evals = [r for r in records if r.get("phase") == "eval"]
    assert len(rl) == 1 and evals, records[-3:]
    assert 0 < rl[0]["response_length"] <= 8 and rl[0]["frac_masked"] is not None
    assert evals[-1]["eval_accuracy"] is not None
    # Resume: the same workdir with one more step restores the checkpoint and runs step 2 only.
    second = Trainer(_recipe(ckpt, steps=2), workdir).run()
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rl = [r for r in records if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [1, 2], [r.get("step") for r in rl]
    assert (first["steps"], second["steps"]) == (1, 2) and second["final_accuracy"] is not None
