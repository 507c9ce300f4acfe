"""The warm start's prompt width (pdm_jax.text.sft_warmstart_batch): sized from each batch, never cut.

The width used to come from a probe of the first 64 examples, so a longer prompt later in the stream
(still within sampler.max_prompt_length) lost its first tokens in SFT while RL saw it whole. With the
character tokenizer one character is one token: a prompt's ids are its characters, the reference here.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from pdm_jax.data import COMPACT_ALPHABET
from pdm_jax.models.tokenizer import build_char_tokenizer
from pdm_jax.text import SFT_PROMPT_MULTIPLE, TextCodec, sft_warmstart_batch


class _Source:
    """Training examples i = 0, 1, ...: "1+2=" except a long prompt at index 70 (the 71st example)."""

    LONG = "12+34+56+78+90="

    def train_batch(self, position, n):
        return [SimpleNamespace(prompt=self.LONG if i == 70 else "1+2=", answer="3")
                for i in range(position, position + n)]

    def sft_target(self, example):
        return example.answer


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return TextCodec(build_char_tokenizer(COMPACT_ALPHABET, tmp_path_factory.mktemp("tok")), chat=False)


def _row_prompt(codec, batch, row):
    ids = np.asarray(batch.prompt_ids[row])[np.asarray(batch.prompt_mask[row]).astype(bool)]
    return codec.tokenizer.decode(ids.tolist())


def test_a_long_prompt_after_the_first_64_examples_is_not_cut(codec):
    source = _Source()
    assert len(codec.encode_prompt(source.LONG)) == 15 and len(codec.encode_prompt("1+2=")) == 4
    early = sft_warmstart_batch(source, codec, 0, 32, completion_len=3)  # examples 0-31: all short
    assert early.prompt_ids.shape == (32, SFT_PROMPT_MULTIPLE) == (32, 8)  # 4 tokens rounded up to 8
    assert _row_prompt(codec, early, 5) == "1+2="
    late = sft_warmstart_batch(source, codec, 2, 32, completion_len=3)  # examples 64-95: index 70 is long
    assert late.prompt_ids.shape == (32, 16)  # 15 tokens rounded up to 16; a 64-example probe gave 8
    assert _row_prompt(codec, late, 70 - 64) == source.LONG  # whole: its opening is kept
    assert _row_prompt(codec, late, 0) == "1+2="
    assert int(np.asarray(late.prompt_mask[0]).sum()) == 4  # left-padded, not stretched
    target = np.asarray(late.completion_ids[6])[np.asarray(late.completion_mask[6])].tolist()
    assert target == codec.tokenizer("3", add_special_tokens=False)["input_ids"] + [codec.eos_id]


def test_an_explicit_width_below_a_prompt_is_refused(codec):
    with pytest.raises(ValueError, match="row 1 has 15 tokens, more than the batch's prompt width 8"):
        codec.sft_batch(["1+2=", _Source.LONG], ["3", "3"], completion_len=3, prompt_len=8)
