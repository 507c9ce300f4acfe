"""pdm_jax.sampler.continuous_batching: per-row limits, the cache phases' one decode loop, the tail's programs,
the slot and phase schedules (its equality with static batching, through `SamplingEngine`, is in
tests/test_sampler_engine.py)."""
import numpy as np
import pytest

from pdm_jax.sampler import continuous_batching as cb
from pdm_jax.sampler.continuous_batching import cache_phases, tail_levels
from pdm_jax.sampler.sampling import Draw
from tests.test_sampler_engine import CFG, K, PROMPTS, TAU, _assert_same_rollouts, make_engine, make_params


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture(scope="module")
def continuous_pair(params):
    """A static and a continuous engine with 4 rows per chunk / 4 slots (shared prefill on in both)."""
    return make_engine(params, max_batch_size=4), make_engine(params, max_batch_size=4, batching="continuous")


@pytest.mark.slow
def test_continuous_rows_with_different_max_lengths(continuous_pair):
    """Per-row max_new_tokens (1 .. 12) in the continuous program: each row is the static row cut at its
    own max (same keys per (prompt, sample, token)); rows that stop earlier keep their stop."""
    static, cont = continuous_pair
    gen = dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=TAU, seed=5)
    stop = 7
    full = static.generate(PROMPTS, stop_token_ids=[stop], **gen)
    rows = [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    row_max = [12, 1, 5, 3]
    part = cb.run(cont, cont._state, PROMPTS, rows, Draw(temperature=TAU, top_p=1.0, top_k=0, max_new=12, k=K,
                               stops=[stop], seed=5), row_max_new=row_max)
    for r, m in enumerate(row_max):
        want = min(m, int(full.completion_mask[r].sum()))
        assert part["length"][r] == want
        np.testing.assert_array_equal(part["tokens"][r, :want], full.completion_ids[r, :want])
        np.testing.assert_allclose(part["logp"][r, :want], full.behavior_logprobs[r, :want], atol=1e-5, rtol=1e-5)
        assert part["stopped"][r] == (full.finish_reason[r] == "stop" and want == full.completion_mask[r].sum())


def test_cache_phases_share_one_decode_loop(params, monkeypatch):
    """The cache phases add no decode loop to the continuous program: with 3 phases (min_cache_phase 4, T = 16) it
    holds as many while-loops as with 1 (min_cache_phase 16; parking off in both, a single phase has none), and
    only 2 dots per layer more for each extra phase's attention (the einsums of `_cached_attention`); the phased
    program's rollouts equal the single-phase one's."""
    texts = []
    real = cb._CONTINUOUS_JIT

    def spy(*args, **kwargs):
        texts.append(real.lower(*args, **kwargs).as_text())
        return real(*args, **kwargs)
    monkeypatch.setattr(cb, "_CONTINUOUS_JIT", spy)
    gen = dict(n=2, max_new_tokens=16, top_k_logprobs=K, temperature=TAU, seed=3)
    out = []
    for phase in (4, 16):
        cont = make_engine(params, max_batch_size=4, batching="continuous", park_rows=0)  # 1 phase: no park
        cont.min_cache_phase = phase
        out.append(cont.generate(PROMPTS, **gen))
    _assert_same_rollouts(*out)
    phased, single = texts
    assert phased.count("stablehlo.while") == single.count("stablehlo.while"), "a decode loop per cache phase"
    extra_dots = phased.count("stablehlo.dot_general") - single.count("stablehlo.dot_general")
    assert extra_dots == 2 * 2 * CFG.num_hidden_layers, extra_dots  # 2 more phases x 2 einsums x L layers


@pytest.mark.slow
@pytest.mark.parametrize("halving", [True, False])
def test_tail_program_runs_only_when_rows_are_left(params, continuous_pair, monkeypatch, request, halving):
    """The tail (`_continuous_compact` then `_continuous_tail`, rows left once the queue is empty and few slots are
    live) is a program of its own, run only when rows are left; with halving levels (T >= `_HALVING_MIN_NEW`, lowered
    to 16 here) the rows run in 2 slots, then 1, else in 1 (slots / 4); a request of at most slots / 4 rows runs in a
    cache of that many slots with one cache phase and no tail. All equal the static engine's rollouts."""
    static, _ = continuous_pair
    programs = (cb._CONTINUOUS_JIT, cb._CONTINUOUS_COMPACT_JIT, cb._CONTINUOUS_TAIL_JIT)
    if halving:  # the levels are traced into the programs: none may come from a cache traced with other levels
        monkeypatch.setattr(cb, "_HALVING_MIN_NEW", 16)
        for program in programs:
            program.clear_cache()
        request.addfinalizer(lambda: [program.clear_cache() for program in programs])
    assert cb.tail_levels(4, 16) == ([4, 2, 1] if halving else [4, 1])
    tails = []
    real, compact = cb._CONTINUOUS_TAIL_JIT, cb._CONTINUOUS_COMPACT_JIT
    monkeypatch.setattr(cb, "_CONTINUOUS_TAIL_JIT", lambda *a, **k: tails.append(k["slots"]) or real(*a, **k))
    monkeypatch.setattr(cb, "_CONTINUOUS_COMPACT_JIT",  # the carry it hands the tail: the first tail level
                        lambda c, **k: tails.append(compact(c, **k).slots.live.shape[0]) or compact(c, **k))
    cont = make_engine(params, max_batch_size=4, batching="continuous")
    gen = dict(n=2, max_new_tokens=12, top_k_logprobs=K, temperature=TAU, seed=5)
    full = static.generate(PROMPTS, **gen)
    rows = [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    part = cb.run(cont, cont._state, PROMPTS, rows, Draw(temperature=TAU, top_p=1.0, top_k=0, max_new=12, k=K,
                               stops=[], seed=5), row_max_new=[12, 1, 5, 3])  # rows 0 and 2 (2 slots), then 0 (1)
    assert tails == [2 if halving else 1, 4], tails
    for r, m in enumerate([12, 1, 5, 3]):
        np.testing.assert_array_equal(part["tokens"][r, :m], full.completion_ids[r, :m])
        np.testing.assert_allclose(part["logp"][r, :m], full.behavior_logprobs[r, :m], atol=1e-5, rtol=1e-5)
    n_tails = len(tails)
    _assert_same_rollouts(static.generate(PROMPTS, **gen), cont.generate(PROMPTS, **gen))  # 4 rows in 4 slots
    assert len(tails) == n_tails  # every row ended in the main loop: no tail
    one = dict(gen, n=1)
    _assert_same_rollouts(static.generate(PROMPTS[:1], **one), cont.generate(PROMPTS[:1], **one))
    assert len(tails) == n_tails
    small = [key for key in cont.program_shapes if key[1] == 1]  # 1 row: 1 slot (4 / 4), one phase (T = 16)
    assert len(small) == 1 and small[0][1:4] == (1, 1, 1) and small[0][-1] == ("min_phase", 16), cont.program_shapes


def test_tail_levels():
    """Continuous batching's slot counts: the main loop's, then the tail's halving levels (at most 4 in all) for
    requests of 64 new tokens or more, one level of slots / 4 for shorter ones."""
    assert tail_levels(64, 256) == [64, 32, 16, 8] and tail_levels(4, 64) == [4, 2, 1] and tail_levels(2, 64) == [2, 1]
    assert tail_levels(1, 64) == [1] and tail_levels(64, 32) == [64, 16] and tail_levels(2, 8) == [2]


def test_cache_phases():
    """Continuous batching's cache-length phases (new-token capacities), by hand."""
    assert cache_phases(256) == [64, 128, 256] and cache_phases(64) == [32, 64] and cache_phases(32) == [32]
    assert cache_phases(8) == [8] and cache_phases(16, min_phase=4) == [4, 8, 16] and cache_phases(100) == [50, 100]
