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
        if name == "prompt_format":  # "auto": the kind's own, resolved here (reasoning_gym: compact)
            want = {"auto": "compact"}.get(want, want)
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


def test_applies_chat_template_is_what_the_sources_do(tmp_path):
    """The one rule `make_source` and `validate_config` read: "on" / "off" decide; under "auto" an explicit
    DataSpec.chat, else each source's own default (its constructor with chat=None)."""
    from pdm_jax.data import ReasoningGymSource, applies_chat_template
    from pdm_jax.data.math_data import MathSource

    for fmt in ("compact", "question"):
        own = ReasoningGymSource("chain_sum", {}, prompt_format=fmt, num_eval=2, chat=None).chat
        assert applies_chat_template("reasoning_gym", fmt, "auto") is own is (fmt == "question")
    rows = tmp_path / "gsm8k.jsonl"
    rows.write_text("".join(f'{{"question": "{i} + 1?", "answer": "so #### {i + 1}"}}\n' for i in range(4)))
    own = MathSource("gsm8k", path=str(rows), num_eval=2, chat=None).chat
    assert applies_chat_template("gsm8k", "question", "auto") is own is True
    assert applies_chat_template("dapo_math", "question", "auto") is True
    for kind, fmt in (("reasoning_gym", "compact"), ("gsm8k", "question")):
        assert applies_chat_template(kind, fmt, "on") is True and applies_chat_template(kind, fmt, "off") is False
        assert applies_chat_template(kind, fmt, "auto", chat=False) is False
        assert applies_chat_template(kind, fmt, "auto", chat=True) is True
