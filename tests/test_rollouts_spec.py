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
    assert (spec.batching, spec.max_slots, spec.park_rows, spec.mesh_data, spec.mesh_tensor, spec.backend) == (
        c.batching, c.max_slots, c.park_rows, c.mesh.data, c.mesh.tensor, c.backend)
    assert {f.name for f in dataclasses.fields(SamplerSpec)} >= {
        k for k in c.keys() if k not in ("mesh", "per_host_rollouts", "stop_token_ids")}
    with pytest.raises(AttributeError, match="park_rows"):
        SamplerSpec.from_config(types.SimpleNamespace(**{k: v for k, v in c.items() if k != "park_rows"}))
    with pytest.raises(TypeError, match="takes a SamplerSpec"):
        SamplerSupervisor(c, workdir=str(tmp_path), model_config=None, max_new_tokens=8)
