"""docs/configuration.md is the generator's output (`pdm_jax.config_reference`), and every field is described.

Regenerate the page after changing `pdm_jax/config.py:get_base_config` (a field, its default or its comment):

    python -m pdm_jax.config_reference --write
"""

from pathlib import Path

from pdm_jax import config_reference

REPO = Path(__file__).resolve().parents[1]


def test_configuration_page_is_the_generated_reference():
    page = (REPO / config_reference.DOC_PATH).read_text()
    assert page == config_reference.render(), (
        "docs/configuration.md differs from the schema: run `python -m pdm_jax.config_reference --write`")


def test_every_config_field_is_documented_once():
    fields = [f.path for section in config_reference.schema() for f in section.fields]
    assert len(fields) == len(set(fields)), "a field is listed twice"
    assert set(fields) == config_reference.leaf_paths(), "the reference misses fields of get_base_config() or adds some"


def test_every_config_field_has_a_description():
    undescribed = [f.path for section in config_reference.schema() for f in section.fields if not f.description.strip()]
    assert undescribed == [], (
        f"fields without a comment in pdm_jax/config.py:get_base_config: {undescribed} (write one above the field "
        f"or after it, then run `python -m pdm_jax.config_reference --write`)")


def test_the_page_shows_the_defaults_of_get_base_config():
    page = (REPO / config_reference.DOC_PATH).read_text()
    assert '| `trust_region.delta` | `0.05` | nats for KL, probability for TV |' in page
    assert '| `sampler.batching` | `"continuous"` |' in page  # read from sampler.defaults, not the source text
    assert '| `sampler.startup_timeout_s` | `180.0` | s |' in page


def test_engine_fields_carry_their_unit_column():
    """`EngineSpec`'s run-config fields state their unit the way the generator reads it, ``(unit: X)``: the unit
    column shows it and the meaning drops it. ``sampler.prefill_chunk``'s description ends "Unit: prompts." (capital,
    no parentheses), so the page shows "—" in its unit column and keeps "Unit: prompts." in the meaning."""
    fields = {f.path: f for section in config_reference.schema() for f in section.fields}
    assert fields["sampler.park_rows"].unit == "x slots"
    assert fields["sampler.prefill_chunk"].unit == "prompts", fields["sampler.prefill_chunk"]
    assert "Unit:" not in fields["sampler.prefill_chunk"].description
