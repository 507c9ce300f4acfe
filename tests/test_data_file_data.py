"""``data.kind = "file"`` (`pdm_jax.data.file_data`): the user's own prompts from a json / jsonl / parquet file or a
``save_to_disk`` directory, with their other columns kept for the reward functions, chat-message prompts, the
held-out split, and each bad file a named error (missing field, empty file, reserved column); over-long prompts
are dropped and counted by `filter_long_prompts`."""

import dataclasses
import json

import pytest

from pdm_jax.config import get_base_config
from pdm_jax.data import DataSpec, FileSource, filter_long_prompts, make_source
from pdm_jax.text import TextCodec

ROWS = [dict(question=f"{a}+{a}=", solution=str(2 * a), level=a % 3) for a in range(20)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _spec(path, **fields):
    base = DataSpec.from_config(get_base_config().data)
    fields = dict(dict(kind="file", path=str(path), prompt_field="question", answer_field="solution", num_eval=4),
                  **fields)
    return dataclasses.replace(base, **fields)


def test_a_jsonl_file_gives_prompts_answers_and_its_other_columns(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ROWS + [dict(ROWS[0], level=9)])  # a repeated prompt is kept once
    source = make_source(_spec(path, chat_template="off"))
    assert isinstance(source, FileSource) and source.chat is False
    evals = source.eval_examples()
    train = [source.train_example(i) for i in range(source.num_train)]
    assert len(evals) == 4 and source.num_train == 16
    assert {e.prompt for e in evals}.isdisjoint({e.prompt for e in train})  # held out by prompt content
    assert sorted(e.prompt for e in evals + train) == sorted(r["question"] for r in ROWS)
    by_prompt = {r["question"]: r for r in ROWS}
    for e in evals + train:
        row = by_prompt[e.prompt]
        assert e.answer == row["solution"] and source.sft_target(e) == row["solution"]
        assert e.meta["columns"] == dict(solution=row["solution"], level=row["level"])  # every other column
    assert source.score(train[0].answer, train[0]) == 0.0  # the math verifier wants a final-answer line
    assert source.score(f"Answer: {train[0].answer}", train[0]) == 1.0


def test_parquet_and_a_save_to_disk_directory_read_the_same_rows(tmp_path):
    import datasets
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.to_parquet(str(tmp_path / "p.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    jsonl = make_source(_spec(_jsonl(tmp_path / "p.jsonl", ROWS), chat_template="off"))
    for path in (tmp_path / "p.parquet", tmp_path / "saved"):
        other = make_source(_spec(path, chat_template="off"))
        assert other.eval_examples() == jsonl.eval_examples()
        assert other.train_batch(0, 16) == jsonl.train_batch(0, 16)
    datasets.DatasetDict(train=dataset).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"data.path: .* holds a DatasetDict with splits \['train'\]"):
        make_source(_spec(tmp_path / "dict"))


class _ChatTokenizer:
    """Records the messages its chat template renders; one id per character."""
    eos_token_id = 0

    def __init__(self):
        self.rendered = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        self.rendered.append(messages)
        return [ord(c) for m in messages for c in m["content"]]


def test_chat_message_prompts_are_rendered_whole_by_the_chat_template(tmp_path):
    rows = [dict(prompt=[dict(role="system", content="Add."), dict(role="user", content=f"{a}+1")], answer=str(a + 1))
            for a in range(8)]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    source = make_source(dataclasses.replace(_spec(path), prompt_field="prompt", answer_field="answer"))
    assert source.chat is True  # kind=file under "auto": the chat template
    example = source.train_example(0)
    assert example.prompt[0] == dict(role="system", content="Add.") and example.prompt[1]["role"] == "user"
    tokenizer = _ChatTokenizer()
    ids = TextCodec(tokenizer, chat=True).encode_prompt(example.prompt)
    assert tokenizer.rendered[-1] == example.prompt and len(ids) == len("Add.") + len(example.prompt[1]["content"])
    with pytest.raises(ValueError, match=r"data.chat_template = 'off', and data.prompt_field holds chat messages"):
        make_source(dataclasses.replace(_spec(path), prompt_field="prompt", answer_field="answer",
                                        chat_template="off"))


@pytest.mark.parametrize("content, fields, needle", [
    ("", {}, r"data.path: '.*empty.jsonl' is empty \(no rows\)"),
    ('{"q": "1+1=", "solution": "2"}\n', {},
     r"data.prompt_field = 'question': row 0 of data.path '.*' has no such column \(columns: \['q', 'solution'\]\)"),
    ('{"question": "1+1=", "answer": "2"}\n', {},
     r"data.answer_field = 'solution': row 0 of data.path '.*' has no such column"),
    ('{"question": "", "solution": "2"}\n', {}, r"data.prompt_field = 'question': row 0 holds '', not non-empty text"),
    ('{"question": "1+1=", "solution": "2", "completion_ids": [1]}\n', {},
     r"data.path: '.*' has the column 'completion_ids', a name the reward functions take"),
    ('{"question": "1+1=", "solution": "2"}\n', dict(num_eval=1),
     r"data.num_eval = 1 would hold out 1 of the 1 distinct rows of data.path '.*' and leave 0 for training"),
])
def test_a_bad_file_is_a_named_error(tmp_path, content, fields, needle):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        make_source(dataclasses.replace(_spec(path, chat_template="off"), **fields))


def test_prompts_longer_than_the_sampler_accepts_are_dropped_and_counted(tmp_path):
    rows = [dict(question=("9" * (3 + a % 2 * 10)) + "=", solution="1") for a in range(40)]  # half of 4, half of 14
    rows = [dict(r, question=f"{i}:{r['question']}") for i, r in enumerate(rows)]
    source = make_source(_spec(_jsonl(tmp_path / "long.jsonl", rows), chat_template="off", num_eval=10))
    filtered = filter_long_prompts(source, lambda prompt: list(prompt), max_prompt_length=10)
    kept = filtered.eval_examples() + filtered.train_batch(0, 30)
    assert all(len(e.prompt) <= 10 for e in kept)
    long_eval = sum(len(e.prompt) > 10 for e in source.eval_examples())
    assert filtered.num_eval_dropped == long_eval > 0 and filtered.train_scan_dropped > 0
    assert filtered.num_train_dropped > 0  # counted while the stream is read
