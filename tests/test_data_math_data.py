"""`pdm_jax.data.math_data.MathSource`: the local math datasets (GSM8K and DAPO-Math-17k schemas, JSONL and
Parquet), their held-out split, instruction and the fields a bad config names."""

import pytest

from pdm_jax.data import PromptSource, make_source
from conftest import FIXTURES, math_source_config


def test_gsm8k_jsonl_source():
    source = make_source(math_source_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl")))
    assert isinstance(source, PromptSource) and source.chat is True
    eval_examples = source.eval_examples()
    assert len(eval_examples) == 2 and source.num_train == 4
    train = source.train_batch(0, 12)  # three passes over the 4 training rows
    eval_prompts = {e.prompt for e in eval_examples}
    assert not eval_prompts.intersection(e.prompt for e in train)
    assert sorted(e.uid for e in train[:4]) == sorted(e.uid for e in train[4:8])  # each pass = all rows
    assert [e.uid for e in train[:4]] != [e.uid for e in train[4:8]] or [e.uid for e in train[4:8]] != [
        e.uid for e in train[8:12]]  # re-shuffled per epoch
    assert source.train_batch(5, 3) == make_source(
        math_source_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"))).train_batch(5, 3)
    by_question = {e.prompt: e for e in train + eval_examples}
    marbles = by_question["Tom has 3 boxes with 250 marbles each and buys 2 more such boxes. "
                          "How many marbles does he have?"]
    assert marbles.answer == "1250"  # "#### 1,250" with the comma removed
    target = source.sft_target(marbles)
    assert target == "He has 3+2=5 boxes.\n5*250=1250 marbles.\n#### 1250"  # no <<...>> annotations
    assert source.score(target, marbles) == 1.0
    assert source.score("The answer is \\boxed{1250}.", marbles) == 1.0
    assert source.score("#### 1,250", marbles) == 1.0
    assert source.score("#### 1251", marbles) == 0.0
    assert source.score("", marbles) == 0.0


def test_gsm8k_separate_eval_file_drops_overlap():
    source = make_source(math_source_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"),
                                      eval_path=str(FIXTURES / "gsm8k_tiny_eval.jsonl"), num_eval=3))
    eval_prompts = {e.prompt for e in source.eval_examples()}
    assert len(eval_prompts) == 3
    assert source.num_train == 4  # 6 rows minus the 2 that also appear in the eval file
    assert not eval_prompts.intersection(e.prompt for e in source.train_batch(0, 8))


@pytest.mark.parametrize("filename", ["dapo_math_tiny.jsonl", "dapo_math_tiny.parquet"])
def test_dapo_source_jsonl_and_parquet(filename):
    source = make_source(math_source_config(kind="dapo_math", path=str(FIXTURES / filename),
                                      instruction=""))
    assert source.chat is True
    # 7 rows, one a repeated problem: de-duplicated to 6 = 2 eval + 4 train.
    assert len(source.eval_examples()) == 2 and source.num_train == 4
    examples = source.train_batch(0, 4) + source.eval_examples()
    assert len({e.prompt for e in examples}) == 6
    half = next(e for e in examples if "one half of one" in e.prompt)
    assert half.answer == "\\frac{1}{2}" and half.uid.endswith("/id-0000")
    assert half.prompt.startswith("Solve the following math problem")
    assert half.meta["messages"][0]["role"] == "user" and half.meta["data_source"] == "math_dapo"
    assert source.score("Half of one is 0.5.\nAnswer: 0.5", half) == 1.0
    assert source.score("Answer: 1/2", half) == 1.0
    assert source.score("Answer: 2", half) == 0.0
    assert source.score(source.sft_target(half), half) == 1.0


def test_jsonl_and_parquet_give_the_same_split():
    a = make_source(math_source_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.jsonl")))
    b = make_source(math_source_config(kind="dapo_math", path=str(FIXTURES / "dapo_math_tiny.parquet")))
    assert a.eval_examples() == b.eval_examples()
    assert a.train_batch(0, 6) == b.train_batch(0, 6)


def test_math_instruction_is_appended():
    source = make_source(math_source_config(kind="gsm8k", path=str(FIXTURES / "gsm8k_tiny.jsonl"),
                                      instruction="Put the final answer in \\boxed{}."))
    assert all(e.prompt.endswith("\n\nPut the final answer in \\boxed{}.") for e in source.eval_examples())


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"kind": "gsm8k"}, "data.path"),
        ({"kind": "gsm8k", "path": "/no/such/file.jsonl"}, "data.path"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "dapo_math_tiny.jsonl")}, "data.path"),  # wrong schema
        ({"kind": "dapo_math", "path": str(FIXTURES / "gsm8k_tiny.jsonl")}, "data.path"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "num_eval": 6}, "data.num_eval"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "prompt_format": "compact"},
         "data.prompt_format"),
        ({"kind": "gsm8k", "path": str(FIXTURES / "gsm8k_tiny.jsonl"), "eval_path": "/nope.parquet"},
         "data.eval_path"),
        ({"kind": "gsm8k", "path": str(FIXTURES)}, "data.path"),  # a directory
    ],
)
def test_math_bad_config_names_field(fields, field):
    with pytest.raises(ValueError, match=field):
        make_source(math_source_config(**fields))


def test_num_eval_holds_out_at_most_half_of_the_file(caplog):
    """Without data.eval_path at most half of data.path's distinct rows are held out: the 6-row file takes 3 and
    trains on 3 (logged), 4 is refused naming both counts and the two ways on (a smaller num_eval, an eval file)."""
    path = str(FIXTURES / "gsm8k_tiny.jsonl")
    with caplog.at_level("INFO", logger="pdm_jax.data.math_data"):
        source = make_source(math_source_config(kind="gsm8k", path=path, num_eval=3))
    assert len(source.eval_examples()) == 3 and source.num_train == 3
    assert "gsm8k: 3 distinct rows of data.path for training, 3 held out (data.num_eval) from data.path" in caplog.text
    with pytest.raises(ValueError, match=r"data.num_eval = 4 would hold out 4 of the 6 distinct rows of data.path "
                                         r".* and leave 2 for training: at most half may be held out "
                                         r"\(data.num_eval <= 3\), or .* data.eval_path"):
        make_source(math_source_config(kind="gsm8k", path=path, num_eval=4))
    with pytest.raises(ValueError, match=r"data.num_eval = 256 would hold out 6 of the 6 .* leave 0 for training"):
        make_source(math_source_config(kind="gsm8k", path=path, num_eval=256))  # the schema's default
    # with a separate held-out file the training file is not split: its 3 rows are held out, 4 train
    source = make_source(math_source_config(kind="gsm8k", path=path, num_eval=3,
                                            eval_path=str(FIXTURES / "gsm8k_tiny_eval.jsonl")))
    assert len(source.eval_examples()) == 3 and source.num_train == 4


def test_a_gsm8k_file_with_the_tiny_config_meets_named_errors_only(tmp_path):
    """The tiny config pointed at a GSM8K file (data.kind, data.path, a small num_eval): the prompt format follows
    the kind (no data.prompt_format needed), and each missing setting is an error naming the field, the value and
    what to do, before any compile: the character tokenizer has no chat template (data.chat_template), then cannot
    encode the text (the characters it lacks, tokenizer.kind)."""
    from pdm_jax.config import validate_config
    from pdm_jax.data import DataSpec
    from pdm_jax.trainer import Trainer
    from test_trainer import tiny_test_config

    fields = {"data.kind": "gsm8k", "data.path": str(FIXTURES / "gsm8k_tiny.jsonl"), "data.num_eval": 2,
              "eval.num_prompts": 2}
    c = tiny_test_config(**fields)
    assert c.data.prompt_format == "auto" and DataSpec.from_config(c.data).prompt_format == "question"
    with pytest.raises(ValueError, match=r"^data.chat_template = 'auto': data.kind = 'gsm8k' formats each prompt "
                                         r"with the tokenizer's chat template, and the tokenizer \(tokenizer.kind = "
                                         r"'char'\) has none: set data.chat_template=off .*tokenizer.kind=path"):
        Trainer(c, str(tmp_path / "a"))
    c = tiny_test_config(**fields, **{"data.chat_template": "off"})
    with pytest.raises(ValueError, match=r"cannot encode the prompt .*Missing \[UNK\].*lacks the characters "
                                         r"' \.\?HTabcdehilmnorstuvwxy'.*tokenizer.kind=char.*tokenizer.kind=bpe"):
        Trainer(c, str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"data.prompt_format = 'compact': data.kind = 'gsm8k' has question prompts "
                                         r"only: set data.prompt_format=auto"):
        validate_config(tiny_test_config(**fields, **{"data.prompt_format": "compact"}))
    base = tiny_test_config()  # the default task keeps its compact prompts
    assert DataSpec.from_config(base.data).prompt_format == "compact"
