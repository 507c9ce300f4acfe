"""The sampler's OpenAI-compatible endpoints (`pdm_jax.sampler.openai_api`).

Fast tier: the text, stop-string cut and logprobs of a choice built from a hand-made `RolloutBatch` with a character
tokenizer, whose text is known character by character.  Slow tier: a real ``python -m pdm_jax.sampler.server
--tokenizer=DIR`` subprocess on loopback (random tiny model, bearer token) driven by the official ``openai`` client;
its answers are checked against the native ``/v1/generate`` for the same token ids and seed (whose log mu the
native tests check against a teacher-forced forward).
"""
import json

import httpx
import numpy as np
import pytest

from conftest import TINY_DENSE
from pdm_jax.models.tokenizer import build_char_tokenizer, load_tokenizer
from pdm_jax.rollout import RolloutBatch
from pdm_jax.sampler import openai_api

SYMBOLS = "0123456789+-=:; abcdeimnorstuy"  # 30 symbols + <pad>, <eos>: the tiny model's 32 ids
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TOKEN = "openai-test-token"
MODEL = "tiny"
EOS = 1


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = build_char_tokenizer(SYMBOLS, d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    assert len(load_tokenizer(d)) == TINY_DENSE.vocab_size
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def one_row_batch(ids, logprobs, top_ids, top_lps, reason):
    t = len(ids)
    return RolloutBatch(prompt_ids=np.array([[2, 3]]), prompt_mask=np.ones((1, 2), bool),
                        completion_ids=np.array([ids]), completion_mask=np.ones((1, t), bool),
                        behavior_logprobs=np.array([logprobs], np.float32), topk_ids=np.array([top_ids]),
                        topk_logprobs=np.array([top_lps], np.float32), weights_version=np.array([3]),
                        group_ids=np.array([0]), finish_reason=np.array([reason], dtype=object))


def test_choice_text_stop_string_cut_and_logprobs(tok):
    text = "12;34"
    ids = ids_of(tok, text) + [EOS]
    lps = [-0.5, -1.0, -1.5, -2.0, -2.5, -0.1]
    top_ids = [[i, 4] for i in ids]
    top_lps = [[v, -np.inf] for v in lps]  # the second entry filtered out (top_p): never shown
    batch = one_row_batch(ids, lps, top_ids, top_lps, "stop")
    choice, used = openai_api.completion_choice(tok, batch, 0, index=7, stop_ids=(EOS,), stops=[], k=2)
    assert choice["text"] == text and choice["finish_reason"] == "stop" and choice["index"] == 7 and used == 6
    lp = choice["logprobs"]  # the eos token: not in the text, one of the tokens (as vLLM)
    assert lp["tokens"] == list(text) + ["<eos>"] and lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert lp["token_logprobs"] == pytest.approx(lps)
    assert lp["top_logprobs"] == [{c: pytest.approx(v)} for c, v in zip(list(text) + ["<eos>"], lps)]
    # a stop string spanning two tokens: text cut before it, tokens from it on dropped
    choice, used = openai_api.completion_choice(tok, batch, 0, index=0, stop_ids=(EOS,), stops=["x", ";3"], k=None)
    assert choice == {"index": 0, "text": "12", "logprobs": None, "finish_reason": "stop"} and used == 2
    # the stop string found in a row that ended on length also ends it with "stop"; none found: "length"
    batch = one_row_batch(ids[:5], lps[:5], top_ids[:5], top_lps[:5], "length")
    choice, used = openai_api.completion_choice(tok, batch, 0, index=0, stop_ids=(EOS,), stops=["4"], k=None)
    assert (choice["text"], choice["finish_reason"], used) == ("12;3", "stop", 4)
    choice, used = openai_api.completion_choice(tok, batch, 0, index=0, stop_ids=(EOS,), stops=["9"], k=None)
    assert (choice["text"], choice["finish_reason"], used) == ("12;34", "length", 5)
    # chat: the same row as a message, logprobs with bytes and the top entries
    chat, used = openai_api.chat_choice(tok, batch, 0, index=0, stop_ids=(EOS,), stops=[], logprobs=True, k=1)
    assert chat["message"] == {"role": "assistant", "content": "12;34"} and used == 5
    first = chat["logprobs"]["content"][0]
    assert first["token"] == "1" and first["bytes"] == [ord("1")] and first["logprob"] == pytest.approx(-0.5)
    assert first["top_logprobs"] == [{"token": "1", "logprob": pytest.approx(-0.5), "bytes": [ord("1")]}]


def test_request_checks_name_the_parameter():
    with pytest.raises(openai_api.OpenAIError) as e:
        openai_api.check_fields({"prompt": "1", "presence_penalty": 0.5}, openai_api.COMPLETION_FIELDS)
    assert e.value.status == 400 and e.value.param == "presence_penalty"
    with pytest.raises(openai_api.OpenAIError) as e:
        openai_api.check_fields({"prompt": "1", "bogus": 1}, openai_api.COMPLETION_FIELDS)
    assert e.value.param == "bogus"
    openai_api.check_fields({"prompt": "1", "echo": False, "stream": None, "logit_bias": {}},
                            openai_api.COMPLETION_FIELDS)
    assert openai_api.parse_stop(";") == [";"] and openai_api.parse_stop(None) == []
    for bad in ("", [""], [1], ["a"] * (openai_api.MAX_STOP_STRINGS + 1)):
        with pytest.raises(openai_api.OpenAIError) as e:
            openai_api.parse_stop(bad)
        assert e.value.param == "stop"
    assert openai_api.cut_at_stop("ab;cd:e", [":", ";"]) == 2 and openai_api.cut_at_stop("abc", ["x"]) is None


# ------------------------------------------------------------------------------ a real server, the openai client
@pytest.fixture(scope="module")
def server(tmp_path_factory, tok_dir):
    from pdm_jax.rollouts.launcher import start_sampler_server

    root = tmp_path_factory.mktemp("oai")
    with open(root / "config.json", "w") as f:
        json.dump(TINY_DENSE.to_hf_dict(), f)
    sp = start_sampler_server(model_config=str(root), weights=None, quantization="none", checkpoint_root=str(root),
                              token=TOKEN, max_prompt_length=32, max_new_tokens=16, max_batch_size=8,
                              max_body_bytes=64 * 1024, startup_timeout_s=180,
                              extra_args=[f"--tokenizer={tok_dir}", f"--served_model_name={MODEL}"])
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=300) as c:
        yield c


def native(server, prompts, *, n, k, seed, max_tokens=8, temperature=0.8):
    return server.client.generate(prompts, n=n, max_new_tokens=max_tokens, top_k_logprobs=k, temperature=temperature,
                                  stop_token_ids=[EOS], seed=seed)


def texts_of(tok, batch):
    out = []
    for r in range(batch.num_sequences):
        ids = [int(i) for i, m in zip(batch.completion_ids[r], batch.completion_mask[r]) if m and i != EOS]
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


@pytest.mark.slow
def test_completions_text_logprobs_and_n_match_the_native_api(server, client, tok):
    r = client.completions.create(model=MODEL, prompt="12+3=", max_tokens=8, temperature=0.8, seed=5, n=2,
                                  logprobs=3)
    b = native(server, [ids_of(tok, "12+3=")], n=2, k=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1] and r.model == MODEL and r.system_fingerprint == "pdm_jax-v0"
    assert [c.text for c in r.choices] == texts_of(tok, b)
    lengths = [len(c.logprobs.tokens) for c in r.choices]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == sum(lengths)
    for row, c in enumerate(r.choices):
        t = lengths[row]
        assert c.finish_reason == ("stop" if b.finish_reason[row] == "stop" else "length")
        ids = [int(i) for i in b.completion_ids[row, :t]]
        assert c.logprobs.tokens == [tok.decode([i]) for i in ids]  # <pad>, <eos> too: their own text
        assert "".join(x for x, i in zip(c.logprobs.tokens, ids) if i >= 2) == c.text
        np.testing.assert_allclose(c.logprobs.token_logprobs, b.behavior_logprobs[row, :t], rtol=1e-6)
        for s in range(t):
            want = {tok.decode([int(i)]): float(v) for i, v in zip(b.topk_ids[row, s], b.topk_logprobs[row, s])}
            assert c.logprobs.top_logprobs[s] == pytest.approx(want, rel=1e-6)
    # token-id prompts, two of them: choice i * n + j is sample j of prompt i; the same seed, the same draws
    ids = [ids_of(tok, "12+3="), ids_of(tok, "7-4=")]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0.8, seed=5, n=2)
    assert [c.text for c in r2.choices][:2] == [c.text for c in r.choices]
    assert [c.text for c in r2.choices] == texts_of(tok, native(server, ids, n=2, k=0, seed=5))
    assert r2.choices[0].logprobs is None


@pytest.mark.slow
def test_echo_scores_the_prompt_as_the_sampler_samples_it(server, client, tok):
    """echo + logprobs: position j's log-probability is the one the sampler gives id j after ids 0..j-1 (the native
    API's full top-32 table at temperature 1), as lm-evaluation-harness's log-likelihood requests read it."""
    ids = ids_of(tok, "12+34=")
    c = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                  temperature=0).choices[0]
    assert c.text == "12+34=" and c.finish_reason == "length" and c.logprobs.tokens == list("12+34=")
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.text_offset == list(range(len(ids)))
    for j in range(1, len(ids)):
        b = native(server, [ids[:j]], n=1, k=TINY_DENSE.vocab_size, seed=0, max_tokens=1, temperature=1.0)
        table = dict(zip(b.topk_ids[0, 0].tolist(), b.topk_logprobs[0, 0].tolist()))
        assert c.logprobs.token_logprobs[j] == pytest.approx(table[ids[j]], abs=2e-5)
        want = {tok.decode([i]): v for i, v in sorted(table.items(), key=lambda kv: -kv[1])[:2]}
        assert c.logprobs.top_logprobs[j] == pytest.approx(want, abs=2e-5)
    # lm-evaluation-harness's request: the prompt scored, then one generated token (kept even when it is eos)
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=1, echo=True, logprobs=1,
                                  temperature=0, seed=1234)
    for choice, p in zip(r.choices, [ids, ids[:3]]):
        assert choice.text.startswith(tok.decode(p)) and len(choice.logprobs.token_logprobs) == len(p) + 1
        assert choice.logprobs.token_logprobs[1:len(p)] == pytest.approx(c.logprobs.token_logprobs[1:len(p)],
                                                                         abs=2e-5)


@pytest.mark.slow
def test_stop_strings_cut_the_text(server, client):
    kw = dict(model=MODEL, prompt="12+3=", max_tokens=16, temperature=1.0, seed=11)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 4, full  # a random model: ~16 characters
    stop = full[2]
    r = client.completions.create(**kw, stop=[stop, "zzz"], logprobs=0)
    c = r.choices[0]
    assert c.text == full[:full.index(stop)] and c.finish_reason == "stop"
    assert len(c.logprobs.tokens) == len(c.text) == r.usage.completion_tokens
    assert c.logprobs.top_logprobs == [{}] * len(c.text)


@pytest.mark.slow
def test_chat_uses_the_tokenizers_template(server, client, tok):
    messages = [{"role": "user", "content": "12+3="}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.8, seed=3,
                                       logprobs=True, top_logprobs=3)
    prompt = ids_of(tok, "user:12+3=;assistant:")
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "user:12+3=;assistant:"
    b = native(server, [prompt], n=1, k=3, seed=3)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.message.content == texts_of(tok, b)[0] and r.usage.prompt_tokens == len(prompt)
    t = len(c.logprobs.content)
    np.testing.assert_allclose([e.logprob for e in c.logprobs.content], b.behavior_logprobs[0, :t], rtol=1e-6)
    assert [e.token for e in c.logprobs.content[0].top_logprobs] == [tok.decode([int(i)]) for i in b.topk_ids[0, 0]]
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=100), "max_tokens"),  # over the server's --max_new_tokens
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(logprobs=50), "logprobs"),
    (dict(temperature=-1.0), "temperature"),
    (dict(prompt="hello!"), "prompt"),  # characters outside the tokenizer
    (dict(prompt="1" * 40), "prompt"),  # longer than --max_prompt_length
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(echo=1), "echo"),
    (dict(stream=True), "stream"),
])
def test_bad_requests_get_400_in_openais_shape(server, client, kwargs, param):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": MODEL, "prompt": "12", **kwargs})
    assert e.value.status_code == 400
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["type"] == "invalid_request_error" and param in err["message"]


@pytest.mark.slow
def test_unknown_model_malformed_body_and_token(server, client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="12")
    assert e.value.response.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=MODEL, prompt="12")
        assert e.value.status_code == 401
        assert set(e.value.response.json()["error"]) == {"message", "type", "param", "code"}
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
