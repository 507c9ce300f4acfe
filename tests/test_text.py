"""`pdm_jax.text`: the stop ids a checkpoint's own files name."""

from transformers import GenerationConfig

from pdm_jax.text import checkpoint_stop_ids


class _Tok:
    """The tokenizer attributes `checkpoint_stop_ids` reads (Qwen3's: pad <|endoftext|> is special)."""
    pad_token_id, pad_token = 151643, "<|endoftext|>"
    all_special_tokens = ["<|endoftext|>", "<|im_end|>"]


def test_a_checkpoints_generation_config_and_pad_token_name_its_stop_ids(tmp_path):
    GenerationConfig(eos_token_id=[151645, 151643]).save_pretrained(str(tmp_path / "instruct"))
    assert checkpoint_stop_ids(_Tok(), str(tmp_path / "instruct")) == (151645, 151643)
    GenerationConfig(eos_token_id=151643).save_pretrained(str(tmp_path / "base"))
    assert checkpoint_stop_ids(_Tok(), str(tmp_path / "base")) == (151643,)  # a Base model ends on <|endoftext|>
    (tmp_path / "bare").mkdir()  # no generation_config.json: the pad token still
    assert checkpoint_stop_ids(_Tok(), str(tmp_path / "bare")) == (151643,)
    assert checkpoint_stop_ids(_Tok(), "") == ()  # no checkpoint (random init, char tokenizer): the eos id alone
