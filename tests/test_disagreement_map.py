"""The synthetic disagreement map (`pdm_jax.analysis.disagreement_map`) against an independent float64 reference."""

import os

import numpy as np
import pytest

from pdm_jax.analysis import disagreement_map as dm
from pdm_jax.analysis.__main__ import main

V, K, N = 64, 8, 512
SPEC = dm.MapSpec(vocab_sizes=(V,), top_k=K, logit_scales=(2.0,), offsets=(0.6,), temperatures=(1.5,),
                  deltas=(0.02, 0.05), positions=(N,), seed=3)


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _reference(pi_z, mu_z, tokens, topk_ids):
    """float64, from mu's full logits (not the f32 top-K log-probs the map is given): per token the top-K KL over
    E = top-K ∪ {y} plus the tail bucket, its derivative along e_y − π and the full KL's, both by central finite
    differences, and log r."""
    pi_z, mu_z = pi_z.astype(np.float64), mu_z.astype(np.float64)
    log_mu = _log_softmax(mu_z)
    out = {k: np.zeros(len(tokens)) for k in ("kl", "d_topk", "d_full", "log_r")}
    for t, y in enumerate(tokens):
        e = np.zeros(V, bool)
        e[topk_ids[t]] = True
        e[y] = True
        mu = np.exp(log_mu[t])

        def topk_kl(z):
            lp = _log_softmax(z)
            head = np.sum(mu[e] * (log_mu[t][e] - lp[e]))
            mu_t, pi_t = mu[~e].sum(), np.exp(lp[~e]).sum()
            return head + mu_t * np.log(mu_t / pi_t)

        def full_kl(z):
            return np.sum(mu * (log_mu[t] - _log_softmax(z)))

        pi = np.exp(_log_softmax(pi_z[t]))
        d = -pi
        d[y] += 1.0
        h = 1e-5
        out["kl"][t] = topk_kl(pi_z[t])
        out["d_topk"][t] = (topk_kl(pi_z[t] + h * d) - topk_kl(pi_z[t] - h * d)) / (2 * h)
        out["d_full"][t] = (full_kl(pi_z[t] + h * d) - full_kl(pi_z[t] - h * d)) / (2 * h)
        out["log_r"][t] = np.log(pi[y]) - log_mu[t][y]
    return out


@pytest.mark.parametrize("index", [0, 1], ids=["offset", "temperature"])
def test_a_cell_counts_what_an_independent_float64_reference_counts(index):
    lever, strength = SPEC.levers()[index]
    rows = dm.cell(SPEC, V, N, 2.0, lever, strength, index=index)
    arrays = dm.positions(dm.chunk_key(SPEC.seed, index, 0), 2.0, strength, n=N, vocab=V, top_k=K, lever=lever)
    pi_z, mu_z, tokens, topk_ids, _, _ = (np.asarray(a) for a in arrays)
    ref = _reference(pi_z, mu_z, tokens, topk_ids)
    assert [r["delta"] for r in rows] == list(SPEC.deltas)
    for row, delta in zip(rows, SPEC.deltas):
        outside = ref["kl"] > delta
        disagree = outside & ((ref["log_r"] > 0) != (ref["d_topk"] > 0))
        assert disagree.mean() > 0.01, "the cell must contain disagreements for the test to mean anything"
        assert abs(row["frac_outside"] - outside.mean()) <= 2 / N
        assert abs(row["frac_disagree"] - disagree.mean()) <= 2 / N
        right = np.mean((ref["d_full"] > 0)[disagree] == (ref["d_topk"] > 0)[disagree])
        assert abs(row["pred_right_on_disagree"] - right) <= 0.05
        assert row["mean_topk_kl"] == pytest.approx(ref["kl"].mean(), rel=1e-3)
    log_mu = _log_softmax(mu_z.astype(np.float64))
    entropy = -np.sum(np.exp(log_mu) * log_mu, -1).mean()
    assert rows[0]["entropy"] == pytest.approx(entropy, rel=1e-4)
    assert rows[0]["top1"] == pytest.approx(np.exp(log_mu.max(-1)).mean(), rel=1e-4)


def test_positions_are_chunked_without_changing_what_a_cell_measures(monkeypatch):
    whole = dm.cell(SPEC, V, N, 2.0, "offset", 0.6, index=0)
    monkeypatch.setattr(dm, "CHUNK_ELEMENTS", V * 100)  # 6 chunks: 100 x 5 + 12 positions
    chunked = dm.cell(SPEC, V, N, 2.0, "offset", 0.6, index=0)
    assert [r["positions"] for r in chunked] == [N, N]
    # other keys per chunk: other positions, the same distribution
    for a, b in zip(whole, chunked):
        assert a["mean_topk_kl"] != b["mean_topk_kl"] and b["mean_topk_kl"] == pytest.approx(a["mean_topk_kl"], rel=0.1)
        assert abs(a["frac_disagree"] - b["frac_disagree"]) < 0.05


def test_the_readme_bolds_and_summarises_the_cells_that_reach_the_rule(tmp_path):
    rows = dm.run(str(tmp_path), SPEC, command="cmd", provenance="here")
    assert rows == dm.read_csv(str(tmp_path / "cells.csv"))
    text = (tmp_path / "README.md").read_text()
    for r in rows:
        cell_text = f"{100 * r['frac_outside']:.1f} / {100 * r['frac_disagree']:.1f}"
        assert (f"**{cell_text}**" in text) == (r["frac_disagree"] >= dm.QUALIFYING_DISAGREEMENT)
    qualifying = [r for r in rows if r["frac_disagree"] >= dm.QUALIFYING_DISAGREEMENT]
    assert qualifying, "the test spec has a qualifying cell"
    n_offset = sum(r["lever"] == "offset" and r["delta"] == 0.02 for r in qualifying)
    assert f"V = {V}, δ = 0.02, offset: {n_offset} of 1 cells reach 5.0% disagreement" in text
    assert "Over the whole map at most" in text and "cell rows of fewer" not in text


@pytest.mark.parametrize("field,value,match", [
    ("positions", (10, 10), "one count per vocabulary size"),
    ("top_k", 64, "MapSpec.top_k=64 must be below"),
    ("top_k", 0, r"MapSpec.top_k must hold integers in \[1"),
    ("top_k", True, "MapSpec.top_k must hold integers"),
    ("top_k", 2.5, "MapSpec.top_k must hold integers"),
    ("seed", 2 ** 70, "MapSpec.seed must hold integers"),
    ("vocab_sizes", ("64",), "MapSpec.vocab_sizes must hold integers"),
    ("positions", (float("inf"),), "MapSpec.positions must hold integers"),
    ("offsets", (0.0,), "MapSpec.offsets must hold finite numbers"),
    ("offsets", (float("inf"),), "MapSpec.offsets must hold finite numbers"),
    ("logit_scales", (1e39,), "MapSpec.logit_scales must hold finite numbers"),
    ("temperatures", (1e-46,), "MapSpec.temperatures must hold finite numbers"),
    ("deltas", (float("nan"),), "MapSpec.deltas must hold finite numbers"),
    ("deltas", 0.05, "MapSpec.deltas must be a list or tuple, got 0.05"),
    ("logit_scales", (), "MapSpec.logit_scales must not be empty"),
])
def test_a_bad_spec_is_refused_naming_the_field_and_the_value(field, value, match):
    fields = dict(vocab_sizes=(V,), positions=(N,), top_k=K)
    fields[field] = value
    with pytest.raises(ValueError, match=match):
        dm.MapSpec(**fields)


def test_no_lever_and_non_finite_cells_are_errors_not_zeros():
    with pytest.raises(ValueError, match="both empty: no lever"):
        dm.MapSpec(offsets=(), temperatures=())
    spec = dm.MapSpec(vocab_sizes=(V,), positions=(N,), top_k=K)
    object.__setattr__(spec, "offsets", (float("inf"),))  # past the checks, as an overflow would be
    with pytest.raises(ValueError, match=r"cell V=64, s=2, offset=inf: 512 of 512 positions have a non-finite"):
        dm.cell(spec, V, N, 2.0, "offset", float("inf"), index=0)


def test_offset_rows_of_a_column_share_their_positions():
    spec = dm.MapSpec(vocab_sizes=(V,), top_k=K, logit_scales=(2.0,), offsets=(0.3, 0.6), temperatures=(),
                      deltas=(0.05,), positions=(N,))
    a, b = dm.compute(spec)
    assert a["entropy"] == b["entropy"] and a["top1"] == b["top1"]
    assert a["frac_outside"] < b["frac_outside"]  # the same offset direction, twice as long


def test_a_small_map_is_left_out_of_the_summary_saying_so():
    spec = dm.MapSpec(vocab_sizes=(V,), top_k=K, logit_scales=(2.0,), offsets=(0.6,), temperatures=(),
                      deltas=(0.05,), positions=(8,))
    assert dm.summary(dm.compute(spec)) == ["1 cell rows of fewer than 400 positions are left out of this summary."]


def test_bad_cli_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    for positions in ("12", "", "a,b"):  # one count for two vocabulary sizes; empty; not integers
        with pytest.raises(SystemExit):
            main(["disagreement_map", f"--out={tmp_path}", f"--positions={positions}"])
        assert f"--positions={positions!r}" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        main(["disagreement_map", f"--out={tmp_path / 'file'}"])
    assert "exists and is not a directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lever must be one of"):
        dm.cell(SPEC, V, N, 2.0, "noise", 0.6, index=0)
