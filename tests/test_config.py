"""pdm_jax.config: checks that run before any work, and the one builder of the step configs."""

import os
import re

import numpy as np
import pytest

from pdm_jax import config as config_lib
from pdm_jax.config import get_base_config, step_configs, validate_config
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.rl.train_step import OptimizerConfig
from pdm_jax.rl.trust_region import TrustRegionConfig


def _valid_config():
    """The base config with K small enough for its char tokenizer (base K = 20 is for real vocabularies)."""
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    return c


def test_unknown_field_is_named_by_its_dotted_path():
    c = _valid_config()
    c.rl.foo = 1
    with pytest.raises(ValueError, match=r"^rl\.foo: unknown config field"):
        validate_config(c)
    c = _valid_config()
    c.data.task_config.max_terms = 3  # task_config is free-form (passed to reasoning-gym)
    validate_config(c)


@pytest.mark.parametrize("override, needle", [
    ("rl.steps=abc", "rl.steps must be an integer, got 'abc'"),
    ("rl.steps=1.5", "rl.steps must be an integer, got '1.5'"),
    ("log.progress=maybe", "log.progress must be a boolean (true/false, 1/0), got 'maybe'"),
    ("trust_region.delta=x", "trust_region.delta must be a number, got 'x'"),
    ("sampler.temperature=none", "sampler.temperature must be a number (None only in the argument string, "
                                 "--config=<file>:sampler.temperature=none), got 'none'"),
    ("trust_region.delta_low=abc", "trust_region.delta_low must be a number (None only in the argument string"),
])
def test_cli_override_that_does_not_parse_exits_2_like_every_config_error(override, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        config_lib.check_override_value(*override.split("="))
    config_lib.check_override_value("rl.steps", "12")
    config_lib.check_override_value("log.progress", "false")
    config_lib.check_override_value("trust_region.delta", "1e-3")
    config_lib.check_override_value("sampler.temperature", "1.2")  # an optional number takes a number
    config_lib.check_override_value("sampler.mode", "anything")  # strings are checked by validate_config


@pytest.mark.parametrize("field, value, needle", [
    ("rl.group_size", 2.5, "rl.group_size = 2.5: must be an integer"),
    ("log.tensorboard", 1, "log.tensorboard = 1: must be true or false"),
    ("sampler.mode", 3, "sampler.mode = 3: must be a string"),
    ("rl.dual_clip", "x", "rl.dual_clip = 'x': must be a number"),
])
def test_values_of_the_wrong_kind_are_named(field, value, needle):
    c = _valid_config()
    group, name = field.split(".")
    c[group].unlock()
    with c[group].ignore_type():
        c[group][name] = value
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate_config(c)


def test_topk_larger_than_a_char_vocabulary_fails_before_the_tokenizer_exists():
    c = get_base_config()  # symbols "0123456789+-=": 13 + <pad> + <eos> = 15 ids
    c.rl.top_k_logprobs = 16
    with pytest.raises(ValueError, match=r"rl.top_k_logprobs = 16: K is larger than the vocabulary size 15"):
        validate_config(c)
    c.rl.top_k_logprobs = 15
    validate_config(c)


@pytest.mark.parametrize("kind", ["gsm8k", "dapo_math"])
def test_file_sources_need_data_path_first(kind):
    c = get_base_config()
    c.data.kind = kind  # prompt_format stays "compact", which the math sources reject: the path is named first
    with pytest.raises(ValueError, match=rf"data.path = '': required when data.kind = '{kind}'"):
        validate_config(c)


def test_eval_prompts_against_the_held_out_set():
    c = _valid_config()
    c.eval.num_prompts = 300
    with pytest.raises(ValueError, match="eval.num_prompts = 300: the data source has only 256 held-out prompts"):
        validate_config(c, num_held_out=256)


def test_step_configs_translate_every_field():
    c = get_base_config()
    c.trust_region.delta_low = 0.01
    c.trust_region.clip_eps_high = 0.28
    c.rl.policy_loss = "ppo_clip"
    c.rl.kl_beta = 0.1
    c.rl.adam_b2 = 0.95
    c.sft.warmup_steps = 7
    got = step_configs(c)
    assert got.trust_region == TrustRegionConfig(mask="pdm", divergence="topk_kl", estimator="bucket_exact",
                                                 delta=0.05, delta_low=0.01, clip_eps_high=0.28)
    assert got.policy_loss == PolicyLossConfig(policy_loss="ppo_clip", tis_cap=5.0, clip_eps_high=0.28,
                                               max_response_length=c.rl.max_new_tokens, kl_beta=0.1)
    assert got.rl_optimizer == OptimizerConfig(learning_rate=1e-4, b2=0.95, total_steps=c.rl.steps)
    assert got.sft_optimizer == OptimizerConfig(learning_rate=1e-3, warmup_steps=7, total_steps=c.sft.steps)
    with pytest.raises(ValueError,
                       match=r"^trust_region: TrustRegionConfig.delta must be a finite float > 0, got -1.0"):
        c.trust_region.delta = -1.0
        step_configs(c)


def test_check_field_path():
    config_lib.check_field_path("trust_region.delta")
    config_lib.check_field_path("data.task_config.min_terms")
    with pytest.raises(ValueError, match="rl.foo"):
        config_lib.check_field_path("rl.foo")


def test_profile_steps_are_checked_up_front():
    from pdm_jax.profiling import parse_steps

    assert parse_steps("") is None and parse_steps("2:4") == (2, 4)
    for bad in ("4:2", "0:1", "3", "a:b", "1:2:3"):
        c = _valid_config()
        c.profile.steps = bad
        with pytest.raises(ValueError, match=f"profile.steps = '{bad}'"):
            validate_config(c)


@pytest.mark.parametrize("field, value", [("sampler.stall_probe_interval_s", 0.0),
                                          ("sampler.stall_probe_timeout_s", float("inf")),
                                          ("sampler.stall_probe_misses", -1)])
def test_stall_probe_settings_are_checked(field, value):
    c = _valid_config()
    group, name = field.split(".")
    c[group][name] = value
    with pytest.raises(ValueError, match=field):
        validate_config(c)


@pytest.mark.parametrize("value,match", [
    ("151645,x", r"'x' is not a non-negative integer token id"),
    ("3,-1", r"'-1' is not a non-negative integer token id"),
    ("5,5", "repeats a token id"),
    (",".join(str(i) for i in range(8)), "at most 7 ids"),
    ("3,15", r"ids \[15\] are outside the vocabulary of 15 tokens"),
])
def test_stop_token_ids_are_checked(value, match):
    c = get_base_config()  # char vocabulary: 15 ids
    c.rl.top_k_logprobs = 4
    c.sampler.stop_token_ids = value
    with pytest.raises(ValueError, match=r"sampler.stop_token_ids = .*" + match):
        validate_config(c)


def test_stop_token_ids_reach_the_codec():
    """Parsed ids go after the eos id (no repeats); decoding drops every stop id."""
    from pdm_jax.models.tokenizer import build_char_tokenizer
    from pdm_jax.text import TextCodec
    import tempfile

    assert config_lib.parse_stop_token_ids(" 151645, 151643 ") == (151645, 151643)
    assert config_lib.parse_stop_token_ids("") == ()
    with tempfile.TemporaryDirectory() as d:
        tok = build_char_tokenizer("0123456789+=", d)
        one, plus = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("+")
        codec = TextCodec(tok, chat=False, stop_token_ids=(plus, tok.eos_token_id))
        assert codec.stop_ids == (tok.eos_token_id, plus)
        ids = np.array([one, plus, one, tok.eos_token_id])
        assert codec.decode_completion(ids, np.ones(4, bool)) == "11"
        assert TextCodec(tok, chat=False).stop_ids == (tok.eos_token_id,)


@pytest.mark.parametrize("field, value, match", [("sampler.batching", "paged", "must be one of"),
                                                 ("sampler.max_slots", -1, "integer >= 0"),
                                                 ("sampler.park_rows", -1, "integer >= 0")])
def test_batching_settings_are_checked(field, value, match):
    c = _valid_config()
    group, name = field.split(".")
    c[group][name] = value
    with pytest.raises(ValueError, match=f"{field} = .*{match}"):
        validate_config(c)


@pytest.mark.parametrize("changes, field, match", [
    ({"weight_noise": -0.1}, "sampler.weight_noise", "finite relative std in"),
    ({"weight_noise": float("nan")}, "sampler.weight_noise", "finite relative std in"),
    ({"weight_noise": 1.5}, "sampler.weight_noise", "finite relative std in"),
    ({"weight_noise": 0.1, "backend": "vllm", "mode": "remote", "address": "http://127.0.0.1:1"},
     "sampler.weight_noise", "must be 0 with sampler.backend = 'vllm'"),
    ({"weight_noise_seed": -1}, "sampler.weight_noise_seed", "integer in"),
    ({"weight_noise_seed": 2**32}, "sampler.weight_noise_seed", "integer in")])
def test_weight_noise_settings_are_checked(changes, field, match):
    c = _valid_config()
    for name, value in changes.items():
        c.sampler[name] = value
    with pytest.raises(ValueError, match=f"{field} = .*{match}"):
        validate_config(c)
    c = _valid_config()
    c.sampler.weight_noise = 0.3
    validate_config(c)


def test_weight_noise_reaches_the_server_flags_and_the_rollout_engines_only(tmp_path):
    """sampler.weight_noise becomes the server's --weight_noise (refused out of range) and the in-process rollout
    engines' noise; the trainer's evaluation engine (``noised=False``) holds the weights as they are."""
    import dataclasses

    from pdm_jax.rollouts.spec import SamplerSpec
    from pdm_jax.rollouts.supervisor import SamplerSupervisor
    from pdm_jax.sampler.server import parse_args

    args = parse_args(["--model_config=x", "--checkpoint_root=/tmp", "--weight_noise=0.25", "--weight_noise_seed=3"])
    assert (args.weight_noise, args.weight_noise_seed) == (0.25, 3)
    for bad in ("--weight_noise=nan", "--weight_noise=-1", "--weight_noise=2", "--weight_noise_seed=-1"):
        with pytest.raises(SystemExit):
            parse_args(["--model_config=x", "--checkpoint_root=/tmp", bad])
    c = _valid_config()
    c.sampler.weight_noise, c.sampler.weight_noise_seed = 0.2, 11
    spec = SamplerSpec.from_config(c.sampler)
    assert (spec.weight_noise, spec.weight_noise_seed) == (0.2, 11)
    from conftest import TINY_DENSE
    from flax import nnx

    from pdm_jax.models.qwen3 import Qwen3ForCausalLM

    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(TINY_DENSE, rngs=nnx.Rngs(0)), nnx.Param))
    sup = SamplerSupervisor(dataclasses.replace(spec, mode="colocated", max_prompt_length=16, max_batch_size=4),
                            workdir=str(tmp_path), model_config=TINY_DENSE, max_new_tokens=8)
    rollout = sup.memory_engine(params, 0, "none").engine
    evaluation = sup.memory_engine(params, 0, "none", noised=False).engine
    assert (rollout.weight_noise, rollout.weight_noise_seed, evaluation.weight_noise) == (0.2, 11, 0.0)
    w = np.asarray(params["lm_head"]["kernel"])
    assert np.array_equal(np.asarray(evaluation.params["lm_head"]["kernel"]), w)
    assert 0.15 < np.linalg.norm(np.asarray(rollout.params["lm_head"]["kernel"]) - w) / np.linalg.norm(w) < 0.25


def test_batching_reaches_the_sampler_server_flags():
    """sampler.batching / max_slots become the server's --batching / --max_slots (the launcher's argv)."""
    from pdm_jax.sampler.server import parse_args

    args = parse_args(["--model_config=x", "--checkpoint_root=/tmp", "--batching=static", "--max_slots=16"])
    assert (args.batching, args.max_slots) == ("static", 16)
    assert parse_args(["--model_config=x", "--checkpoint_root=/tmp", "--park_rows=0"]).park_rows == 0
    with pytest.raises(SystemExit):
        parse_args(["--model_config=x", "--checkpoint_root=/tmp", "--batching=paged"])


def test_validate_config_names_every_error_at_once():
    """One start names every problem (not one per start): three bad fields in three check groups."""
    c = get_base_config()
    c.rl.top_k_logprobs = 4  # K < the char tokenizer's 15 tokens
    c.rl.group_size = 1
    c.sampler.quantization = "fp4"
    c.eval.num_prompts = 0
    with pytest.raises(ValueError) as e:
        validate_config(c)
    text = str(e.value)
    assert text.startswith("3 config errors: ")
    for part in ("rl.group_size = 1: GRPO needs at least 2", "sampler.quantization = 'fp4'", "eval.num_prompts = 0"):
        assert part in text, text
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    c.rl.group_size = 1
    with pytest.raises(ValueError, match=r"^rl.group_size = 1: GRPO needs at least 2 samples per prompt$"):
        validate_config(c)  # one error: its message alone


@pytest.mark.parametrize("name,arg", [("qwen3_dapo", "size=8b"), ("qwen3_dapo", "size=4b"),
                                      ("qwen3_30b_a3b_dapo", None)])
def test_dapo_recipes_are_consistent(tmp_path, name, arg):
    """The recipes' own defaults pass the whole validation (paths pointed at files that exist here) and the
    held-out check against AIME-24's 30 problems; docs/models.md's data layout is what they read."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    data = os.path.join(root, "tests", "data", "fixtures", "dapo_math_tiny.parquet")
    c = mod.get_config(",".join(x for x in (arg, f"hf_path={ckpt},data_path={data},eval_path={data}") if x))
    validate_config(c, vocab_size=151_669, num_held_out=30)
    assert c.data.num_eval == c.eval.num_prompts == 30 and c.eval.engine == "rollout"
    n = c.rl.prompts_per_step * c.rl.group_size // c.rl.num_minibatches
    assert n % c.rl.micro_batch_size == 0


def test_collected_errors_are_each_named_once_and_skip_nothing():
    """A malformed stop-id list does not hide the checks after it nor add a raw Python message; a model error
    does not hide the mesh's; a value checked twice is named once; the new fields are checked too."""
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    c.sampler.stop_token_ids = "abc"
    c.sampler.max_batch_size = 0
    c.model.num_attention_heads = 3  # not a multiple of the 2 kv heads
    c.mesh.data = 3  # on the test's 8 devices
    c.data.chat_template = "bogus"
    with pytest.raises(ValueError) as e:
        validate_config(c)
    text = str(e.value)
    for part in ("sampler.stop_token_ids = 'abc': 'abc' is not a non-negative integer token id",
                 "sampler.max_batch_size = 0: must be >= 1", "model: ", "mesh = (data=3",
                 "data.chat_template = 'bogus'"):
        assert text.count(part) == 1, (part, text)
    assert "invalid literal" not in text and text.startswith("5 config errors: ")


def test_dry_run_fields_are_checked_with_the_run():
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    c.dry_run.compiler, c.dry_run.chip = "tpu", "H100"
    with pytest.raises(ValueError, match=r"dry_run.compiler = 'tpu' cannot compile for dry_run.chip = 'H100'"):
        validate_config(c)
    c.dry_run.compiler, c.dry_run.chip, c.dry_run.topology = "auto", "v5p", "8x8"
    with pytest.raises(ValueError, match=r"dry_run.topology = '8x8' is not a slice of dry_run.chip = 'v5p'"):
        validate_config(c)
    c.dry_run.chip, c.dry_run.topology = "H100", "1x16"
    with pytest.raises(ValueError, match=r"dry_run.topology = '1x16': a GPU pod is .* at most 8 GPUs per host"):
        validate_config(c)


def test_sampler_token_checked_without_showing_it_and_redacted_in_the_workdir_config():
    c = get_base_config()
    c.rl.top_k_logprobs = 4  # within the base config's 15-symbol vocabulary
    c.sampler.token = "secret value"
    with pytest.raises(ValueError, match=r"sampler.token = '<redacted>': holds 1 character") as e:
        validate_config(c)
    assert "secret" not in str(e.value)
    c.sampler.token = "s3cret"
    validate_config(c)
    r = config_lib.redacted(c)
    assert r.sampler.token == "<redacted>" and c.sampler.token == "s3cret"
    assert "s3cret" not in r.to_json_best_effort()
    assert config_lib.redacted(get_base_config()).sampler.token == ""  # nothing to hide: left as is


def test_seeds_and_the_multihost_timeout_are_checked_before_work():
    c = get_base_config()
    c.rl.top_k_logprobs = 4
    c.seed, c.data.seed, c.multihost.initialization_timeout_s = -1, -7, -1
    with pytest.raises(ValueError) as e:
        validate_config(c)
    msg = str(e.value)
    assert msg.startswith("3 config errors")
    for want in ("seed = -1: must be an integer in [0, 2**63 - 1]", "data.seed = -7",
                 "multihost.initialization_timeout_s = -1: must be a finite number of seconds > 0"):
        assert want in msg


def test_bpe_tokenizer_fields_are_checked_naming_them():
    c = get_base_config()
    c.tokenizer.kind, c.tokenizer.vocab_size, c.tokenizer.corpus_prompts = "bpe", 16, 0
    c.tokenizer.path = "/somewhere"
    with pytest.raises(ValueError) as e:
        validate_config(c)
    text = str(e.value)
    for part in ("tokenizer.path = '/somewhere': is ignored when tokenizer.kind = 'bpe'",
                 "tokenizer.corpus_prompts = 0: must be an int in [1, 1000000]",
                 "tokenizer.vocab_size = 16: must be an int in [259, 1048576]",
                 "rl.top_k_logprobs = 20: K is larger than the vocabulary size 16"):
        assert part in text, (part, text)
    c.tokenizer.path, c.tokenizer.vocab_size, c.tokenizer.corpus_prompts = "", 1024, 100
    validate_config(c)
    validate_config(c, vocab_size=1000)  # the trained size, below tokenizer.vocab_size
    for field, value in (("vocab_size", 2 ** 31), ("corpus_prompts", 10 ** 9)):
        c.tokenizer[field] = value
        with pytest.raises(ValueError, match=f"tokenizer.{field} = {value}: must be an int in"):
            validate_config(c)
        c.tokenizer.vocab_size, c.tokenizer.corpus_prompts = 1024, 100
    c.data.prompt_format = "question"  # a chat source under chat_template auto, before any tokenizer is trained
    with pytest.raises(ValueError, match="data.chat_template = 'auto': tokenizer.kind = 'bpe' trains"):
        validate_config(c)
    c.data.chat_template = "off"
    validate_config(c)
    c.tokenizer.kind = "bogus"
    with pytest.raises(ValueError, match=r"tokenizer.kind = 'bogus': must be one of \('char', 'bpe', 'path'\)"):
        validate_config(c)


def test_lr_schedules_decay_to_zero_at_the_phase_end():
    """sft.lr_schedule / rl.lr_schedule: linear warm-up to the peak, then constant, cosine or linear decay reaching 0 at
    the phase's last optimizer step (optax's schedules, checked at hand-computed values)."""
    c = get_base_config()
    c.sft.steps, c.sft.warmup_steps, c.sft.lr_schedule = 110, 10, "cosine"
    c.rl.steps, c.rl.num_iterations, c.rl.num_minibatches, c.rl.lr_schedule = 25, 2, 2, "linear"
    c.rl.top_k_logprobs = 4  # K < the base config's 15-id char vocabulary
    validate_config(c)
    got = step_configs(c)
    assert got.sft_optimizer.total_steps == 110 and got.rl_optimizer.total_steps == 100
    _, sft_lr = got.sft_optimizer.build()
    _, rl_lr = got.rl_optimizer.build()
    assert float(sft_lr(5)) == pytest.approx(1e-3 / 10 + 5 * (1e-3 - 1e-3 / 10) / 10)  # warm-up
    assert float(sft_lr(10)) == pytest.approx(1e-3)
    assert float(sft_lr(60)) == pytest.approx(1e-3 * 0.5 * (1 + np.cos(np.pi * 0.5)), abs=1e-9)  # half-way: peak / 2
    assert float(sft_lr(110)) == pytest.approx(0.0, abs=1e-12)
    assert float(rl_lr(0)) == pytest.approx(1e-4) and float(rl_lr(75)) == pytest.approx(0.25e-4)
    assert float(rl_lr(100)) == pytest.approx(0.0, abs=1e-12)
    c.sft.lr_schedule = "step"
    with pytest.raises(ValueError,
                       match=r"sft.lr_schedule = 'step': must be one of \('constant', 'cosine', 'linear'\)"):
        validate_config(c)
    c.sft.lr_schedule, c.sft.steps = "cosine", 10
    with pytest.raises(ValueError, match=r"sft.lr_schedule = 'cosine': decays after the warm-up: sft.steps = 10 must "
                                         r"exceed sft.warmup_steps = 10"):
        validate_config(c)
