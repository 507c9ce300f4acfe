"""docs/metrics.md's glossary names every field the run writes, and only those.

The fields are collected from the code that writes them: the RL metrics by calling
`loss.loss_and_metrics` on a tiny batch (trust-region statistics included), the trainer's
per-step record, the SFT step's and the evaluation's dicts by reading their source (`ast`), and
summary.json by calling `metrics.run_summary`.
"""

import ast
import inspect
import re
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pdm_jax import evaluation, metrics, profiling, rewards
from pdm_jax.rl import dapo, loss, train_step
from pdm_jax.rl import trust_region as tr
from pdm_jax.config import load_config_file
from pdm_jax.run_spec import run_spec
from conftest import doc_section

REPO = Path(__file__).resolve().parents[1]


def glossary() -> str:
    """The "Metrics glossary" section of docs/metrics.md (up to the next section or the end)."""
    return doc_section("metrics.md", "Metrics glossary")


def documented(section: str) -> set:
    """Field names in the first column of the section's tables (`name`, possibly several per cell)."""
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def dict_keys_in(function) -> set:
    """Keyword names of dict(...) / X.update(...) calls and string keys assigned as X["k"] = ... in a function."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "dict"
                                           or getattr(node.func, "attr", None) == "update"):
            keys.update(k.arg for k in node.keywords if k.arg)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                    keys.add(target.slice.value)
    return keys


def rl_step_metric_keys() -> set:
    """The keys of one RL optimizer step's metrics: loss_and_metrics (+ loss, grad_norm from the step)."""
    rng = np.random.default_rng(0)
    B, T, V, K = 2, 3, 8, 2
    z = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T))
    topk = np.argsort(-z, -1)[..., :K]
    lp = np.asarray(jnp.log(jnp.exp(z) / jnp.exp(z).sum(-1, keepdims=True)))
    topk_lp, beh = np.take_along_axis(lp, topk, -1), np.take_along_axis(lp, tokens[..., None], -1)[..., 0]
    valid = np.ones((B, T), bool)
    _, logprobs, stats = tr.trust_region_mask_and_logprobs(z, tokens, topk, topk_lp, beh, np.ones(B), valid,
                                                            tr.TrustRegionConfig())
    zeros = jnp.zeros((B, T))
    terms = dict(per_token=zeros, logprobs=logprobs, kl=zeros, entropy=zeros, stats=stats, topk_kl=zeros)
    _, m = loss.loss_and_metrics(terms, valid, beh, np.ones(B, np.float32), loss.PolicyLossConfig())
    assert "frac_direction_disagree" in m  # the default config reports it
    # trust_region.direction = "param_jvp" adds frac_outside_kept
    _, _, stats = tr.trust_region_mask_and_logprobs(z, tokens, topk, topk_lp, beh, np.ones(B), valid,
                                                    tr.TrustRegionConfig(direction="param_jvp"),
                                                    param_direction=np.ones((B, T), np.float32))
    _, m_jvp = loss.loss_and_metrics(dict(terms, stats=stats), valid, beh, np.ones(B, np.float32),
                                     loss.PolicyLossConfig())
    assert set(m_jvp) - set(m) == {"frac_outside_kept"}
    return set(m) | set(m_jvp) | {"loss", "grad_norm"}


@pytest.mark.slow
def test_every_metrics_jsonl_field_is_in_the_glossary_and_nothing_else():
    section = glossary()
    rl_fields = rl_step_metric_keys() | dict_keys_in(metrics.rl_step_record) \
        | dict_keys_in(profiling.step_timing) | dict_keys_in(profiling.compile_record) \
        | set(profiling.PhaseTimer(profiling.STEP_PHASES).record()) - {"time_step"} \
        | dict_keys_in(train_step._with_router_aux) \
        | dict_keys_in(train_step._with_packing_metrics) \
        | dict_keys_in(dapo.step_record) | dict_keys_in(rewards.function_record)  # MoE only: router_aux_loss; packed
        # only: packed_fill; DAPO's pieces; reward.functions
    sft_fields = dict_keys_in(train_step.make_sft_train_step) | {"loss", "grad_norm"}
    eval_fields = {k for k in dict_keys_in(evaluation.evaluate) if k.startswith("eval_")}
    assert {"reward", "staleness", "frac_masked", "mean_tail_mass", "router_aux_loss", "reward_unscored"} <= rl_fields
    assert sft_fields == {"token_accuracy", "loss", "grad_norm"}
    assert eval_fields == {"eval_accuracy", "eval_reward", "eval_greedy_accuracy"}
    jsonl = section[: section.index("**`DIR/summary.json`**")]
    written = rl_fields | sft_fields | eval_fields
    assert written - documented(jsonl) == set(), "fields written but not in the glossary"
    assert documented(jsonl) - written == set(), "glossary names fields nobody writes"


def test_every_summary_json_field_is_in_the_glossary():
    section = glossary()
    spec = run_spec(load_config_file(str(REPO / "configs" / "tiny.py")))
    summary = metrics.run_summary([], spec=spec, meta=dict(rl_step=0), last_eval={}, wall_seconds=1.0)
    part = section[section.index("**`DIR/summary.json`**"):]
    assert set(summary) == documented(part)
