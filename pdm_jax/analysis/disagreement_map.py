"""Where can the ratio (DPPO) and predictive (PDM) direction tests disagree? A map on synthetic logits.

The two tests differ only on an out-of-region token whose log-ratio log pi(y) - log mu(y) and predicted divergence
change D' have different signs (`pdm_jax.rl.trust_region`). Each cell runs the trainer's own functions (`topk_kl`,
``bucket_exact`` `kl_directional_derivative`) on synthetic positions: behaviour logits z = s * g, g ~ N(0, I_V) (the
scale s sets the entropy), and a mismatch lever, ``offset`` sigma (trainer logits z + sigma * eps: a model of a
quantized sampler's error, not a measurement) or ``temperature`` tau_s (behaviour logits z / tau_s); y ~ mu and mu's
top-K view. Per cell: mean entropy and top-1 probability of mu, mean top-K KL (nats), the share outside delta, the
share where the tests disagree and, there, how often the predictive sign is the full-vocabulary derivative's (the
first-order oracle). ``python -m pdm_jax.analysis disagreement_map --out=reports/disagreement_map`` writes
``cells.csv`` and ``README.md``, deterministic in ``seed``."""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
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


#: Bounds of the grid's float fields (exclusive low, inclusive high): beyond them f32 logits overflow or the cell
#: means nothing (a temperature of 0).
FLOAT_BOUNDS = dict(logit_scales=(0.0, 1e3), offsets=(0.0, 1e2), temperatures=(1e-2, 1e2), deltas=(0.0, 1e2))
#: Bounds of the grid's integer fields (inclusive).
INT_BOUNDS = dict(vocab_sizes=(2, 1 << 20), positions=(1, 1 << 20), top_k=(1, 1 << 20), seed=(0, (1 << 32) - 1))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """The grid: vocab_sizes (V), top_k (K), logit_scales (s), offsets (sigma, logit units), temperatures (tau_s),
    deltas (nats of top-K KL), positions (per cell and V), seed; sequences stored as tuples.

    Raises:
      ValueError: naming the field and its value: a sequence that is not a non-empty list or tuple (offsets or
        temperatures may be empty, not both), an int field that is not an int or out of `INT_BOUNDS`, a float not
        finite or out of `FLOAT_BOUNDS`, positions not one count per vocabulary size, or top_k not below every
        vocabulary size."""

    vocab_sizes: Sequence[int] = (1024, 151936)  # the BPE testbed's, Qwen3's
    top_k: int = 20
    logit_scales: Sequence[float] = (3.0, 4.5, 6.0, 9.0, 12.0)
    offsets: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
    temperatures: Sequence[float] = (1.1, 1.3, 1.6)
    deltas: Sequence[float] = (0.05, 0.15)
    positions: Sequence[int] = (4096, 1024)
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab_sizes", "positions", "logit_scales", "offsets", "temperatures", "deltas"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"MapSpec.{name} must be a list or tuple, got {value!r}")
            if not value and name not in ("offsets", "temperatures"):
                raise ValueError(f"MapSpec.{name} must not be empty")
            object.__setattr__(self, name, tuple(value))
        if not self.offsets and not self.temperatures:
            raise ValueError("MapSpec.offsets and MapSpec.temperatures are both empty: no lever to map")
        for name, (lo, hi) in INT_BOUNDS.items():
            value = getattr(self, name)
            for x in (value if isinstance(value, tuple) else (value,)):
                if not _is_int(x) or not lo <= x <= hi:
                    raise ValueError(f"MapSpec.{name} must hold integers in [{lo}, {hi}], got {value!r}")
        for name, (lo, hi) in FLOAT_BOUNDS.items():
            value = getattr(self, name)
            for x in value:
                if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)) \
                        or not math.isfinite(x) or not lo < x <= hi:
                    raise ValueError(f"MapSpec.{name} must hold finite numbers in ({lo:g}, {hi:g}], got {value!r}")
        if len(self.positions) != len(self.vocab_sizes):
            raise ValueError(f"MapSpec.positions {self.positions} must give one count per vocabulary size "
                             f"{self.vocab_sizes}")
        for v in self.vocab_sizes:
            if not self.top_k < v:
                raise ValueError(f"MapSpec.top_k={self.top_k} must be below every vocabulary size, got V={v}")

    def levers(self) -> list:
        """[(lever, strength)] in table order."""
        return [("offset", s) for s in self.offsets] + [("temperature", t) for t in self.temperatures]


def positions(key, scale, strength, *, n: int, vocab: int, top_k: int, lever: str):
    """A cell's synthetic positions (the module docstring):
    ``(pi_logits [n,V] f32, mu_logits [n,V] f32, tokens [n] int32, topk_ids [n,K] int32, topk_logprobs [n,K] f32,
    behavior_logprobs [n] f32)``."""
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
    """Per-chunk sums: [non-finite positions, entropy, top1, topk_kl, then per delta: outside, disagree, disagree &
    oracle agrees with the predictive sign]. f32 ``[4 + 3 * len(deltas)]``."""
    pi_z, mu_z, tokens, topk_ids, topk_lp, behavior = positions(key, scale, strength, n=n, vocab=vocab,
                                                                top_k=top_k, lever=lever)
    mu_lp = jax.nn.log_softmax(mu_z, axis=-1)
    args = (pi_z, tokens, topk_ids, topk_lp, behavior)
    kl = tr.topk_kl(*args)
    d_pred = tr.kl_directional_derivative(*args, estimator="bucket_exact")
    d_full = tr.full_kl_directional_derivative(pi_z, mu_z, tokens)
    log_ratio = jnp.take_along_axis(jax.nn.log_softmax(pi_z, axis=-1), tokens[:, None], axis=-1)[:, 0] - behavior
    # With A = +1 (every token here) the ratio test drops an outside token iff log r > 0, the predictive one iff D' > 0
    # (trust_region._mask_core). With A = -1 the tests drop it iff log r < 0 / D' < 0: the same count but at an exact
    # zero of log r or D', which no out-of-region token of the committed map has.
    differ = (log_ratio > 0) != (d_pred > 0)
    oracle_agrees = (d_full > 0) == (d_pred > 0)
    entropy = -jnp.sum(jnp.exp(mu_lp) * mu_lp, axis=-1)
    finite = jnp.isfinite(kl) & jnp.isfinite(d_pred) & jnp.isfinite(d_full) & jnp.isfinite(entropy)
    out = [jnp.sum(~finite), jnp.sum(entropy), jnp.sum(jnp.exp(jnp.max(mu_lp, axis=-1))), jnp.sum(kl)]
    for i in range(deltas.shape[0]):
        outside = kl > deltas[i]
        out += [jnp.sum(outside), jnp.sum(outside & differ), jnp.sum(outside & differ & oracle_agrees)]
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in out])


def cell(spec: MapSpec, vocab: int, num_positions: int, scale: float, lever: str, strength: float,
         index: int) -> list:
    """One (V, s, lever, strength) cell: one row dict per delta (`CSV_FIELDS`); the column ``index`` and ``spec.seed``
    key its draws, shared by every lever of the column.

    Raises:
      ValueError: unknown ``lever``; a non-finite divergence, derivative or entropy (naming the cell)."""
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
    if total[0]:
        raise ValueError(f"cell V={vocab}, s={scale:g}, {lever}={strength:g}: {int(total[0])} of {num_positions} "
                         "positions have a non-finite top-K KL, derivative or entropy (f32 overflow); use smaller "
                         "logit scales or offsets")
    total = total[1:]
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
    columns = [(v, p, s) for v, p in zip(spec.vocab_sizes, spec.positions) for s in spec.logit_scales]
    jobs = [(column, c, lever, strength) for column, c in enumerate(columns) for lever, strength in spec.levers()]
    rows = []
    for i, (column, (v, p, s), lever, strength) in enumerate(jobs):
        rows += cell(spec, v, p, s, lever, strength, index=column)
        if progress is not None:
            progress(i + 1, len(jobs))
    return rows


def write_csv(rows: Iterable[dict], path: str) -> None:
    """Writes `compute`'s rows to ``path`` as CSV with the `CSV_FIELDS` columns (floats to 6 significant digits)."""
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


def _ratio(r: dict) -> float:
    return r["frac_disagree"] / r["frac_outside"]


def summary(rows: Sequence[dict]) -> list:
    """Reading lines computed from the rows: per (V, delta, lever) the cells that reach the qualification rule, their
    least out-of-region share and the largest disagreeing share; then over the whole map; then how often the
    predictive sign is right where the tests part. A share is read only over at least `MIN_TOKENS` tokens."""
    min_positions = math.ceil(MIN_TOKENS / QUALIFYING_DISAGREEMENT)
    readable = [r for r in rows if r["positions"] >= min_positions]
    lines = []
    if len(readable) < len(rows):
        lines.append(f"{len(rows) - len(readable)} cell rows of fewer than {min_positions} positions are left out "
                     "of this summary.")
    rule = f"{_pct(QUALIFYING_DISAGREEMENT)}%"
    for v in sorted({r["vocab"] for r in readable}):
        for d in sorted({r["delta"] for r in readable}):
            for lever in LEVERS:
                lr = [r for r in readable if r["vocab"] == v and r["delta"] == d and r["lever"] == lever]
                if not lr:
                    continue
                q = [r for r in lr if r["frac_disagree"] >= QUALIFYING_DISAGREEMENT]
                out = [r for r in lr if r["frac_outside"] * r["positions"] >= MIN_TOKENS]
                text = f"V = {v}, δ = {d:g}, {lever}: {len(q)} of {len(lr)} cells reach {rule} disagreement"
                if q:
                    m = min(q, key=lambda r: r["frac_outside"])
                    text += (f"; the one with the fewest tokens outside δ has {_pct(m['frac_outside'])}% outside "
                             f"(entropy {m['entropy']:.2f} nats, {_lever_label(lever, m['strength'])}, "
                             f"top-K KL {m['mean_topk_kl']:.3g} nats)")
                if out:
                    best = max(out, key=_ratio)
                    text += (f"; at most {_pct(_ratio(best))}% of the outside tokens disagree (entropy "
                             f"{best['entropy']:.2f} nats, {_lever_label(lever, best['strength'])})")
                lines.append(text + ".")
    out = [r for r in readable if r["frac_outside"] * r["positions"] >= MIN_TOKENS]
    if out:
        best = max(out, key=_ratio)
        lines.append(f"Over the whole map at most {_pct(_ratio(best))}% of the outside tokens disagree (V = "
                     f"{best['vocab']}, δ = {best['delta']:g}, {_lever_label(best['lever'], best['strength'])}, "
                     f"entropy {best['entropy']:.2f} nats): {rule} of all tokens disagreeing needs at least "
                     f"{_pct(QUALIFYING_DISAGREEMENT / _ratio(best))}% of them outside δ, and more where fewer of "
                     "the outside ones disagree.")
    counted = [r for r in readable if r["frac_disagree"] * r["positions"] >= MIN_TOKENS]
    if counted:
        right = [r["pred_right_on_disagree"] for r in counted]
        lines.append(f"Where the tests disagree ({len(counted)} (cell, δ) rows with >= {MIN_TOKENS} disagreeing "
                     f"tokens), the predictive sign is the full-vocabulary derivative's on "
                     f"{_pct(min(right))}-{_pct(max(right))}% of them: to first order, the ratio test decides "
                     "against the divergence's change there.")
    return lines


def markdown(rows: Sequence[dict], grid: str, command: str, provenance: str) -> str:
    """The README: how the cells are made, the summary lines, and per (V, delta) one table whose rows are the levers and
    columns the logit scales; a cell reads ``outside % / disagree %``."""
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
           f"- **Grid**: {grid}.",
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
    out += ["", f"Bold: the cell reaches {_pct(QUALIFYING_DISAGREEMENT)}% disagreement. The entropy row is the "
            "first lever's μ. The offset rows of a column share their positions, tokens and offset direction (σ only "
            "scales it), so it is every offset row's μ; a temperature row's μ is z/τ_s (its entropy is in "
            "`cells.csv`)."]
    return "\n".join(out) + "\n"


def spec_line(spec: MapSpec) -> str:
    """The grid in one line for the README (V and positions, K, s, sigma, tau_s, delta, seed)."""
    return (f"V ∈ {{{', '.join(map(str, spec.vocab_sizes))}}} "
            f"(positions per cell {', '.join(map(str, spec.positions))}), "
            f"K = {spec.top_k}, s ∈ {{{', '.join(f'{s:g}' for s in spec.logit_scales)}}}, "
            f"σ ∈ {{{', '.join(f'{s:g}' for s in spec.offsets)}}}, "
            f"τ_s ∈ {{{', '.join(f'{t:g}' for t in spec.temperatures)}}}, "
            f"δ ∈ {{{', '.join(f'{d:g}' for d in spec.deltas)}}} nats, seed {spec.seed}")


def run(out_dir: str, spec: MapSpec = MapSpec(), command: str = "", provenance: str = "") -> list:
    """Computes the grid and writes ``cells.csv`` and ``README.md`` under ``out_dir`` (replacing an earlier map's);
    returns the rows. ValueError: ``out_dir`` exists and is not a directory; what `cell` raises."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"out_dir {out_dir!r} exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    rows = compute(spec, progress=lambda i, n: print(f"cell {i}/{n} ({time.time() - t0:.0f} s)", flush=True))
    csv_path, readme_path = os.path.join(out_dir, "cells.csv"), os.path.join(out_dir, "README.md")
    write_csv(rows, csv_path + ".tmp")
    rows = read_csv(csv_path + ".tmp")  # the README reads what the file holds
    with open(readme_path + ".tmp", "w") as f:
        f.write(markdown(rows, spec_line(spec), command, provenance))
    os.replace(csv_path + ".tmp", csv_path)  # both files replaced only once both are written
    os.replace(readme_path + ".tmp", readme_path)
    return rows
