"""pdm_jax.sections: the config sections' records mirror the schema field for field and check themselves."""
import dataclasses

import pytest

from pdm_jax.config import get_base_config, validate_config
from pdm_jax.sections import (SECTION_RECORDS, CheckpointSpec, DryRunSpec, LogSpec, ModelSpec, MultihostSpec,
                              ProfileSpec, RlSpec, TokenizerSpec, read)


@pytest.mark.parametrize("name", sorted(SECTION_RECORDS))
def test_each_record_has_exactly_its_sections_fields(name):
    section = get_base_config()[name]
    assert {f.name for f in dataclasses.fields(SECTION_RECORDS[name])} == set(section.keys())
    record = read(SECTION_RECORDS[name], section)
    assert dataclasses.asdict(record) == section.to_dict()  # the schema's defaults, unchanged by the casts


def test_the_sections_are_read_with_their_types():
    c = get_base_config()
    c.model.rope_theta, c.checkpoint.every_steps = 10_000, 7  # an int where the schema has a float
    model = read(ModelSpec, c.model)
    assert isinstance(model.rope_theta, float) and model.rope_theta == 10_000.0
    assert read(CheckpointSpec, c.checkpoint) == CheckpointSpec(every_steps=7, max_to_keep=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.dtype = "bfloat16"


@pytest.mark.parametrize("record, field, value, message", [
    (CheckpointSpec, "every_steps", 0, "checkpoint.every_steps = 0: must be >= 1"),
    (ProfileSpec, "steps", "3", "profile.steps = '3': must be 'a:b'"),
    (LogSpec, "wandb_project", "a/b", "log.wandb_project = 'a/b': must be 1-128 characters"),
    (LogSpec, "wandb_mode", "sync", "log.wandb_mode = 'sync': must be one of ('online', 'offline')"),
    (ModelSpec, "remat", "most", "model.remat = 'most': must be one of"),
    (ModelSpec, "dtype", "int8", "model.dtype = 'int8': must be a floating dtype name"),
    (TokenizerSpec, "path", "/tok", "tokenizer.path = '/tok': is ignored when tokenizer.kind = 'char'"),
    (DryRunSpec, "num_devices", 0, "dry_run.num_devices = 0: must be >= 1"),
    (RlSpec, "group_size", 1, "rl.group_size = 1: GRPO needs at least 2 samples per prompt"),
    (RlSpec, "overlong_max_length", 4, "rl.overlong_max_length = 4: sets L_max of the overlong shaping, which is off"),
    (MultihostSpec, "initialization_timeout_s", float("inf"),
     "multihost.initialization_timeout_s = inf: must be a finite number of seconds > 0"),
])
def test_a_record_refuses_a_bad_field_naming_it(record, field, value, message):
    name = next(n for n, cls in SECTION_RECORDS.items() if cls is record)
    good = read(record, get_base_config()[name])
    with pytest.raises(ValueError) as e:
        dataclasses.replace(good, **{field: value})
    assert str(e.value).startswith(message), str(e.value)


def test_validate_config_names_every_records_error_at_once():
    c = get_base_config()
    c.rl.top_k_logprobs = 4  # within the char tokenizer's vocabulary
    c.checkpoint.max_to_keep, c.log.wandb_mode, c.dry_run.chip = 0, "sync", "v9"
    with pytest.raises(ValueError) as e:
        validate_config(c)
    text = str(e.value)
    assert text.startswith("3 config errors: "), text
    for part in ("checkpoint.max_to_keep = 0: must be >= 1", "log.wandb_mode = 'sync'", "dry_run.chip = 'v9'"):
        assert part in text, (part, text)
