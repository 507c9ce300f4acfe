"""`pdm_jax.rewards`: the user's reward functions from ``reward.functions`` (TRL's ``reward_funcs`` convention).

The weighted sum with None at hand-computed values (an all-None row gets its group's mean, so its advantage is 0),
the named errors of a function that raises, hangs, or returns the wrong length, a non-number or NaN, the columns
a function receives, the built-in verifier as a function, the config's checks, and (slow) the worked example of
examples/own_task trained through config alone, and a raising function stopping a run with exit 2."""

import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from pdm_jax import evaluation, rewards
from pdm_jax.config import get_base_config, load_config_file, validate_config
from pdm_jax.rewards import RewardFunctionError, RewardFunctions, RewardSpec
from pdm_jax.rl import objectives
from pdm_jax.rollout import build_batch

from conftest import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP = 9

FUNCTIONS = '''
import time

def one(prompts, completions, **kw):
    return [1.0] * len(completions)

def boom(prompts, completions, **kw):
    raise KeyError("no such column")

def short(prompts, completions, **kw):
    return [1.0] * (len(completions) - 1)

def text(prompts, completions, **kw):
    return [0.0, "1.0"] + [0.0] * (len(completions) - 2)

def flag(prompts, completions, **kw):
    return [True] * len(completions)

def nan(prompts, completions, **kw):
    return [0.0, 0.0, float("nan")] + [0.0] * (len(completions) - 3)

def scalar(prompts, completions, **kw):
    return 1.0

def hang(prompts, completions, **kw):
    time.sleep(30)

SEEN = []

def record(prompts, completions, **columns):
    SEEN.append(dict(prompts=prompts, completions=completions, **columns))
    return [None if c == "" else float(len(c)) for c in completions]
'''


@pytest.fixture
def fn_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return str(path)


def _functions(fn_file, names, weights=None, timeout_s=5.0, source=None):
    entries = tuple(n if ":" in n else f"{fn_file}:{n}" for n in names)
    return RewardFunctions(RewardSpec(entries, tuple(weights or (1.0,) * len(entries)), timeout_s), source)


def _call(functions, n=2, prompts=("1", "1", "2", "2")):
    count = len(prompts)
    exs = [types.SimpleNamespace(prompt=p, answer=p, meta={}) for p in prompts]
    columns = dict(answer=list(prompts), completion_ids=[[1]] * count, truncated=[False] * count)
    return functions(list(prompts), ["7"] * count, columns, exs, n)


# ---- the weighted sum --------------------------------------------------------------------------------------------

def test_weighted_sum_with_none_at_hand_computed_values():
    nan = np.nan
    # two prompts of n = 3; f1 scores row 0 only, f2 rows 0-1; rows 2-5 get no number from either
    scores = np.array([[1.0, nan, nan, nan, nan, nan],
                       [0.5, 1.0, nan, nan, nan, nan]])
    got, unscored = rewards.combine(scores, (1.0, 0.5), 3)
    # row 0: 1 * 1 + 0.5 * 0.5; row 1: f1 adds nothing, 0.5 * 1; row 2: the mean of its group's scored rows
    # (1.25 + 0.5) / 2; rows 3-5: a group with no scored row -> 0
    np.testing.assert_allclose(got, [1.25, 0.5, 0.875, 0.0, 0.0, 0.0])
    assert got.dtype == np.float32 and unscored.tolist() == [False, False, True, True, True, True]
    for normalize_std in (False, True):  # the unscored row neither pulls nor pushes: advantage exactly 0
        adv = np.asarray(objectives.group_advantages(got, 3, normalize_std=normalize_std))
        assert adv[2] == 0.0 and np.all(adv[3:] == 0.0)
    # and leaves its group's mean as the scored rows give it
    assert got[:3].mean() == pytest.approx((1.25 + 0.5) / 2)


def test_function_record_means_over_the_rows_each_function_scored():
    rows = {"rewards": np.zeros(4), "reward/a": np.array([1.0, np.nan, 0.0, 0.5], np.float32),
            "reward/b": np.full(4, np.nan, np.float32), "reward_unscored": np.array([0, 1, 0, 1], np.float32)}
    rec = rewards.function_record(rows)
    assert rec["reward/a"] == pytest.approx(0.5) and np.isnan(rec["reward/b"]) and rec["reward_unscored"] == 2.0
    assert rewards.function_record({"rewards": np.zeros(4)}) == {}  # no functions: nothing added


def test_functions_combine_and_log_per_function_values(fn_file):
    functions = _functions(fn_file, ["one", "record"], weights=(2.0, -0.5))
    exs = [types.SimpleNamespace(prompt=p, answer="x", meta={}) for p in "ab"]
    columns = dict(answer=["x", "x"], completion_ids=[[1, 2], []], truncated=[True, False])
    got, rows = functions(["a", "b"], ["12", ""], columns, exs, 2)
    np.testing.assert_allclose(got, [2.0 - 0.5 * 2, 2.0])  # "" -> None from record: only one's 2 * 1
    np.testing.assert_allclose(rows["reward/one"], [1.0, 1.0])
    assert rows["reward/record"][0] == 2.0 and np.isnan(rows["reward/record"][1])
    assert rows["reward_unscored"].tolist() == [0.0, 0.0]


# ---- named errors -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, needle", [
    ("boom", r"reward function 'boom' raised KeyError: 'no such column'"),
    ("short", r"reward function 'short' returned 3 values for 4 completions"),
    ("text", r"reward function 'text' returned '1.0' \(str\) for row 1 \(prompt 0, sample 1: '1'\): not a number"),
    ("flag", r"reward function 'flag' returned True \(bool\) for row 0 .*not a number"),
    ("nan", r"reward function 'nan' returned nan for row 2 \(prompt 1, sample 0: '2'\): not a finite number"),
    ("scalar", r"reward function 'scalar' returned float 1.0, not a list of 4 numbers or None"),
])
def test_a_bad_function_is_a_named_error(fn_file, name, needle):
    with pytest.raises(RewardFunctionError, match=needle) as err:
        _call(_functions(fn_file, ["one", name]))
    assert isinstance(err.value, ValueError)  # pdm_jax.train: exit 2, no traceback


def test_a_hanging_function_is_stopped_by_the_timeout(fn_file):
    import time
    t0 = time.time()
    with pytest.raises(RewardFunctionError, match=r"'hang' did not return within reward.timeout_s = 0.3 s"):
        _call(_functions(fn_file, ["hang"], timeout_s=0.3))
    assert time.time() - t0 < 5


def test_functions_that_cannot_be_loaded_are_named(fn_file, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"no such file"):
        _functions(fn_file, [f"{tmp_path / 'absent.py'}:f"])
    with pytest.raises(RewardFunctionError, match=r"has no function 'absent'"):
        _functions(fn_file, ["absent"])
    with pytest.raises(RewardFunctionError, match=r"cannot import 'no_such_module_xyz'"):
        _functions(fn_file, ["no_such_module_xyz:f"])


# ---- what a function receives -------------------------------------------------------------------------------------

class _Codec:
    stop_ids = (STOP,)

    def decode_completion(self, ids, mask):
        return "".join(str(int(t)) for t, m in zip(ids, mask) if m and int(t) not in self.stop_ids)


def _rollouts(rows):
    ids = [[int(c) for c in text] + ([STOP] if finish == "stop" else []) for text, finish in rows]
    t = max(map(len, ids))
    completion = np.array([x + [0] * (t - len(x)) for x in ids], np.int32)
    return build_batch([[1], [2]], group_ids=np.repeat(np.arange(2), 2), lengths=[len(x) for x in ids],
                       completion_ids=completion, behavior_logprobs=np.zeros(completion.shape, np.float32),
                       topk_ids=np.zeros(completion.shape + (1,), np.int32),
                       topk_logprobs=np.zeros(completion.shape + (1,), np.float32), weights_version=0,
                       finish_reason=[finish for _, finish in rows])


def test_the_columns_and_the_rollouts_reach_the_function_and_the_evaluation_uses_them(fn_file):
    functions = _functions(fn_file, ["record"])
    seen_calls = functions.functions[0].__globals__["SEEN"]
    exs = [types.SimpleNamespace(prompt=p, answer=a, uid=p, meta=dict(columns=dict(answer=a, level=lv)))
           for p, a, lv in (("3-1=", "2", "plain"), ("5-3=", "2", "carry"))]
    source = rewards.RewardedSource(types.SimpleNamespace(name="file"), functions)
    rb = _rollouts([("12", "stop"), ("", "stop"), ("4", "length"), ("0", "stop")])
    got, rows = rewards.score_rollouts(source, _Codec(), rb, exs, 2)
    seen = seen_calls[-1]
    assert seen["prompts"] == ["3-1=", "3-1=", "5-3=", "5-3="]
    assert seen["completions"] == ["12", "", "4", "0"]
    assert seen["answer"] == ["2", "2", "2", "2"] and seen["level"] == ["plain", "plain", "carry", "carry"]
    assert seen["completion_ids"] == [[1, 2], [], [4], [0]]  # valid tokens, stop token excluded
    assert seen["truncated"] == [False, False, True, False]
    # row 1: None from the one function -> its group's scored mean (2.0)
    np.testing.assert_allclose(got, [2.0, 2.0, 1.0, 1.0])
    assert rows["reward_unscored"].tolist() == [0.0, 1.0, 0.0, 0.0]
    np.testing.assert_allclose(evaluation.score_rollouts(source, _Codec(), rb, exs, 2), got)


def test_the_values_of_rows_kept_from_scored_rounds_are_found_again(fn_file):
    """Dynamic sampling trains on rows it selected from the rounds it scored: `function_rows` gives them the values
    their round gave (none recomputed), and refuses a row no round scored."""
    functions = _functions(fn_file, ["one", "record"])
    exs = [types.SimpleNamespace(prompt=p, answer="0", uid=f"file/train/{i}", meta={}) for i, p in enumerate("ab")]
    source = rewards.RewardedSource(types.SimpleNamespace(name="file"), functions)
    rb = _rollouts([("12", "stop"), ("", "stop"), ("4", "length"), ("0", "stop")])
    _, rows = rewards.score_rollouts(source, _Codec(), rb, exs, 2)
    kept = rb.select(np.array([2, 3]))  # the second group alone, as group 0 of the trained batch
    got = rewards.function_rows(source, _Codec(), kept, exs[1:], 2)
    assert sorted(got) == sorted(rows)
    for key in rows:
        np.testing.assert_array_equal(got[key], rows[key][2:])
    with pytest.raises(RuntimeError, match=r"row 0 of the batch \(file/train/0\) was not scored"):
        rewards.function_rows(source, _Codec(), rb.select(np.array([2, 3])), exs[:1], 2)
    assert rewards.function_rows(types.SimpleNamespace(), _Codec(), rb, exs, 2) == {}


def test_the_builtin_verifier_as_a_function(fn_file):
    class Source:
        def score(self, completion, example, truncated=False):
            return 0.0 if truncated else float(completion == example.answer)

    functions = _functions(fn_file, ["pdm_jax.rewards:verifier", "one"], weights=(1.0, 0.25), source=Source())
    exs = [types.SimpleNamespace(prompt="q", answer="7", meta={})] * 2
    columns = dict(answer=["7", "7"], completion_ids=[[7], [7]], truncated=[False, True])
    got, rows = functions(["q", "q"], ["7", "7"], columns, exs, 2)
    np.testing.assert_allclose(got, [1.25, 0.25])
    np.testing.assert_allclose(rows["reward/verifier"], [1.0, 0.0])
    with pytest.raises(RewardFunctionError, match="name it in reward.functions"):
        rewards.verifier(["q"], ["7"])


# ---- the config ---------------------------------------------------------------------------------------------------

def test_no_functions_keep_the_source_and_its_verifier():
    spec = RewardSpec.from_config(get_base_config().reward)
    assert spec == RewardSpec((), (), 300.0)
    source = object()
    assert rewards.with_reward_functions(source, spec) is source


@pytest.mark.parametrize("fields, needle", [
    (dict(functions="a.py:f,b.py:f"), r"reward.functions = 'a.py:f,b.py:f': the name 'f' is given twice"),
    (dict(functions="a.py"), r"reward.functions = 'a.py': entry 'a.py' is not FILE.py:NAME"),
    (dict(functions="a.py:f", weights="1,2"), r"reward.weights = '1,2': 2 weights for the 1 reward.functions"),
    (dict(functions="a.py:f", weights="x"), r"reward.weights = 'x': 'x' is not a number"),
    (dict(timeout_s=0.0), r"reward.timeout_s = 0.0: must be a finite number of seconds > 0"),
])
def test_bad_reward_fields_name_the_field(fields, needle):
    c = get_base_config()
    for key, value in fields.items():
        c.reward[key] = value
    with pytest.raises(ValueError, match=needle):
        validate_config(c)


def test_a_file_source_without_an_answer_needs_functions_and_no_warm_start(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1="}\n')
    c = get_base_config()
    c.data.kind, c.data.path, c.sft.steps = "file", str(path), 10
    with pytest.raises(ValueError) as err:
        validate_config(c)
    assert "reward.functions = '': data.kind = 'file' without data.answer_field" in str(err.value)
    assert "sft.steps = 10: the warm start needs a reference answer" in str(err.value)
    c.reward.functions, c.sft.steps = "pdm_jax.rewards:verifier", 0
    with pytest.raises(ValueError, match="pdm_jax.rewards:verifier needs data.answer_field"):
        validate_config(c)


# ---- the worked example, end to end (slow) --------------------------------------------------------------------------

SMALL = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_hidden_layers=1",
         "--config.model.num_attention_heads=2", "--config.model.num_key_value_heads=1", "--config.model.head_dim=16",
         "--config.sft.steps=10", "--config.rl.steps=3", "--config.rl.prompts_per_step=4", "--config.rl.group_size=4",
         "--config.eval.num_prompts=4", "--config.eval.samples_per_prompt=2", "--config.eval.every_steps=100",
         "--config.log.progress=False", "--config.log.tensorboard=False", "--config.sampler.mode=in_process"]


def _run_example(workdir, args):
    cmd = [sys.executable, "-m", "pdm_jax.train", "--config=examples/own_task/config.py", f"--workdir={workdir}"]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    return subprocess.run(cmd + SMALL + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_own_task_example_trains_through_config_alone_and_a_raising_function_stops_it(tmp_path):
    cache = [f"--config.compile_cache.dir={tmp_path / 'jax_cache'}"]
    r = _run_example(tmp_path / "run", cache)
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if line.strip()]
    rl = [rec for rec in records if rec["phase"] == "rl"]
    assert [rec["step"] for rec in rl] == [1, 2, 3]
    for rec in rl:  # reward = exact + 0.5 * close over the rows; close is None where no integer leads
        assert 0.0 <= rec["reward/exact"] <= 1.0 and rec["reward_unscored"] >= 0
        assert rec["reward/close"] is None or 0.0 <= rec["reward/close"] <= 1.0
        assert 0.0 <= rec["reward"] <= 1.5
    assert "eval_reward" in [rec for rec in records if rec["phase"] == "eval"][-1]
    config = load_config_file("examples/own_task/config.py")
    assert config.data.kind == "file" and config.reward.functions.endswith("reward.py:close")

    # dynamic sampling trains on rows its rounds scored: their function values are logged as those rounds gave them
    r = _run_example(tmp_path / "dynamic", cache + ["--config.sft.steps=0", "--config.rl.steps=1",
                                                   "--config.rl.dynamic_sampling=True"])
    assert r.returncode == 0, r.stderr[-4000:]
    rec = next(json.loads(line) for line in open(tmp_path / "dynamic" / "metrics.jsonl") if '"rl"' in line)
    assert 0.0 <= rec["reward/exact"] <= 1.0 and "dynamic_sampling_rounds" in rec

    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        def bad(prompts, completions, **columns):
            return [float("nan")] * len(completions)
    """))
    # with dynamic sampling, whose rounds score the rollouts on the producer's side
    r = _run_example(tmp_path / "bad_run", cache + [f"--config.reward.functions={bad}:bad", "--config.reward.weights=",
                                                   "--config.sft.steps=0", "--config.rl.steps=1",
                                                   "--config.rl.dynamic_sampling=True"])
    assert r.returncode == 2, r.stderr[-4000:]
    assert "reward function 'bad' returned nan for row 0 (prompt 0, sample 0:" in r.stderr
    assert "Traceback" not in r.stderr
