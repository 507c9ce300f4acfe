"""`pdm_jax.rollouts.spec.SamplerSpec`: the run config's sampler section, typed, read once from the schema."""

import dataclasses
import types

import pytest

from pdm_jax.config import get_base_config
from pdm_jax.rollouts.spec import SamplerSpec
from pdm_jax.rollouts.supervisor import SamplerSupervisor


def test_the_supervisor_takes_the_typed_spec_read_once_from_the_schema(tmp_path):
    """`SamplerSpec.from_config` reads every field of the schema's ``sampler`` section (no fallbacks: a section
    without one is an AttributeError naming it); the supervisor refuses the ConfigDict itself."""
    c = get_base_config().sampler
    spec = SamplerSpec.from_config(c)
    assert (spec.batching, spec.max_slots, spec.engine.park_rows, spec.mesh_data, spec.mesh_tensor, spec.backend) == (
        c.batching, c.max_slots, c.park_rows, c.mesh.data, c.mesh.tensor, c.backend)
    # Not the supervisor's: stop_token_ids and temperature go with each generate call (the trainer's rollouts).
    from pdm_jax.sampler.spec import EngineSpec

    assert {f.name for f in dataclasses.fields(SamplerSpec)} | {f.name for f in EngineSpec.config_fields()} >= {
        k for k in c.keys() if k not in ("mesh", "per_host_rollouts", "stop_token_ids", "temperature")}
    with pytest.raises(AttributeError, match="park_rows"):
        SamplerSpec.from_config(types.SimpleNamespace(**{k: v for k, v in c.items() if k != "park_rows"}))
    with pytest.raises(TypeError, match="takes a SamplerSpec"):
        SamplerSupervisor(c, workdir=str(tmp_path), model_config=None, max_new_tokens=8)


def test_probe_settings_are_checked_on_a_replaced_spec():
    spec = SamplerSpec.from_config(get_base_config().sampler)
    for field, value in (("stall_probe_interval_s", 0.0), ("stall_probe_timeout_s", -1.0),
                         ("stall_probe_misses", -1), ("stall_probe_misses", True), ("stall_probe_misses", 1.5)):
        with pytest.raises(ValueError, match="SamplerSpec: need stall_probe_interval_s > 0"):
            dataclasses.replace(spec, **{field: value})
    assert dataclasses.replace(spec, stall_probe_misses=0).stall_probe_misses == 0


def test_the_engine_spec_takes_the_sampler_sections_engine_fields_by_name():
    """`SamplerSpec.engine_spec`: every `EngineSpec` flag field the sampler section names, by name (max_slots 0 ->
    None: as max_batch_size), the run's max_new_tokens, and changes."""
    from pdm_jax.sampler.spec import EngineSpec

    base = SamplerSpec.from_config(get_base_config().sampler)
    spec = dataclasses.replace(base, max_slots=0, quantization="int8", mesh_tensor=2,
                               engine=dataclasses.replace(base.engine, park_rows=0))
    engine = spec.engine_spec(max_new_tokens=48)
    shared = [f.name for f in EngineSpec.flag_fields() if hasattr(spec, f.name)]
    assert len(shared) >= 10 and "park_rows" not in shared and engine.park_rows == 0
    assert all(getattr(engine, name) == getattr(spec, name) for name in shared if name != "max_slots")
    assert (engine.max_slots, engine.max_new_tokens, engine.quantization) == (None, 48, "int8")
    assert spec.engine_spec(max_new_tokens=8, weight_noise=0.0).weight_noise == 0.0
    with pytest.raises(ValueError, match="EngineSpec: park_rows must be an integer >= 0, got -1"):
        spec.engine_spec(max_new_tokens=8, park_rows=-1)
