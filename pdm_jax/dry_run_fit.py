"""``--dry_run --config.dry_run.fit=true``: the memory knobs that fit a slice, and a step-time estimate.

`propose` searches the memory knobs of a config (micro-batch, loss chunk, remat, the rollout engine's mesh,
slots and prefill chunk; `KNOBS`) for its target (``dry_run.chip`` x ``dry_run.num_devices``) against the dry
run's ANALYTIC plan (`dry_run.analytic_plan`, `dry_run.sampler_plan`, added up as `dry_run.verdict` does; the
engine's part calibrated on XLA:TPU's compiles: its ``transient``) with `HEADROOM` left for what the formulas
miss. What a step means (prompts x samples, lengths, delta, K, learning rate) is never searched.
Among the settings that fit it prefers the most work per step: the most engine slots (rows decoded at
once), then the largest micro-batch, then the least recomputation (remat), then the largest loss chunk,
then the most prompts prefilled at once, then the widest engine mesh. Where nothing fits it raises
`NothingFits`, naming the part.

The report it prints carries `dry_run.step_time_estimate`: a LOWER BOUND on one RL step's time at the
chip's datasheet peak, never a measurement.
"""

from __future__ import annotations

import dataclasses

from pdm_jax import aot
from pdm_jax import dry_run as dr
from pdm_jax.run_spec import RunSpec, run_spec, with_overrides

GIB = dr.GIB
#: The share of HBM a proposal may fill by the analytic plan: the plan is within 11% of XLA:TPU on the v5p-128
#: recipes' train steps (8-21% under it on the small slices) and within 5% on the engine (docs/scaling.md).
HEADROOM = 0.9
#: The fields `propose` sets, in the order its overrides are printed.
KNOBS = ("rl.micro_batch_size", "rl.logits_chunk_size", "model.remat", "sampler.mesh.data", "sampler.mesh.tensor",
         "sampler.max_batch_size", "sampler.max_slots", "sampler.park_rows", "sampler.prefill_chunk")
_REMATS = ("none", "dots_saveable", "full")  # least recomputation first
_CHUNKS = (512, 256, 128)
_MIN_SLOTS = 8
_PREFILL_CHUNKS = (0, 64, 32, 16, 8, 4, 2, 1)  # sampler.prefill_chunk: prompts prefilled at once (0: all)


class NothingFits(ValueError):
    """No setting of the memory knobs fits the slice; the message names the part that does not."""


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A setting of `KNOBS` that fits, with its analytic per-device bytes.

    ``overrides``: field -> value (`KNOBS`); ``total``: per-device bytes (resident + the larger transient);
    ``hbm``: the chip's bytes; ``parts``: name -> bytes (train_resident, train_transient, sampler_resident,
    sampler_transient)."""

    overrides: dict
    total: int
    hbm: int
    parts: dict

    def flags(self) -> str:
        """The overrides as ``--config.`` flags."""
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides.items())


def _train_candidates(spec: RunSpec, model_cfg, chip: str, sizes: dict):
    """(knobs, resident bytes, transient bytes) of every micro-batch x loss chunk x remat setting."""
    base = dr.step_shape(spec, chip)
    b, dp = base.batch, sizes["data"] * sizes["fsdp"]
    micro = [0] + [m for m in (b >> i for i in range(1, 12)) if m >= 1 and b % m == 0 and m % dp == 0]
    out = []
    for remat in _REMATS:
        for m in micro:
            for chunk in _CHUNKS:
                shape = dataclasses.replace(base, remat=remat, micro_batch_size=m, logits_chunk_size=chunk)
                a = dr.analytic_plan(model_cfg, shape, sizes, dtype=spec.model.dtype,
                                     param_dtype=spec.model.param_dtype)
                resident = a["params"] + a["optimizer"] + a["batch"]
                out.append(({"rl.micro_batch_size": m, "rl.logits_chunk_size": chunk, "model.remat": remat},
                            resident, a["total"] - resident, a))
    return out


def _sampler_candidates(spec: RunSpec, model_cfg, chip: str, num_devices: int):
    """(knobs, resident bytes, transient bytes, sampler plan) of every engine mesh x slots setting that the
    engine accepts (`dry_run.sampler_plan` refuses the others)."""
    per_host = aot.chips_per_host(chip, num_devices)
    out = []
    for t in (8, 4, 2, 1):
        if t > per_host:
            continue
        slots = 1 << 12
        while slots >= _MIN_SLOTS:
            refused, seen = False, set()
            for chunk in _PREFILL_CHUNKS:  # the whole store at once first
                c = spec._replace(sampler=dataclasses.replace(
                    spec.sampler, mesh_data=1, mesh_tensor=t, max_batch_size=slots, max_slots=0,
                    engine=dataclasses.replace(spec.sampler.engine, park_rows=0, prefill_chunk=chunk)))
                try:
                    sp = dr.sampler_plan(c, model_cfg, num_devices, chip, per_host=per_host)
                except ValueError:
                    refused = True
                    break
                if slots > max(sp["request_prompts"] * spec.rl.group_size, _MIN_SLOTS):  # slots no row fills
                    break
                if sp["prefill_chunk"] in seen:  # the chunk a larger setting already gave (the whole store)
                    continue
                seen.add(sp["prefill_chunk"])
                out.append(({"sampler.mesh.data": 1, "sampler.mesh.tensor": t, "sampler.max_batch_size": slots,
                             "sampler.max_slots": 0, "sampler.park_rows": 0, "sampler.prefill_chunk": chunk},
                            sp["weights"], sp["transient"], sp))
            if refused:
                break
            slots //= 2
    return out


def _parts_line(parts: dict) -> str:
    names = dict(train_resident="weights + AdamW state + batch", train_transient="the train step's transient "
                 "buffers (gradients, gathered weights, activations, loss)", sampler_resident="the rollout engine's "
                 "weights", sampler_transient="the engine's KV cache, prompt store, rollouts and prefill or compaction")
    return ", ".join(f"{names[k]} {v / GIB:.2f}" for k, v in parts.items())


def propose(spec, *, chip: str | None = None, num_devices: int | None = None) -> Proposal:
    """The setting of `KNOBS` with the most work per step that fits ``chip`` x ``num_devices`` (default the
    run's ``dry_run.chip`` / ``num_devices``) by the analytic plan within `HEADROOM` of HBM. ``spec``: the run's
    `pdm_jax.run_spec.RunSpec`, or a run ConfigDict (read by ``run_spec(config, dry_run=True)``).

    Raises:
      NothingFits: no setting fits; the message names the part (e.g. "weights + AdamW state + gradients
        need 141.2 of 72.0 GiB") and the figures of the smallest setting.
      ValueError: a config error (naming the field).
    """
    spec = spec if isinstance(spec, RunSpec) else run_spec(spec, dry_run=True)
    chip = chip or spec.dry_run.chip
    num_devices = int(num_devices or spec.dry_run.num_devices)
    hbm = aot.CHIP_HBM_GIB[chip] * GIB
    room = int(HEADROOM * hbm)
    model_cfg = dr.resolve_model_config(spec)
    sizes = dr.mesh_sizes(spec, num_devices)
    trains = _train_candidates(spec, model_cfg, chip, sizes)
    samplers = _sampler_candidates(spec, model_cfg, chip, num_devices)
    where = f"{num_devices} x {chip} ({room / GIB:.1f} of {hbm / GIB:.0f} GiB per chip: HEADROOM {HEADROOM})"
    smallest = min(trains, key=lambda x: x[1] + x[2])
    a = smallest[3]
    fixed = a["params"] + a["optimizer"] + a["gradients"]
    if fixed > room:
        raise NothingFits(f"nothing fits {where}: weights + AdamW state + gradients need {fixed / GIB:.2f} GiB per "
                          f"chip ({a['params'] / GIB:.2f} + {a['optimizer'] / GIB:.2f} + {a['gradients'] / GIB:.2f}, "
                          "analytic)")
    if not samplers:
        raise NothingFits(f"nothing fits {where}: no rollout engine mesh the engine accepts on a host's chips")
    colocated = samplers[0][3]["colocated"]
    best, best_key, least = None, None, None
    for tk, tr, tt, _ in trains:
        for sk, sr, st, sp in samplers:
            total = tr + sr + max(tt, st) if colocated else max(tr + tt, sr + st)
            parts = dict(train_resident=tr, train_transient=tt, sampler_resident=sr, sampler_transient=st)
            if least is None or total < least[0]:
                least = (total, parts)
            if total > room:
                continue
            m = tk["rl.micro_batch_size"] or dr.step_shape(spec, chip).batch
            key = (sk["sampler.max_batch_size"], m, -_REMATS.index(tk["model.remat"]), tk["rl.logits_chunk_size"],
                   sp["prefill_chunk"], sk["sampler.mesh.tensor"])
            if best_key is None or key > best_key:
                best_key, best = key, Proposal(overrides={k: {**tk, **sk}[k] for k in KNOBS}, total=int(total),
                                               hbm=hbm, parts=parts)
    if best is None:
        total, parts = least
        biggest = max(parts, key=parts.get)
        raise NothingFits(f"nothing fits {where}: at the smallest setting the parts need {total / GIB:.2f} GiB per "
                          f"chip ({_parts_line(parts)}; the largest: {biggest})")
    return best


def smallest_fitting_slice(spec):
    """The slice of `aot.SLICES` with the least HBM in all (chips x HBM per chip) on which `propose` finds a
    setting for ``spec`` (a `RunSpec` or a run ConfigDict), or None."""
    spec = spec if isinstance(spec, RunSpec) else run_spec(spec, dry_run=True)
    for name, (chip, n) in sorted(aot.SLICES.items(), key=lambda kv: kv[1][1] * aot.CHIP_HBM_GIB[kv[1][0]]):
        try:
            propose(spec, chip=chip, num_devices=n)
            return name
        except ValueError:  # NothingFits, or a layout the slice refuses (e.g. prompts per host)
            continue
    return None


def main(config) -> dict:
    """``--dry_run`` with ``dry_run.fit``: prints the proposal as ``--config.`` overrides, then the dry run of the
    config with them (compiled where ``dry_run.compiler`` resolves to the chip's own compiler, else analytic).

    Raises:
      NothingFits: nothing fits (the message names the part).
    """
    spec = run_spec(config, dry_run=True)
    try:
        proposal = propose(spec)
    except NothingFits as e:
        fits = smallest_fitting_slice(spec) or "none of " + str(list(aot.SLICES))
        raise NothingFits(f"{e}; smallest slice that fits: {fits}") from None
    fitted = run_spec(with_overrides(config, proposal.overrides), dry_run=True)
    chip = fitted.dry_run.chip
    print(f"FIT for {fitted.dry_run.num_devices} x {chip} (analytic, within {HEADROOM:.0%} of HBM): "
          f"{proposal.total / GIB:.2f} of {proposal.hbm / GIB:.0f} GiB per chip; most engine slots, then micro-batch",
          flush=True)
    print(f"  {proposal.flags()}", flush=True)
    compiler = fitted.dry_run.compiler
    confirm = compiler != "none" and aot.resolve_compiler(compiler, chip) == aot.chip_platform(chip)
    print("  confirming with the chip's compiler ..." if confirm else
          "  (not compiled: the chip's compiler is not installed or dry_run.compiler = none; the figures below are "
          "the analytic plan's)", flush=True)
    report = dr.plan(fitted, compiler=compiler if confirm else "none")
    print(dr.format_report(report), flush=True)
    return report
