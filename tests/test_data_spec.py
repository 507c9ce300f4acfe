"""pdm_jax.data.spec: `DataSpec`, the run config's ``data`` section read once (no fallbacks), is what
`make_source` takes."""
import dataclasses
import types

import ml_collections
import pytest

from pdm_jax.config import get_base_config
from pdm_jax.data import DataSpec, make_source


def test_from_config_reads_every_schema_field():
    c = get_base_config().data
    spec = DataSpec.from_config(c)
    assert {f.name for f in dataclasses.fields(DataSpec)} >= set(c.keys())
    for name in c.keys():
        want = c[name].to_dict() if isinstance(c[name], ml_collections.ConfigDict) else c[name]
        assert getattr(spec, name) == want, name
    # the fields outside the run config keep their own defaults
    assert (spec.train_size, spec.instruction, spec.verify_timeout_s, spec.chat) == (1 << 20, "", 5.0, None)
    with pytest.raises(AttributeError, match="num_eval"):
        DataSpec.from_config(types.SimpleNamespace(**{k: v for k, v in c.items() if k != "num_eval"}))


def test_make_source_takes_the_spec_not_the_config_section():
    c = get_base_config().data
    with pytest.raises(TypeError, match="takes a DataSpec"):
        make_source(c)
    spec = dataclasses.replace(DataSpec.from_config(c), num_eval=5, seed=3)
    source = make_source(spec)
    assert len(source.eval_examples()) == 5 and source.chat is False  # compact chain_sum prompts stay raw text
    assert make_source(dataclasses.replace(spec, chat_template="on")).chat is True
    with pytest.raises(ValueError, match=r"data\.task_config must be a dict"):
        make_source(dataclasses.replace(spec, task_config=[1, 2]))
