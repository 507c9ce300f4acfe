"""`DynamicSampler`: DAPO's dynamic sampling (arXiv 2503.14476 §3.2) as the `RolloutProducer`'s ``make_batch``.

An RL step's rollouts are gathered in rounds of ``rl.prompts_per_step`` prompts x ``rl.group_size`` samples, keeping
groups whose training rewards (`pdm_jax.rl.dapo.training_rewards`) are not all equal, until the step holds
``prompts_per_step`` informative groups (the surplus is counted, not trained on) or
``rl.dynamic_sampling_max_rounds`` rounds are used; then the places left are filled with the first all-equal groups,
loss mask zeroed, so the step keeps its static shape (``dynamic_sampling_filler_groups``). Rounds consume the data
stream in order, round r of step s uses `pdm_jax.rl.dapo.round_seed` of (s, r) and the position after a step
(:attr:`Draw.data_end`) is checkpointed, so a resumed run draws the same prompts with the same seeds. Steps are
gathered strictly in order."""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import numpy as np

from pdm_jax.rl import dapo
from pdm_jax.rollout import RolloutBatch

log = logging.getLogger("pdm_jax.dynamic_sampling")


class Draw(NamedTuple):
    """What dynamic sampling adds to a step's ``(rollouts, examples, seconds)``.

    Fields:
      data_end: the data position after the step's last round.
      filler: ``[N]`` bool rows of filler groups (loss mask zeroed), or None.
      counts: ``rounds`` used, all-equal groups ``dropped``, ``filler`` groups, informative ``surplus`` groups."""

    data_end: int
    filler: Optional[np.ndarray]
    counts: dict


def refuse_per_host(spec: dapo.DapoSpec, per_host: bool) -> None:
    """Raises ValueError naming ``rl.dynamic_sampling`` when it is on with per-host rollouts: each process samples only
    its own prompts, and the choice of groups would need every process's rewards."""
    if spec.dynamic_sampling and per_host:
        raise ValueError("rl.dynamic_sampling = True: not implemented with per-host rollouts (several processes "
                         "and sampler.per_host_rollouts); set sampler.per_host_rollouts = False")


class DynamicSampler:
    """``step -> (RolloutBatch, examples, generation seconds, Draw)`` in sampling rounds.

    Args:
      spec: the run's `DapoSpec` (``dynamic_sampling`` on, ``max_rounds`` >= 1).
      draw: ``(data position, step, round) -> (RolloutBatch [P x G rows], examples [P], seconds)``.
      score: ``(RolloutBatch, examples) -> [P x G]`` task rewards.
      prompts_per_step: P; group_size: G.
      first_step: the first RL step to gather; position: its first prompt's data position.
    Returns (call): the step's P x G scored rows (group ids 0..P-1), the P examples, the rounds' generation seconds
    and its `Draw`; RuntimeError for a step asked for out of order."""

    def __init__(self, spec: dapo.DapoSpec, *, draw: Callable, score: Callable, prompts_per_step: int,
                 group_size: int, first_step: int, position: int):
        if not spec.max_rounds >= 1:
            raise ValueError(f"rl.dynamic_sampling_max_rounds = {spec.max_rounds!r}: must be >= 1")
        self.spec = spec
        self._draw, self._score = draw, score
        self.prompts, self.group_size = int(prompts_per_step), int(group_size)
        self._step, self._position = int(first_step), int(position)

    def __call__(self, step: int):
        if step != self._step:
            raise RuntimeError(f"dynamic sampling gathers RL steps in order: asked for step {step}, "
                               f"expected {self._step}")
        rounds, flags, seconds = [], [], 0.0
        for r in range(self.spec.max_rounds):
            rb, examples, sec = self._draw(self._position, step, r)
            self._position += self.prompts
            seconds += sec
            rb = rb.replace(rewards=self._score(rb, examples))
            rounds.append((rb, list(examples)))
            flags.append(dapo.informative_groups(dapo.training_rewards(rb, self.spec), self.group_size))
            if sum(int(f.sum()) for f in flags) >= self.prompts:
                break
        choice = dapo.choose_groups(flags, self.prompts)
        batch, examples = self._assemble(rounds, choice.kept + choice.filler)
        filler = None
        if choice.filler:
            filler = np.repeat(np.arange(self.prompts) >= len(choice.kept), self.group_size)
            log.warning("dynamic sampling: RL step %d holds %d informative groups of %d after %d rounds "
                        "(rl.dynamic_sampling_max_rounds); %d all-equal groups fill it with no loss",
                        step + 1, len(choice.kept), self.prompts, len(rounds), len(choice.filler))
        self._step += 1
        counts = dict(rounds=len(rounds), dropped=choice.dropped, filler=len(choice.filler), surplus=choice.surplus)
        return batch, examples, seconds, Draw(data_end=self._position, filler=filler, counts=counts)

    def _assemble(self, rounds, groups):
        """The rows of ``groups`` ([(round, group)]) in that order, one `RolloutBatch` with group ids 0.."""
        g = self.group_size
        parts, examples = [], []
        for r, grp in groups:
            rb, exs = rounds[r]
            parts.append(rb.select(np.arange(grp * g, (grp + 1) * g)))
            examples.append(exs[grp])
        batch = parts[0] if len(parts) == 1 else RolloutBatch.concatenate(parts)
        return batch.replace(group_ids=np.repeat(np.arange(len(groups), dtype=np.int32), g)), examples
