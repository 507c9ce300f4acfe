"""Your own reward functions, from the config (``reward.functions``; TRL's ``reward_funcs`` convention).

Each comma-separated entry is ``FILE.py:NAME`` (loaded by path) or ``module:NAME``, naming a callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

called once per rollout (and evaluation) batch, one entry per completion, prompt-major (row ``i`` is sample ``i % n``
of prompt ``i // n``). ``prompts[i]`` is the prompt as the source holds it (text, or a file prompt's chat messages),
``completions[i]`` the decoded completion; ``columns``: the example's other fields (a file's columns; ``answer`` for
the built-in kinds), ``completion_ids`` (stop token excluded) and ``truncated``, as lists. Take ``**kwargs``.

A row's reward is ``sum_f w_f * r_f`` over the functions that gave it a number (``reward.weights``, 1 each); ``None``
adds nothing, and a row every function left ``None`` gets its group's scored mean (advantage 0) and is counted
(``reward_unscored``). With functions given the data source's verifier is not added unless
``pdm_jax.rewards:verifier`` is one of them. A function that raises, hangs past ``reward.timeout_s`` (it runs in a
daemon thread, abandoned on a hang), or returns the wrong length, a non-number or a non-finite number raises
`RewardFunctionError` (exit 2) naming the function and the row; nothing is replaced by 0. Source: TRL ``GRPOTrainer``
(``reward_funcs``, ``reward_weights``, None summed as NaN with ``nansum``); the all-None rule is this module's own."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import threading
from typing import Any, Callable

import numpy as np

from pdm_jax import evaluation

__all__ = ["RewardFunctionError", "RewardFunctions", "RewardSpec", "RewardedSource", "function_record", "function_rows",
           "parse_functions", "parse_weights", "score_batch", "score_rollouts", "verifier", "with_reward_functions"]

#: Prefix of the per-function means in the rl record (``reward/NAME``).
PREFIX = "reward/"
BUILTIN_VERIFIER = "pdm_jax.rewards:verifier"


class RewardFunctionError(ValueError):
    """A reward function failed: raised, hung, or returned a bad value (the message names it; the run exits 2)."""


def parse_functions(text: str) -> tuple:
    """``reward.functions`` as a tuple of ``"TARGET:NAME"`` entries ("" -> ()); ValueError (naming the field) for an
    entry without ``:NAME`` or a target, or a NAME given twice."""
    text = str(text).strip()
    if not text:
        return ()
    entries = tuple(part.strip() for part in text.split(","))
    names = []
    for entry in entries:
        target, _, name = entry.rpartition(":")
        if not target or not name.isidentifier():
            raise ValueError(f"reward.functions = {text!r}: entry {entry!r} is not FILE.py:NAME or module:NAME")
        if name in names:
            raise ValueError(f"reward.functions = {text!r}: the name {name!r} is given twice (its metric "
                             f"reward/{name} would be ambiguous)")
        names.append(name)
    return entries


def parse_weights(text: str, count: int) -> tuple:
    """``reward.weights`` as ``count`` floats ("" -> 1.0 each); ValueError for a non-finite weight or a count other than
    ``count``."""
    text = str(text).strip()
    if not text:
        return (1.0,) * count
    weights = []
    for part in text.split(","):
        try:
            weight = float(part)
        except ValueError:
            raise ValueError(f"reward.weights = {text!r}: {part.strip()!r} is not a number") from None
        if not math.isfinite(weight):
            raise ValueError(f"reward.weights = {text!r}: {part.strip()!r} is not finite")
        weights.append(weight)
    if len(weights) != count:
        raise ValueError(f"reward.weights = {text!r}: {len(weights)} weights for the {count} reward.functions")
    return tuple(weights)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """The ``reward`` section of a validated config: ``functions`` (``"TARGET:NAME"`` entries; () = the data source's
    verifier), ``weights`` (one float per function), ``timeout_s`` (seconds one function may take on one batch)."""

    functions: tuple
    weights: tuple
    timeout_s: float

    @classmethod
    def from_config(cls, reward) -> "RewardSpec":
        """The spec of a validated config's ``reward`` section.

        Raises:
          ValueError: a bad ``reward.functions`` / ``reward.weights`` (`parse_functions`, `parse_weights`)."""
        functions = parse_functions(reward.functions)
        return cls(functions=functions, weights=parse_weights(reward.weights, len(functions)),
                   timeout_s=float(reward.timeout_s))


def verifier(prompts, completions, **columns):
    """The run's built-in verifier as a reward function (``pdm_jax.rewards:verifier`` in ``reward.functions``), bound to
    the run's data source when loaded; called directly it raises `RewardFunctionError`."""
    raise RewardFunctionError(f"{BUILTIN_VERIFIER} scores with the run's data source: name it in reward.functions "
                              "instead of calling it")


class _SourceVerifier:
    """`verifier` bound to a data source: its ``score_batch`` (or ``score``) of each row's example."""

    def __init__(self, source):
        self.source = source

    def __call__(self, completions, examples, truncated):
        if hasattr(self.source, "score_batch"):
            return list(self.source.score_batch(completions, examples, truncated=truncated))
        return [self.source.score(c, e, truncated=t) for c, e, t in zip(completions, examples, truncated)]


def _load(entry: str) -> Callable:
    """The callable an entry names (a ``.py`` file loaded by path, else an importable module)."""
    target, _, name = entry.rpartition(":")
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise RewardFunctionError(f"reward.functions: {target!r}: no such file")
        # A module name of its own per file, so two files of the same name do not replace each other.
        digest = hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(f"pdm_jax_reward_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            raise RewardFunctionError(f"reward.functions: loading {target!r} raised {type(err).__name__}: "
                                      f"{err}") from err
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise RewardFunctionError(f"reward.functions: cannot import {target!r}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward.functions: {target!r} has no function {name!r}")
    return fn


def _call(name: str, fn: Callable, timeout_s: float, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` in a daemon thread, waited for at most ``timeout_s`` seconds (module docstring)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=f"reward/{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardFunctionError(f"reward function {name!r} did not return within reward.timeout_s = "
                                  f"{timeout_s:g} s (a batch of {len(args[-1])} completions; it is left running "
                                  "and the run stops)")
    if "error" in box:
        err = box["error"]
        raise RewardFunctionError(f"reward function {name!r} raised {type(err).__name__}: {err}") from err
    return box["value"]


def _check_values(name: str, values: Any, prompts: list, n: int) -> np.ndarray:
    """A function's output as float64 ``[N]`` (NaN = None), or a RewardFunctionError naming the bad row."""
    count = len(prompts)
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function {name!r} returned {type(values).__name__} {values!r:.100}, not a "
                                  f"list of {count} numbers or None")
    values = list(values)
    if len(values) != count:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for {count} completions")
    out = np.full((count,), np.nan)
    for row, value in enumerate(values):
        if value is None:
            continue
        where = f"row {row} (prompt {row // n}, sample {row % n}: {str(prompts[row])!r:.80})"
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"reward function {name!r} returned {value!r:.100} ({type(value).__name__}) "
                                      f"for {where}: not a number or None")
        if not math.isfinite(float(value)):
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} for {where}: not a finite "
                                      "number (None means no reward from this function)")
        out[row] = float(value)
    return out


def combine(scores: np.ndarray, weights, n: int) -> tuple:
    """The rewards of a batch from its per-function scores.

    Args:
      scores: float ``[F, N]``, NaN where a function gave None; rows prompt-major, ``n`` per prompt.
      weights: ``F`` floats.
      n: samples per prompt.

    Returns:
      ``(rewards float32 [N], unscored bool [N])``: ``sum_f w_f * scores[f, i]`` over the scored entries; an unscored
        row
      gets its group's scored mean (0.0 when there is none)."""
    scores = np.asarray(scores, np.float64)
    given = ~np.isnan(scores)
    total = np.sum(np.where(given, scores, 0.0) * np.asarray(weights, np.float64)[:, None], axis=0)
    unscored = ~given.any(axis=0)
    if unscored.any():
        groups, scored = total.reshape(-1, n), ~unscored.reshape(-1, n)
        counts = scored.sum(1)
        means = np.where(counts > 0, np.where(scored, groups, 0.0).sum(1) / np.maximum(counts, 1), 0.0)
        total = np.where(unscored, np.repeat(means, n), total)
    return total.astype(np.float32), unscored


class RewardFunctions:
    """The loaded ``reward.functions`` of a run (`spec`: the run's `RewardSpec`, at least one function; `source`: the
    run's data source, bound to `verifier`); `RewardFunctionError` for an entry that cannot be loaded."""

    def __init__(self, spec: RewardSpec, source):
        if not spec.functions:
            raise ValueError("RewardFunctions needs at least one reward.functions entry")
        self.spec = spec
        self.names = tuple(entry.rpartition(":")[2] for entry in spec.functions)
        self.functions = tuple(_SourceVerifier(source) if fn is verifier else fn
                               for fn in (_load(entry) for entry in spec.functions))

    def __call__(self, prompts: list, completions: list, columns: dict, examples: list, n: int) -> tuple:
        """Scores one batch: ``(rewards float32 [N], rows)``, ``rows`` holding ``reward/NAME`` float32 ``[N]`` (NaN
        where NAME gave None) per function and ``reward_unscored`` float32 ``[N]``; raises `RewardFunctionError`."""
        scores = []
        for name, fn in zip(self.names, self.functions):
            if isinstance(fn, _SourceVerifier):
                args, kwargs = (completions, examples, columns["truncated"]), {}
            else:
                args, kwargs = (list(prompts), list(completions)), {k: list(v) for k, v in columns.items()}
            values = _call(name, fn, self.spec.timeout_s, args, kwargs)
            scores.append(_check_values(name, values, prompts, n))
        rewards, unscored = combine(np.stack(scores), self.spec.weights, n)
        rows = {PREFIX + name: s.astype(np.float32) for name, s in zip(self.names, scores)}
        rows["reward_unscored"] = unscored.astype(np.float32)
        return rewards, rows


def _columns(examples: list) -> dict:
    """The example fields as lists (one per row): a file row's columns, else ``answer``."""
    per_row = [dict((e.meta or {}).get("columns") or {"answer": e.answer}) for e in examples]
    names = list(dict.fromkeys(k for row in per_row for k in row))
    return {k: [row.get(k) for row in per_row] for k in names}


#: Rows whose function values `RewardedSource` keeps for `function_rows` (the newest; a few steps of
#: dynamic sampling's rounds).
KEPT_ROWS = 1 << 18


class RewardedSource:
    """A data source whose rollouts are scored by the user's `RewardFunctions` (`with_reward_functions`); its
    `score_rollout_batch` also keeps the newest `KEPT_ROWS` rows' function values for `kept_rows`."""

    def __init__(self, source, functions: RewardFunctions):
        self.source = source
        self.reward_functions = functions
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getattr__(self, name):
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    def score_rollout_batch(self, codec, rb, examples, n: int) -> tuple:
        """``(rewards float32 [N], rows)`` of a `RolloutBatch` whose row ``i`` belongs to ``examples[i // n]``
        (`RewardFunctions.__call__`)."""
        ids = [[int(t) for t, m in zip(rb.completion_ids[i], rb.completion_mask[i]) if m and int(t) not in
                codec.stop_ids] for i in range(rb.num_sequences)]
        texts = [codec.decode_completion(rb.completion_ids[i], rb.completion_mask[i]) for i in range(rb.num_sequences)]
        exs = [examples[i // n] for i in range(rb.num_sequences)]
        columns = dict(_columns(exs), completion_ids=ids, truncated=[str(r) == "length" for r in rb.finish_reason])
        rewards, rows = self.reward_functions([e.prompt for e in exs], texts, columns, exs, n)
        values = np.stack([rows[key] for key in sorted(rows)], axis=1)
        with self._lock:
            for key, value in zip(self._row_keys(rb, exs), values):
                self._kept[key] = value
                self._kept.move_to_end(key)
            while len(self._kept) > KEPT_ROWS:
                self._kept.popitem(last=False)
        return rewards, rows

    @staticmethod
    def _row_keys(rb, exs) -> list:
        return [(str(e.uid), tuple(int(t) for t, m in zip(rb.completion_ids[i], rb.completion_mask[i]) if m),
                 str(rb.finish_reason[i])) for i, e in enumerate(exs)]

    def kept_rows(self, codec, rb, examples, n: int) -> dict:
        """The function values (`RewardFunctions.__call__`'s ``rows``) that `score_rollout_batch` gave the rows of
        ``rb`` (row ``i`` of ``examples[i // n]``) when it scored them.

        Raises:
          RuntimeError: a row it did not score (or scored more than `KEPT_ROWS` rows ago)."""
        names = sorted([PREFIX + name for name in self.reward_functions.names] + ["reward_unscored"])
        exs = [examples[i // n] for i in range(rb.num_sequences)]
        with self._lock:
            found = [self._kept.get(key) for key in self._row_keys(rb, exs)]
        missing = [i for i, value in enumerate(found) if value is None]
        if missing:
            raise RuntimeError(f"reward functions: row {missing[0]} of the batch ({exs[missing[0]].uid}) was not "
                               "scored by them")
        values = np.stack(found) if found else np.zeros((0, len(names)), np.float32)
        return {name: values[:, j] for j, name in enumerate(names)}


def with_reward_functions(source, spec: RewardSpec):
    """``source`` scored by ``spec``'s functions (a `RewardedSource`), or ``source`` itself when there are none.

    Raises:
      RewardFunctionError: a function that cannot be loaded.
    """
    return RewardedSource(source, RewardFunctions(spec, source)) if spec.functions else source


def score_rollouts(source, codec, rb, examples, n: int) -> tuple:
    """The trainer's scoring of a rollout batch: ``(rewards float32 [N], rows)``.

    A `RewardedSource`: its functions' combined rewards and per-row values (`RewardFunctions.__call__`); any other
    source: `evaluation.score_rollouts` (the built-in verifier) and no rows.
    """
    if isinstance(source, RewardedSource):
        return source.score_rollout_batch(codec, rb, examples, n)
    return evaluation.score_rollouts(source, codec, rb, examples, n), {}


def score_batch(source, codec, rb, examples, n: int, *, scored: bool = False) -> tuple:
    """The trainer's scoring step: ``(rb with its rewards, rows)``.

    ``scored``: dynamic sampling already scored ``rb``'s rows in its rounds (`pdm_jax.rollouts.dynamic_sampling`):
    ``rb`` is kept and ``rows`` are the values those rounds gave (`function_rows`). Otherwise the rewards are
    `score_rollouts`' (the reward functions', or the source's verifier).
    """
    if scored:
        return rb, function_rows(source, codec, rb, examples, n)
    rewards, rows = score_rollouts(source, codec, rb, examples, n)
    return rb.replace(rewards=rewards), rows


def function_rows(source, codec, rb, examples, n: int) -> dict:
    """The reward functions' per-row values of a batch scored earlier (`RewardedSource.kept_rows`; the rows dynamic
    sampling kept from its rounds), or {} for a source without reward functions."""
    if isinstance(source, RewardedSource):
        return source.kept_rows(codec, rb, examples, n)
    return {}


def function_record(rows: dict) -> dict:
    """The rl record's reward-function fields of a step's ``rows`` (empty without reward functions).

    ``reward/NAME``: mean of NAME's values over the rows it scored (NaN, written as null, when it scored none);
    ``reward_unscored``: rows to which every function gave None (count).
    """
    if "reward_unscored" not in rows:
        return {}
    out = {}
    for key, values in rows.items():
        if key.startswith(PREFIX):
            values = np.asarray(values, np.float64)
            given = values[~np.isnan(values)]
            out[key] = float(given.mean()) if given.size else float("nan")
    out.update(reward_unscored=float(np.sum(rows["reward_unscored"])))
    return out

