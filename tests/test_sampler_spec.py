"""pdm_jax.sampler.spec.EngineSpec: the engine's settings, validated once; the server's flags and the launcher's
argv are generated from its fields, so a setting lives in the spec and its one consumer."""
import dataclasses
import os

import pytest

import pdm_jax
from pdm_jax.rollouts import launcher
from pdm_jax.sampler import defaults
from pdm_jax.sampler.server import parse_args
from pdm_jax.sampler.spec import EngineSpec

REQUIRED = ["--model_config=x", "--checkpoint_root=/tmp"]


@pytest.mark.parametrize("field, value, words", [
    ("quantization", "fp16", "quantization must be one of"), ("batching", "paged", "batching must be one of"),
    ("weight_noise", 1.5, "weight_noise must be a number in [0, 1.0], got 1.5"),
    ("weight_noise", float("nan"), "weight_noise must be"), ("weight_noise", True, "weight_noise must be"),
    ("weight_noise_seed", 2**32, "weight_noise_seed must be an integer in [0, 2**32), got 4294967296"),
    ("park_rows", -1, "park_rows must be an integer >= 0, got -1"), ("park_rows", 1.0, "park_rows must be"),
    ("max_slots", 0, "max_slots must be an integer >= 1, got 0"), ("mesh_tensor", 0, "mesh_tensor must be"),
    ("max_prompt_length", True, "max_prompt_length must be an integer >= 1, got True"),
])
def test_a_bad_setting_is_refused_naming_the_field_and_value(field, value, words):
    with pytest.raises(ValueError, match="EngineSpec: " + words.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("*", r"\*")):
        EngineSpec(**{field: value})


def test_defaults_are_the_shared_defaults():
    spec = EngineSpec()
    assert (spec.batching, spec.max_batch_size, spec.park_rows, spec.max_slots) == (
        defaults.BATCHING, defaults.MAX_BATCH_SIZE, defaults.PARK_ROWS, None)


def test_the_server_flags_are_the_spec_fields_and_round_trip():
    """Every flag field is a server flag with the field's default (fp8 weights on the server); a spec written as
    flags (`EngineSpec.to_argv`, what the launcher passes) parses back to the same spec."""
    flags = {f.name for f in EngineSpec.flag_fields()}
    assert flags >= {"quantization", "park_rows", "max_slots", "mesh_data", "batching", "max_new_tokens"}
    assert parse_args(REQUIRED).engine_spec == EngineSpec(quantization="fp8")
    spec = EngineSpec(quantization="int8", compute_dtype="float32", weight_noise=0.05, weight_noise_seed=3,
                      max_prompt_length=64, max_new_tokens=32, max_batch_size=16, batching="static", max_slots=8,
                      park_rows=0, mesh_data=2, mesh_tensor=2)
    assert {a.split("=")[0][2:] for a in spec.to_argv()} == flags
    args = parse_args(REQUIRED + spec.to_argv())
    assert args.engine_spec == spec and args.park_rows == 0
    with pytest.raises(SystemExit):
        parse_args(REQUIRED + ["--weight_noise=2"])


def test_the_launcher_passes_the_spec_as_flags(monkeypatch):
    """`start_sampler_server` writes the spec's flags (and its options), so the served engine's spec is the
    caller's; old keyword settings still reach the spec; an engine-only setting (no flag) is refused."""
    seen = {}
    monkeypatch.setattr(launcher, "SamplerProcess", lambda argv, **kw: seen.update(argv=argv, **kw))
    spec = EngineSpec(quantization="none", park_rows=0, max_slots=4, mesh_tensor=2)
    launcher.start_sampler_server(spec, model_config="m", weights=None, checkpoint_root="/ck", host="::1",
                                  startup_timeout_s=5.0, max_new_tokens=64)
    argv = seen["argv"]
    served = parse_args([a for a in argv[3:] if not a.startswith("--parent_pid")]).engine_spec
    assert served == dataclasses.replace(spec, max_new_tokens=64)
    assert "--host=::1" in argv and seen["host"] == "::1" and seen["startup_timeout_s"] == 5.0
    with pytest.raises(ValueError, match="no flag for \\['min_prompt_bucket'\\]"):
        launcher.start_sampler_server(EngineSpec(min_prompt_bucket=4), model_config="m", weights=None,
                                      checkpoint_root="/ck")
    with pytest.raises(TypeError, match="unknown setting"):
        launcher.start_sampler_server(model_config="m", weights=None, checkpoint_root="/ck", parking=1)


def test_park_rows_lives_in_the_spec_and_its_one_consumer():
    """The files of the package that name ``park_rows``: the spec and its consumer (continuous batching), and the
    sampler planner (`dry_run_fit`), which searches that knob and writes the settings it picks as run-config fields;
    not the schema, its validation or reference, `SamplerSpec`, the dry run, the server, the launcher, the
    supervisor or the engine's front, which take it from the spec by name or pass the spec on."""
    root = os.path.dirname(pdm_jax.__file__)
    naming = set()
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    if "park_rows" in fh.read():
                        naming.add(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    assert naming <= {"sampler/spec.py", "sampler/continuous_batching.py", "dry_run_fit.py"}, naming
    assert {"sampler/spec.py", "sampler/continuous_batching.py"} <= naming
