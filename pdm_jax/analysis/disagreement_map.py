"""Where can the ratio (DPPO) and predictive (PDM) direction tests disagree? A map on synthetic logits.

Issue 29 asks for a testbed on which the two direction tests decide differently on >= 5% of valid tokens
(``frac_direction_disagree``, which the trainer logs). They can only differ on an out-of-region token, and
there they differ iff the sign of its log-ratio log pi(y) - log mu(y) is not the sign of its predicted
divergence change D' (whatever the advantage's sign; `pdm_jax.rl.trust_region`). This module measures how
often that happens as a function of what a testbed can choose: the position's entropy, the vocabulary size V,
the top-K view K, the kind and size of the behaviour/trainer mismatch, and delta. Each cell runs the trainer's
own functions (`trust_region.topk_kl`, `kl_directional_derivative` with ``bucket_exact``, the default mask's)
on synthetic positions:

* behaviour logits z = s * g, g ~ N(0, I_V) i.i.d. per position: the logit scale s sets the entropy;
* the mismatch lever, one of
  - ``offset`` sigma: trainer logits z + sigma * eps, eps ~ N(0, I_V) i.i.d., a fixed offset between two copies
    of the weights (what a quantized sampler makes; a real quantizer's logit error is correlated across the
    vocabulary and depends on the position, so this is a model of it, not a measurement);
  - ``temperature`` tau_s: behaviour logits z / tau_s, trainer logits z (the ``sampler.temperature`` lever);
* the sampled token y ~ mu, and mu's top-K view (ids and log-probs of its K largest probabilities).

Per cell it reports the mean entropy and top-1 probability of mu, the mean top-K KL (nats), the share of
tokens outside delta, the share on which the tests disagree, and, on the disagreement set, how often the
predictive test's sign is the one of the full-vocabulary derivative (`trust_region.full_kl_directional_derivative`,
which knows all of mu: the first-order oracle).

``python -m pdm_jax.analysis disagreement_map --out=reports/disagreement_map`` writes ``cells.csv`` and
``README.md`` (deterministic: every cell's positions come from ``seed`` and the cell's index).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import os
import time
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdm_jax.rl import trust_region as tr

LEVERS = ("offset", "temperature")
#: The issue's qualification rule: frac_direction_disagree >= 5% of valid tokens.
QUALIFYING_DISAGREEMENT = 0.05
#: `summary` quotes a share only where its denominator holds at least this many tokens (outside tokens for the share
#: that disagrees, disagreeing tokens for pred_right_on_disagree).
MIN_TOKENS = 20
#: Cells are computed in chunks of at most this many positions x vocabulary entries (f32 arrays of ~128 MB).
CHUNK_ELEMENTS = 1 << 25


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """The grid. Fields: vocab_sizes (V), top_k (K), logit_scales (s), offsets (sigma, logit units),
    temperatures (tau_s), deltas (nats of top-K KL), positions (per cell and V, same order as vocab_sizes),
    seed."""

    vocab_sizes: Sequence[int] = (1024, 151936)  # the BPE testbed's, Qwen3's
    top_k: int = 20
    logit_scales: Sequence[float] = (3.0, 4.5, 6.0, 9.0, 12.0)
    offsets: Sequence[float] = (0.1, 0.2, 0.4, 0.8)
    temperatures: Sequence[float] = (1.1, 1.3, 1.6)
    deltas: Sequence[float] = (0.05, 0.15)
    positions: Sequence[int] = (4096, 1024)
    seed: int = 0

    def __post_init__(self):
        if len(self.positions) != len(self.vocab_sizes):
            raise ValueError(f"MapSpec.positions {tuple(self.positions)} must give one count per vocabulary size "
                             f"{tuple(self.vocab_sizes)}")
        for v in self.vocab_sizes:
            if not self.top_k < v:
                raise ValueError(f"MapSpec.top_k={self.top_k} must be below every vocabulary size, got V={v}")
        for name in ("logit_scales", "offsets", "deltas", "positions"):
            if any(not x > 0 for x in getattr(self, name)):
                raise ValueError(f"MapSpec.{name} must be positive, got {tuple(getattr(self, name))}")
        if any(not t > 0 for t in self.temperatures):
            raise ValueError(f"MapSpec.temperatures must be positive, got {tuple(self.temperatures)}")

    def levers(self) -> list:
        """[(lever, strength)] in table order."""
        return [("offset", s) for s in self.offsets] + [("temperature", t) for t in self.temperatures]


def positions(key, scale, strength, *, n: int, vocab: int, top_k: int, lever: str):
    """A cell's synthetic positions (the module docstring): ``(pi_logits [n,V] f32, mu_logits [n,V] f32,
    tokens [n] int32, topk_ids [n,K] int32, topk_logprobs [n,K] f32, behavior_logprobs [n] f32)``."""
    kz, ke, ky = jax.random.split(key, 3)
    z = scale * jax.random.normal(kz, (n, vocab), jnp.float32)
    if lever == "offset":
        mu_z, pi_z = z, z + strength * jax.random.normal(ke, (n, vocab), jnp.float32)
    else:
        mu_z, pi_z = z / strength, z
    mu_lp = jax.nn.log_softmax(mu_z, axis=-1)
    tokens = jax.random.categorical(ky, mu_lp, axis=-1).astype(jnp.int32)
    topk_lp, topk_ids = jax.lax.top_k(mu_lp, top_k)
    behavior = jnp.take_along_axis(mu_lp, tokens[:, None], axis=-1)[:, 0]
    return pi_z, mu_z, tokens, topk_ids.astype(jnp.int32), topk_lp, behavior


def chunk_key(seed: int, index: int, chunk: int):
    """The PRNG key of chunk ``chunk`` of cell ``index`` (cells are numbered in `compute`'s order)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), index), chunk)


@functools.partial(jax.jit, static_argnames=("n", "vocab", "top_k", "lever"))
def _chunk(key, scale, strength, deltas, *, n: int, vocab: int, top_k: int, lever: str):
    """Per-chunk sums: [entropy, top1, topk_kl, then per delta: outside, disagree, disagree & oracle agrees
    with the predictive sign]. f32 ``[3 + 3 * len(deltas)]``."""
    pi_z, mu_z, tokens, topk_ids, topk_lp, behavior = positions(key, scale, strength, n=n, vocab=vocab,
                                                                top_k=top_k, lever=lever)
    mu_lp = jax.nn.log_softmax(mu_z, axis=-1)
    args = (pi_z, tokens, topk_ids, topk_lp, behavior)
    kl = tr.topk_kl(*args)
    d_pred = tr.kl_directional_derivative(*args, estimator="bucket_exact")
    d_full = tr.full_kl_directional_derivative(pi_z, mu_z, tokens)
    log_ratio = jnp.take_along_axis(jax.nn.log_softmax(pi_z, axis=-1), tokens[:, None], axis=-1)[:, 0] - behavior
    # With A > 0 the ratio test drops an outside token iff log r > 0, the predictive one iff D' > 0
    # (trust_region._mask_core); with A < 0 both flip, so they differ iff these two signs differ.
    differ = (log_ratio > 0) != (d_pred > 0)
    oracle_agrees = (d_full > 0) == (d_pred > 0)
    entropy = -jnp.sum(jnp.exp(mu_lp) * mu_lp, axis=-1)
    out = [jnp.sum(entropy), jnp.sum(jnp.exp(jnp.max(mu_lp, axis=-1))), jnp.sum(kl)]
    for i in range(deltas.shape[0]):
        outside = kl > deltas[i]
        out += [jnp.sum(outside), jnp.sum(outside & differ), jnp.sum(outside & differ & oracle_agrees)]
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in out])


def cell(spec: MapSpec, vocab: int, num_positions: int, scale: float, lever: str, strength: float,
         index: int) -> list:
    """One (V, s, lever, strength) cell: a list of row dicts, one per delta (see `CSV_FIELDS`).

    Raises:
      ValueError: unknown ``lever``.
    """
    if lever not in LEVERS:
        raise ValueError(f"lever must be one of {LEVERS}, got {lever!r}")
    chunk = max(1, min(num_positions, CHUNK_ELEMENTS // vocab))
    deltas = jnp.asarray(spec.deltas, jnp.float32)
    total, done, c = None, 0, 0
    while done < num_positions:
        n = min(chunk, num_positions - done)
        sums = _chunk(chunk_key(spec.seed, index, c), jnp.float32(scale), jnp.float32(strength), deltas, n=n,
                      vocab=vocab, top_k=spec.top_k, lever=lever)
        sums = np.asarray(sums, np.float64)
        total = sums if total is None else total + sums
        done, c = done + n, c + 1
    rows = []
    for i, delta in enumerate(spec.deltas):
        outside, disagree, right = total[3 + 3 * i: 6 + 3 * i]
        n = float(num_positions)
        rows.append(dict(vocab=vocab, top_k=spec.top_k, logit_scale=scale, lever=lever, strength=strength,
                         delta=delta, positions=num_positions, entropy=total[0] / n, top1=total[1] / n,
                         mean_topk_kl=total[2] / n, frac_outside=outside / n, frac_disagree=disagree / n,
                         pred_right_on_disagree=(right / disagree) if disagree else float("nan")))
    return rows


CSV_FIELDS = ("vocab", "top_k", "logit_scale", "lever", "strength", "delta", "positions", "entropy", "top1",
              "mean_topk_kl", "frac_outside", "frac_disagree", "pred_right_on_disagree")


def compute(spec: MapSpec, progress=None) -> list:
    """Every cell of the grid, in a fixed order; ``progress(i, n)`` is called after each cell."""
    jobs = [(v, p, s, lever, strength) for v, p in zip(spec.vocab_sizes, spec.positions)
            for s in spec.logit_scales for lever, strength in spec.levers()]
    rows = []
    for i, (v, p, s, lever, strength) in enumerate(jobs):
        rows += cell(spec, v, p, s, lever, strength, index=i)
        if progress is not None:
            progress(i + 1, len(jobs))
    return rows


def write_csv(rows: Iterable[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in CSV_FIELDS})


def read_csv(path: str) -> list:
    """The rows `write_csv` wrote, numbers as floats/ints."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.append({k: (r[k] if k == "lever" else int(r[k]) if k in ("vocab", "top_k", "positions")
                            else float(r[k])) for k in CSV_FIELDS})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _lever_label(lever: str, strength: float) -> str:
    return f"offset σ = {strength:g}" if lever == "offset" else f"temperature τ_s = {strength:g}"


def summary(rows: Sequence[dict]) -> list:
    """Reading lines computed from the rows: per (V, delta), the cells that reach the qualification rule and the
    least out-of-region share among them, and the largest disagreement per out-of-region token per lever."""
    lines = []
    for v in sorted({r["vocab"] for r in rows}):
        for d in sorted({r["delta"] for r in rows}):
            sel = [r for r in rows if r["vocab"] == v and r["delta"] == d]
            for lever in LEVERS:
                lr = [r for r in sel if r["lever"] == lever]
                if not lr:
                    continue
                q = [r for r in lr if r["frac_disagree"] >= QUALIFYING_DISAGREEMENT]
                out = [r for r in lr if r["frac_outside"] * r["positions"] >= MIN_TOKENS]
                best = max(out, key=lambda r: r["frac_disagree"] / r["frac_outside"]) if out else None
                text = (f"V = {v}, δ = {d:g}, {lever}: {len(q)} of {len(lr)} cells reach "
                        f"{_pct(QUALIFYING_DISAGREEMENT)}% disagreement")
                if q:
                    m = min(q, key=lambda r: r["frac_outside"])
                    text += (f"; the one with the fewest tokens outside δ has {_pct(m['frac_outside'])}% outside "
                             f"(entropy {m['entropy']:.2f} nats, {_lever_label(lever, m['strength'])}, "
                             f"top-K KL {m['mean_topk_kl']:.3g} nats)")
                if best is not None:
                    text += (f"; at most {_pct(best['frac_disagree'] / best['frac_outside'])}% of the outside tokens "
                             f"disagree (cells with >= {MIN_TOKENS} outside; entropy {best['entropy']:.2f} nats, "
                             f"{_lever_label(lever, best['strength'])})")
                lines.append(text + ".")
    counted = [r for r in rows if r["frac_disagree"] * r["positions"] >= MIN_TOKENS]
    if counted:
        right = [r["pred_right_on_disagree"] for r in counted]
        lines.append(f"Where the tests disagree ({len(counted)} cell rows with >= {MIN_TOKENS} "
                     f"disagreeing tokens), the predictive sign is the full-vocabulary derivative's on "
                     f"{_pct(min(right))}-{_pct(max(right))}% of them: the ratio test's decision is the wrong one "
                     f"there to first order.")
    return lines


def markdown(rows: Sequence[dict], spec_line: str, command: str, provenance: str) -> str:
    """The README: how the cells are made, the summary lines, and per (V, delta) one table whose rows are the
    levers and columns the logit scales; a cell reads ``outside % / disagree %``."""
    out = ["# Where the direction tests can disagree: a map on synthetic logits (issue 29)", "",
           "The ratio (DPPO) and predictive (PDM, bucket_exact) direction tests can only decide differently on a "
           "token outside the trust region, and there they differ iff the sign of its log-ratio is not the sign of "
           "its predicted divergence change. This map measures how often that happens on synthetic positions "
           "whose entropy and behaviour/trainer mismatch are set directly, with the trainer's own functions "
           "(top-K KL, the bucket_exact D'), to show what a testbed must look like before the issue's rule "
           f"(≥ {_pct(QUALIFYING_DISAGREEMENT)}% of valid tokens) can be met.", "",
           "- **Positions**: behaviour logits z = s·g, g ~ N(0, I_V); the logit scale s sets the entropy (the "
           "tables give the measured mean entropy of μ and its top-1 probability per column).",
           "- **Levers**: `offset σ`: trainer logits z + σ·ε, ε ~ N(0, I_V), a fixed offset between two copies of "
           "the weights (a model of a quantized sampler; a real quantizer's logit error is correlated across the "
           "vocabulary and position-dependent). `temperature τ_s`: behaviour logits z/τ_s, trainer logits z "
           "(the `sampler.temperature` lever).",
           "- **Tokens**: y ~ μ, with μ's top-K view; every token counts (no padding).",
           f"- **Grid**: {spec_line}.",
           f"- **Command**: `{command}` (deterministic; {provenance}).",
           "- **Files**: [`cells.csv`](cells.csv), one row per cell and δ, with the share of the disagreement "
           "set on which the predictive sign is the full-vocabulary derivative's (`pred_right_on_disagree`).", "",
           "## Summary (computed from the cells)", ""]
    out += [f"- {line}" for line in summary(rows)]
    for v in sorted({r["vocab"] for r in rows}):
        for d in sorted({r["delta"] for r in rows}):
            sel = [r for r in rows if r["vocab"] == v and r["delta"] == d]
            scales = sorted({r["logit_scale"] for r in sel})
            first = {s: next(r for r in sel if r["logit_scale"] == s) for s in scales}
            out += ["", f"## V = {v}, K = {sel[0]['top_k']}, δ = {d:g}: % outside δ / % disagreeing", "",
                    "| lever | " + " | ".join(f"s = {s:g}" for s in scales) + " |",
                    "|---|" + "---:|" * len(scales),
                    "| *μ's entropy (nats) / top-1* | " + " | ".join(
                        f"*{first[s]['entropy']:.2f} / {first[s]['top1']:.2f}*" for s in scales) + " |"]
            levers = []
            for r in sel:
                if (r["lever"], r["strength"]) not in levers:
                    levers.append((r["lever"], r["strength"]))
            for lever, strength in levers:
                cells = []
                for s in scales:
                    r = next(x for x in sel if x["lever"] == lever and x["strength"] == strength
                             and x["logit_scale"] == s)
                    text = f"{_pct(r['frac_outside'])} / {_pct(r['frac_disagree'])}"
                    cells.append(f"**{text}**" if r["frac_disagree"] >= QUALIFYING_DISAGREEMENT else text)
                out.append(f"| {_lever_label(lever, strength)} | " + " | ".join(cells) + " |")
    out += ["", f"Bold: the cell reaches {_pct(QUALIFYING_DISAGREEMENT)}% disagreement. The entropy row is "
            "the offset rows' μ; a temperature row's μ is hotter (its own entropy is in `cells.csv`)."]
    return "\n".join(out) + "\n"


def spec_line(spec: MapSpec) -> str:
    return (f"V ∈ {{{', '.join(map(str, spec.vocab_sizes))}}} "
            f"(positions per cell {', '.join(map(str, spec.positions))}), "
            f"K = {spec.top_k}, s ∈ {{{', '.join(f'{s:g}' for s in spec.logit_scales)}}}, "
            f"σ ∈ {{{', '.join(f'{s:g}' for s in spec.offsets)}}}, "
            f"τ_s ∈ {{{', '.join(f'{t:g}' for t in spec.temperatures)}}}, "
            f"δ ∈ {{{', '.join(f'{d:g}' for d in spec.deltas)}}} nats, seed {spec.seed}")


def run(out_dir: str, spec: MapSpec = MapSpec(), command: str = "", provenance: str = "") -> list:
    """Computes the grid, writes ``cells.csv`` and ``README.md`` under ``out_dir``; returns the rows."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    rows = compute(spec, progress=lambda i, n: print(f"cell {i}/{n} ({time.time() - t0:.0f} s)", flush=True))
    write_csv(rows, os.path.join(out_dir, "cells.csv"))
    rows = read_csv(os.path.join(out_dir, "cells.csv"))  # the README is what `report` would rebuild
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(markdown(rows, spec_line(spec), command, provenance))
    return rows
