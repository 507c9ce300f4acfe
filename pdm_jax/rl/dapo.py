"""DAPO's data-side pieces (arXiv 2503.14476): overlong reward shaping, overlong filtering, group filtering.

Pure numpy functions of a scored rollout batch (dynamic sampling's rounds live in
`pdm_jax.rollouts.dynamic_sampling`). Each piece is off in a `DapoSpec()` (the schema's defaults), and then every
function returns its input unchanged.

* **Overlong reward shaping** (§3.4, eq. 13): with L_max = ``rl.overlong_max_length`` (0: ``rl.max_new_tokens``) and
  L_cache = ``rl.overlong_buffer_len``, a completion of |y| tokens (stop token included) adds to its task reward
  ``rl.overlong_penalty_factor`` times

      R_length(y) = 0                                  if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                  = -1                                 if |y| > L_max

  (verl's ``reward_model.overlong_buffer``).
* **Overlong filtering** (§3.4): a truncated completion (``finish_reason == "length"``) gets a zeroed loss mask but
  still counts in its group's advantage baseline.
* **Dynamic sampling** (§3.2, eq. 11): groups whose training rewards are all equal (all-zero advantages) are dropped:
  :func:`informative_groups`, :func:`choose_groups`."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from pdm_jax.rollout import RolloutBatch

#: The finish reason of a truncated completion (`pdm_jax.rollout.FINISH_REASONS`).
TRUNCATED = "length"


class DapoSpec(NamedTuple):
    """The DAPO pieces of a run (built by `pdm_jax.run_spec` from ``config.rl``); the defaults turn all off.

    Fields:
      dynamic_sampling: ``rl.dynamic_sampling``.
      max_rounds: ``rl.dynamic_sampling_max_rounds``, sampling rounds per RL step (>= 1).
      overlong_max_length: L_max of eq. 13 in tokens (``rl.overlong_max_length``, or ``rl.max_new_tokens`` when 0).
      overlong_buffer_len: L_cache of eq. 13 in tokens; 0 = no shaping.
      overlong_penalty_factor: the penalty's scale (eq. 13: 1).
      overlong_filtering: ``rl.overlong_filtering``."""

    dynamic_sampling: bool = False
    max_rounds: int = 1
    overlong_max_length: int = 0
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    overlong_filtering: bool = False

    @property
    def shaping(self) -> bool:
        """Whether the overlong reward shaping is on (L_cache > 0)."""
        return self.overlong_buffer_len > 0


def length_penalty(lengths, *, max_length: int, buffer_len: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment R_length (arXiv 2503.14476 eq. 13) times ``factor``.

    Args:
      lengths: ``[N]`` int completion lengths |y| in tokens (``completion_mask.sum(1)``).
      max_length: L_max (tokens), >= ``buffer_len``.
      buffer_len: L_cache (tokens), >= 1.
      factor: finite and >= 0.
    Returns:
      ``[N]`` float32 in [-factor, 0].
    Raises:
      ValueError: ``buffer_len < 1``, ``max_length < buffer_len``, a bad ``factor`` or a negative length."""
    lengths = np.asarray(lengths)
    if not (isinstance(buffer_len, (int, np.integer)) and buffer_len >= 1):
        raise ValueError(f"rl.overlong_buffer_len (L_cache) = {buffer_len!r}: must be an integer >= 1 here")
    if not (isinstance(max_length, (int, np.integer)) and max_length >= buffer_len):
        raise ValueError(f"rl.overlong_max_length (L_max) = {max_length!r}: must be an integer >= "
                         f"rl.overlong_buffer_len (L_cache) = {buffer_len}")
    if not (np.isfinite(factor) and factor >= 0):
        raise ValueError(f"rl.overlong_penalty_factor = {factor!r}: must be finite and >= 0")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"completion lengths must be >= 0, got {int(lengths.min())}")
    expected = max_length - buffer_len  # L_max - L_cache: the longest unpunished completion
    ramp = (expected - lengths.astype(np.float64)) / buffer_len
    r = np.where(lengths <= expected, 0.0, np.where(lengths <= max_length, ramp, -1.0))
    return (r * factor).astype(np.float32)


def training_rewards(rb: RolloutBatch, spec: DapoSpec) -> np.ndarray:
    """``[N]`` float32 rewards for the group advantages: ``rb.rewards`` plus eq. 13's penalty (the same array when
    ``spec.overlong_buffer_len`` is 0); ValueError when ``rb`` has no rewards."""
    if rb.rewards is None:
        raise ValueError("training_rewards needs a scored RolloutBatch (rewards is None)")
    if not spec.shaping:
        return rb.rewards
    penalty = length_penalty(rb.completion_mask.sum(axis=1), max_length=spec.overlong_max_length,
                             buffer_len=spec.overlong_buffer_len, factor=spec.overlong_penalty_factor)
    return (rb.rewards + penalty).astype(np.float32)


def truncated_rows(rb: RolloutBatch) -> np.ndarray:
    """``[N]`` bool: the completions that hit ``max_new_tokens`` without a stop token (finish_reason "length")."""
    return np.asarray(rb.finish_reason == TRUNCATED, bool)


def no_loss_rows(rb: RolloutBatch, spec: DapoSpec, filler: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """``[N]`` bool rows whose loss mask is zeroed (truncated rows with ``spec.overlong_filtering``, and dynamic
    sampling's ``filler`` rows), or None when there is none."""
    rows = np.zeros(rb.num_sequences, bool)
    if spec.overlong_filtering:
        rows |= truncated_rows(rb)
    if filler is not None:
        rows |= np.asarray(filler, bool)
    return rows if rows.any() else None


def without_loss(rb: RolloutBatch, rows: Optional[np.ndarray]) -> RolloutBatch:
    """``rb`` with the completion mask of ``rows`` (``[N]`` bool, or None) all False: out of the loss, its denominator,
    the packed rows and the per-token metrics; reward and advantage kept."""
    if rows is None:
        return rb
    rows = np.asarray(rows, bool)
    if rows.shape != (rb.num_sequences,):
        raise ValueError(f"without_loss: rows has shape {rows.shape}, expected ({rb.num_sequences},)")
    return rb.replace(completion_mask=rb.completion_mask & ~rows[:, None])


def informative_groups(rewards, group_size: int) -> np.ndarray:
    """``[N / G]`` bool: True for each group (prompt-major rows) whose rewards are not all equal (DAPO eq. 11: 0 <
    |correct| < G for 0/1 rewards).

    Raises:
      ValueError: rewards not 1-D or N not a multiple of ``group_size``."""
    r = np.asarray(rewards)
    if r.ndim != 1 or group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards of shape {r.shape} are not whole groups of group_size = {group_size}")
    g = r.reshape(-1, group_size)
    return np.any(g != g[:, :1], axis=1)


class GroupChoice(NamedTuple):
    """Which groups of a step's sampling rounds it trains on (:func:`choose_groups`).

    Fields:
      kept: ``[(round, group)]``, the informative groups trained on, in draw order.
      filler: ``[(round, group)]``, all-equal groups filling the remaining places at the bound (loss masked).
      dropped: all-equal groups drawn over the rounds (the filler included).
      surplus: informative groups drawn beyond ``prompts_per_step``."""

    kept: list
    filler: list
    dropped: int
    surplus: int


def choose_groups(informative: Sequence[np.ndarray], prompts_per_step: int) -> GroupChoice:
    """A step's groups from its rounds' informative flags: the first ``prompts_per_step`` informative groups in draw
    order, then all-equal filler groups (zeroed loss mask) so the step keeps its static row count; verl's recipe
    (``algorithm.filter_groups``) raises at its bound instead.

    Raises:
      ValueError: fewer groups drawn than ``prompts_per_step``."""
    flags = [(r, g, bool(f)) for r, round_flags in enumerate(informative) for g, f in enumerate(round_flags)]
    if len(flags) < prompts_per_step:
        raise ValueError(f"choose_groups: {len(flags)} groups drawn, fewer than prompts_per_step = {prompts_per_step}")
    good = [(r, g) for r, g, f in flags if f]
    equal = [(r, g) for r, g, f in flags if not f]
    kept = good[:prompts_per_step]
    return GroupChoice(kept=kept, filler=equal[:prompts_per_step - len(kept)], dropped=len(equal),
                       surplus=max(len(good) - prompts_per_step, 0))


def round_seed(step_seed: int, round_: int) -> int:
    """The sampler seed of round ``round_`` of a step: ``step_seed`` for round 0 (a run without dynamic sampling draws
    as before), else a seed in [0, 2**63) derived from both (`numpy.random.SeedSequence`), the same on resume."""
    if round_ == 0:
        return int(step_seed)
    state = np.random.SeedSequence([int(step_seed), int(round_)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def record_rows(rb: RolloutBatch, spec: DapoSpec) -> dict:
    """Per-row fields the step's record needs besides rewards and lengths: ``truncated`` with overlong filtering
    (gathered over the processes with the others), else nothing."""
    return dict(truncated=truncated_rows(rb)) if spec.overlong_filtering else {}


def step_record(rows: dict, spec: DapoSpec, sampled: Optional[dict] = None) -> dict:
    """The ``rl`` record's DAPO fields (docs/metrics.md), none when every piece is off, from the step's per-row ``rows``
    (all processes), the run's `DapoSpec` and dynamic sampling's ``sampled`` counts."""
    out = {}
    if spec.shaping:
        out["overlong_penalty"] = float(np.mean(length_penalty(
            rows["length"], max_length=spec.overlong_max_length, buffer_len=spec.overlong_buffer_len,
            factor=spec.overlong_penalty_factor)))
    if spec.overlong_filtering:
        out["overlong_filtered"] = float(np.mean(rows["truncated"]))
    if sampled is not None:
        out.update(dynamic_sampling_rounds=float(sampled["rounds"]),
                   dynamic_sampling_dropped_groups=float(sampled["dropped"]),
                   dynamic_sampling_filler_groups=float(sampled["filler"]),
                   dynamic_sampling_surplus_groups=float(sampled["surplus"]))
    return out
