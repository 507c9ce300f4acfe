"""The number_between task (pdm_jax.data.number_between): items, scoring and the testbed config."""
import os

import pytest

from pdm_jax.data import number_between as nb
from pdm_jax.data.tasks import ReasoningGymSource

REPO = os.path.join(os.path.dirname(__file__), "..")
TASK_CONFIG = dict(min_value=0, max_value=9999, min_width=5, max_width=50)


def test_items_are_deterministic_and_their_reference_answer_is_inside():
    """Item i of seed s: bounds within [min_value, max_value], width within [min_width, max_width], the reference
    answer strictly inside and scored 1; the same item for the same (seed, index); widths and answers spread."""
    ds = nb.NumberBetweenDataset(nb.NumberBetweenConfig(seed=3, **TASK_CONFIG))
    widths, offsets = set(), set()
    for i in range(400):
        e = ds[i]
        lo, hi = e["metadata"]["lo"], e["metadata"]["hi"]
        assert 0 <= lo < hi <= 9999 and 5 <= hi - lo <= 50 and e["question"] == f"{lo}<x<{hi}="
        assert lo < int(e["answer"]) < hi and ds.score_answer(e["answer"], e) == 1.0
        widths.add(hi - lo)
        offsets.add(int(e["answer"]) - lo)
    assert ds[17] == nb.NumberBetweenDataset(nb.NumberBetweenConfig(seed=3, **TASK_CONFIG))[17]
    assert len(widths) > 40 and len(offsets) > 40


def test_every_integer_strictly_inside_scores_one_and_nothing_else_does():
    entry = {"question": "100<x<104=", "answer": "101", "metadata": {"lo": 100, "hi": 104}}
    ds = nb.NumberBetweenDataset(nb.NumberBetweenConfig(seed=0))
    assert [ds.score_answer(str(x), entry) for x in range(98, 107)] == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert ds.score_answer(" 102\n", entry) == 1.0
    for bad in ("102.0", "+102", "1.02e2", "", "102a", "10 2", "-", None, 102):
        assert ds.score_answer(bad, entry) == 0.0, bad
    negative = {"metadata": {"lo": -5, "hi": -2}}
    assert ds.score_answer("-3", negative) == 1.0 and ds.score_answer("3", negative) == 0.0
    assert ds.score_answer("0102", entry) == 1.0 and ds.score_answer("00102", entry) == 0.0  # longer than a bound + 1
    assert ds.score_answer("1" * 5000, entry) == 0.0  # never handed to int() (which refuses > 4,300 digits)


def test_registering_from_many_threads_at_once_registers_once():
    import threading

    from reasoning_gym.factory import DATASETS

    for _ in range(20):
        DATASETS.pop(nb.NAME, None)
        errors = []

        def go():
            try:
                nb.register()
            except Exception as e:  # noqa: BLE001 - any error is the failure
                errors.append(e)

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and nb.NAME in DATASETS


@pytest.mark.parametrize("changes, match", [(dict(min_width=1), "min_width must be >= 2"),
                                            (dict(min_width=10, max_width=5), "max_width must be >= min_width"),
                                            (dict(max_value=30), "max_value must be >= min_value \\+ max_width"),
                                            (dict(min_value=1.5), "min_value must be an integer"),
                                            (dict(max_width=True), "max_width must be an integer")])
def test_bad_settings_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        ReasoningGymSource("number_between", {**TASK_CONFIG, **changes}, prompt_format="question", num_eval=8,
                           chat=False)


def test_served_as_a_reasoning_gym_task_with_held_out_prompts():
    """ReasoningGymSource registers and serves it: held-out prompts never in the training stream, completions
    scored by the interval (the reference and any other inside number 1, a bound 0), garbage 0 without raising."""
    source = ReasoningGymSource("number_between", TASK_CONFIG, prompt_format="question", num_eval=64, chat=False)
    held_out = {e.prompt for e in source.eval_examples()}
    assert len(held_out) == 64
    train = source.train_batch(0, 256)
    assert not held_out & {e.prompt for e in train}
    e = train[0]
    lo, hi = e.meta["rg_metadata"]["lo"], e.meta["rg_metadata"]["hi"]
    assert source.score(source.sft_target(e), e) == 1.0 and source.score(str(hi - 1), e) == 1.0
    assert source.score(str(lo), e) == 0.0 and source.score(str(hi), e) == 0.0
    assert source.score("\x00<answer>", e) == 0.0 and source.score_failures == 0


def test_the_testbed_config_validates_and_sets_the_task():
    import runpy

    from pdm_jax.config import validate_config

    get = runpy.run_path(os.path.join(REPO, "configs", "tiny_between.py"))["get_config"]
    c = get("sampler.weight_noise=0.1,delta=0.15")
    validate_config(c)
    assert (c.data.task, c.data.prompt_format, c.tokenizer.kind, c.sampler.weight_noise) == \
        ("number_between", "question", "bpe", 0.1)
    assert c.trust_region.delta == 0.15
    assert dict(c.data.task_config) == dict(min_value=0, max_value=99999, min_width=10, max_width=400)


def test_every_named_analysis_setting_validates():
    """`python -m pdm_jax.analysis run --setting=NAME`: each setting's config and argument string validate; the
    between setting samples at the loss's temperature from the noised copy."""
    from pdm_jax.analysis.run import SETTINGS
    from pdm_jax.config import load_config_file, validate_config

    for name, (path, arg) in SETTINGS.items():
        c = load_config_file(f"{os.path.join(REPO, path)}:{arg}")
        validate_config(c)
        if name == "between":
            assert c.sampler.temperature is None and c.sampler.weight_noise == 0.45
            assert c.data.task == "number_between" and c.rl.steps == 12
        if name == "between_comparison":  # the comparison's lever (launch/sweeps/between_testbed.py), 9 steps
            assert (c.sampler.temperature, c.sampler.weight_noise, c.rl.max_staleness) == (1.15, 0.0, 8)
            assert (c.rl.num_iterations, c.rl.learning_rate, c.rl.steps) == (4, 3e-4, 9)
            assert (c.trust_region.delta, c.trust_region.estimator) == (0.05, "aggregated_tail")
