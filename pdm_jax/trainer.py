"""The RL loop: prompts -> sampler -> rewards -> advantages -> jitted steps -> weights push.

One `Trainer` owns the side effects of a run (DESIGN.md §3): the orbax
checkpoints, metrics files, the warm start and evaluation, and a
`SamplerSupervisor` that owns the sampler (process, restarts, weights versions).
The math lives in the pure functions of `pdm_jax.rl` (the step, the loss, the masks);
the run config is checked and read into the typed records the trainer takes by `pdm_jax.run_spec`.

Phases of a run (all resumable from ``--workdir``):

1. optional supervised warm start on the task's reference answers (``sft.*``);
2. evaluation of the warm start (avg@k at the training temperature, greedy);
3. ``rl.steps`` GRPO steps. Each step: ``prompts_per_step`` prompts x
   ``group_size`` samples from the sampler (weights version v, possibly up to
   ``max_staleness`` versions behind), verifier rewards, group advantages (DAPO's dynamic sampling and
   overlong shaping / filtering when configured: `pdm_jax.rl.dapo`),
   ``num_iterations`` passes of ``num_minibatches`` jitted, mesh-sharded
   optimizer steps with the trust-region mask, then version v+1 reaches the
   sampler (saved and loaded, or handed over in memory with ``sampler.mode=colocated``);
4. final evaluation, ``summary.json`` and ``curves.png``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from pdm_jax import evaluation, host_memory, per_host, workdir as wd
from pdm_jax.callbacks import TrainerCallback
from pdm_jax.checkpointing import Checkpointer, abstract_like, run_finished
from pdm_jax.config import check_sampler_mesh
from pdm_jax.data import filter_long_prompts, make_source
from pdm_jax.distributed import NullMetricsWriter, opt_state_shardings, put_global_batch, with_packing
from pdm_jax.metrics import (MetricsWriter, plot_curves, read_metrics, read_summary, rl_step_record, run_summary,
                             sampler_weights_format)
from pdm_jax.models import Qwen3ForCausalLM, from_pretrained, get_preset
from pdm_jax.profiling import (STEP_PHASES, CompileCounter, PhaseTimer, StepProfiler, compile_record,
                               enable_compile_cache, resolve_compile_cache_dir, step_timing)
from pdm_jax.rewards import score_batch, with_reward_functions
from pdm_jax.rl import dapo, objectives, train_step as ts
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.rollout import GenerateParams, round_up
from pdm_jax.rollouts import queued
from pdm_jax.rollouts.dynamic_sampling import DynamicSampler, refuse_per_host
from pdm_jax.rollouts.producer import RolloutProducer
from pdm_jax.rollouts.supervisor import SamplerFailure, SamplerSupervisor
from pdm_jax.run_spec import RunSpec, as_run_spec
from pdm_jax.sampler.weights import load_weights
from pdm_jax.sharding import activation_sharding, make_mesh, param_shardings
from pdm_jax.text import (TextCodec, check_tokenizer_fits_model, checkpoint_stop_ids, run_tokenizer,
                          sft_warmstart_batch)
from pdm_jax.wandb_log import open_wandb
from pdm_jax.warm_start import run_warm_start
from pdm_jax.workdir import WorkdirLock

__all__ = ["SamplerFailure", "Trainer", "TrainerCallback"]

log = logging.getLogger("pdm_jax.trainer")


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def _tqdm_kwargs() -> dict:
    """Fewer progress-bar refreshes when stderr is a file (logs stay readable)."""
    return {} if sys.stderr.isatty() else dict(mininterval=10.0)


class Trainer:
    """A resumable GRPO run with trust-region masks (see module docstring).

    Args:
      spec: the run's `pdm_jax.run_spec.RunSpec` (one typed record per config section), or a run ConfigDict,
        which `pdm_jax.run_spec.as_run_spec` validates and reads into one (``self.spec``).
      workdir: run directory; checkpoints, weights pushed to the sampler,
        metrics.jsonl, TensorBoard events, summary.json and curves.png go here.
        An existing workdir is resumed from its latest intact checkpoint
        (`pdm_jax.checkpointing`: a damaged one is refused and, when an older
        intact one exists, the run falls back to it and logs so). The workdir is
        locked for this Trainer (`pdm_jax.workdir.WorkdirLock`; multi-host: by
        process 0) from construction until `run` returns or raises, or `close`.
      callbacks: `TrainerCallback`s called around every optimizer step of the RL
        phase with the device `StepBatch` and the TrainState (read-only: the step
        donates the old state, so read what you need in before_update). Used by
        the token-level analysis; they must not change training.

    Raises:
      ValueError: a bad config (names the field) or a missing path.
      WorkdirLockedError: another run holds the workdir (names it and the holder's pid and host).
      CheckpointError: no intact checkpoint to resume from (names each one and what is wrong).
      SamplerFailure: the sampler never came up, or died more than ``sampler.max_restarts`` times.
    """

    def __init__(self, spec: RunSpec, workdir: str, *, callbacks=()):
        self.spec = as_run_spec(spec)  # a config: host memory set before JAX starts, validated once, read
        self._reuse = self.spec.host_memory.reuse_freed and host_memory.reuse_freed_host_memory()  # the first call's
        self.callbacks = list(callbacks)
        self.workdir = wd.run_path(workdir)  # a local path or a bucket URL (gs://...: pdm_jax.workdir)
        # One run per workdir; multi-host processes share it, so process 0 locks it for all.
        self._lock = WorkdirLock(self.workdir).acquire() if jax.process_index() == 0 else None
        try:
            self._setup()
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise

    def _setup(self) -> None:
        """Compile cache, data, tokenizer, model, mesh, sampler handle and checkpointer (the rest of __init__)."""
        spec = self.spec
        if run_finished(self.workdir, spec.rl.steps):  # another config on a finished run: refused, config.json kept
            wd.refuse_changed_config(self.workdir, spec.record.json)
        self.compile_cache_dir = resolve_compile_cache_dir(spec.compile_cache.dir, self.workdir)
        enable_compile_cache(self.compile_cache_dir, min_compile_time_s=spec.compile_cache.min_compile_time_s)
        self.compile_counter = CompileCounter()  # this run's compiles from here on (model init included)
        self.source = make_source(self.spec.data)
        tokenizer = self._setup_tokenizer()
        self.vocab_size = len(tokenizer)
        self.codec = TextCodec(tokenizer, chat=self.source.chat, enable_thinking=self.spec.data.enable_thinking,
                               stop_token_ids=spec.rollout.stop_token_ids
                               or checkpoint_stop_ids(tokenizer, spec.model.hf_path))
        log.info("rollouts stop on token ids %s", list(self.codec.stop_ids))
        # Over-long prompts are dropped (and counted) at load, never discovered mid-run.
        self.source = filter_long_prompts(self.source, self.codec.encode_prompt, spec.sampler.max_prompt_length)
        self.source = with_reward_functions(self.source, spec.reward)  # reward.functions, if any
        spec.check_against_data(vocab_size=self.vocab_size, num_held_out=len(self.source.eval_examples()))
        wd.makedirs(self.workdir)
        self.mesh = make_mesh(data=spec.mesh.data, fsdp=spec.mesh.fsdp, tensor=spec.mesh.tensor)
        self._setup_per_host()
        self.model_config, model = self._setup_model()
        spec.check_model(self.model_config)  # a dense hf_path checkpoint's replay, a preset's or checkpoint's context
        check_sampler_mesh(spec.sampler, self.model_config)  # before the warm start, not when the engine is built
        self._replay = spec.model.moe_routing_replay  # rollouts carry routed_experts
        self.graphdef, params = nnx.split(model)
        self._params_sharding = param_shardings(params, self.mesh)
        self.params = jax.device_put(params, self._params_sharding)
        self.sampler = SamplerSupervisor(self.spec.sampler, workdir=self.workdir, model_config=self.model_config,
                                         max_new_tokens=spec.rl.max_new_tokens, reuse_freed_host_memory=self._reuse,
                                         compile_cache_dir=self.compile_cache_dir,
                                         compile_cache_min_compile_time_s=spec.compile_cache.min_compile_time_s)
        self._eval_engine = None
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                         max_to_keep=spec.checkpoint.max_to_keep)
        if jax.process_index() == 0:  # multi-host: one process writes run files
            # A resume with other overrides keeps the earlier config.json as config.<n>.json and logs the fields.
            wd.write_run_config(self.workdir, spec.record.json)

    def _setup_per_host(self) -> None:
        """Per-host rollouts (`pdm_jax.per_host`): this process's prompts of every RL step, checked now."""
        rl = self.spec.rl
        self.per_host = per_host.enabled(self.spec.distributed, self.spec.rollout.per_host_rollouts)
        self._host_prompts = (0, rl.prompts_per_step)
        self.rollout_counts = dict(prompts=0, rows=0)  # what this process's sampler generated, over the run
        if self.per_host:
            self._host_prompts = per_host.host_prompt_range(rl.prompts_per_step, rl.group_size, self.mesh)
            log.info("per-host rollouts: process %d of %d samples prompts [%d, %d) of each RL step's %d",
                     jax.process_index(), jax.process_count(), *self._host_prompts, rl.prompts_per_step)
        refuse_per_host(self.spec.dapo, self.per_host)

    def close(self) -> None:
        """Stops the sampler and releases the workdir lock (idempotent; `run` calls it when it ends)."""
        try:
            self.sampler.stop()
        finally:  # released even when the sampler fails to stop
            if self._lock is not None:
                self._lock.release()

    # ---------------------------------------------------------------- setup
    def _setup_tokenizer(self):
        """The run's tokenizer (`text.run_tokenizer`); a char / BPE one is built into ``workdir/tokenizer`` once."""
        return run_tokenizer(self.spec.tokenizer, self.workdir, self.source, data=self.spec.data,
                             upload=jax.process_index() == 0)

    def _setup_model(self):
        mc = self.spec.model
        dtype = jnp.dtype(mc.dtype)
        param_dtype = jnp.dtype(mc.param_dtype)
        if mc.hf_path:  # model.param_dtype masters (f32) under model.dtype compute, read straight into their shards
            model = from_pretrained(mc.hf_path, dtype=dtype, param_dtype=param_dtype, mesh=self.mesh)
            model.set_compute_options(**mc.compute_options())
            cfg = model.config
        else:
            cfg = get_preset(mc.preset) if mc.preset else mc.qwen3_config(self.vocab_size)
            model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(self.spec.seed), dtype=dtype, param_dtype=param_dtype,
                                     **mc.compute_options())
        check_tokenizer_fits_model(self.codec.tokenizer, cfg.vocab_size, self.spec.tokenizer, mc.hf_path)
        model_dir = os.path.join(self.workdir, "model")
        wd.makedirs(model_dir)
        wd.write_bytes(os.path.join(model_dir, "config.json"), json.dumps(cfg.to_hf_dict(), indent=2).encode())
        return cfg, model

    def _put_batch(self, batch: StepBatch) -> StepBatch:
        # Rows split over ("data", "fsdp"); with several processes each feeds only the rows its
        # devices hold (jax.make_array_from_process_local_data); others are replicated.
        return put_global_batch(batch, self.mesh, batch_axes=("data", "fsdp"))

    def _make_state(self, params, tx) -> ts.TrainState:
        # Optimizer moments sharded like their parameters, scalars replicated on the mesh (a bare
        # jit(tx.init) leaves them on one device: wrong for multi-device and multi-host steps).
        opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, self.mesh))(params)
        step = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=NamedSharding(self.mesh, P()))()
        return ts.TrainState(step=step, params=params, opt_state=opt_state)

    def _jit_step(self, step_fn, state):
        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        jitted = jax.jit(step_fn, in_shardings=(state_sharding, None), out_shardings=(state_sharding, None),
                         donate_argnums=0)

        def run(state, batch):
            # Traced under the mesh so the model's activation constraints apply (batch over data x fsdp);
            # without them XLA replicates activations under FSDP (3x the temp memory, pdm_jax.dry_run).
            with activation_sharding(self.mesh):
                return jitted(state, batch)

        return run

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, version: int, params=None) -> dict:
        """avg@k accuracy (k = eval.samples_per_prompt at the training temperature) and greedy accuracy.

        Over the first eval.num_prompts held-out prompts (`pdm_jax.evaluation.evaluate`), with
        the engine ``eval.engine`` names: ``f32``, an unquantized f32 engine in this process on
        its first device, given ``params`` (weights version `version`; default ``self.params``)
        in memory; ``rollout``, the rollout sampler, which serves `version` after the step's
        weight sync (started here on ``params`` when it is not running yet).

        Raises:
          RuntimeError: ``eval.engine = rollout`` and the sampler serves another version.
        """
        params = self.params if params is None else params
        if self.spec.eval.engine == "rollout":
            if not self.sampler.started:
                self.sampler.start(version, params=params)
            if self.sampler.version != version:
                raise RuntimeError(f"eval.engine = 'rollout': the sampler serves weights version "
                                   f"{self.sampler.version}, not {version}")
            engine = self.sampler
        elif self._eval_engine is None:
            engine = self._eval_engine = self.sampler.memory_engine(params, version, "none", noised=False)
        else:
            engine = self._eval_engine
            if engine.version != version:
                engine.engine.set_params(params, version=version)
        split = {}
        if self.per_host:  # each process its share of the prompts; the scores gathered back in order
            split = dict(prompt_range=per_host.eval_prompt_range(self.spec.eval.num_prompts),
                         gather=per_host.gather_ragged)
        return evaluation.evaluate(engine, self.source, self.codec, self.spec.eval,
                                   temperature=self.spec.rl.temperature, max_new_tokens=self.spec.rl.max_new_tokens,
                                   seed=10_007 + self.spec.seed, **split)

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        """Runs (or resumes) the whole job; returns the summary dict also written to summary.json."""
        if self._lock is not None:
            self._lock.acquire()  # again, after a close()
        with wd.close_after(self, "the sampler and the workdir lock"):  # the run's own error wins over the close's
            return self._run()

    def _run(self) -> dict:
        spec = self.spec
        t_start = time.time()
        sft_tx, _ = self.spec.step.sft_optimizer.build()
        rl_tx, rl_schedule = self.spec.step.rl_optimizer.build()
        meta = dict(phase="sft", sft_step=0, rl_step=0, data_position=0, sampler_version=0,
                    wall_seconds=0.0, warmstart=None, seed=spec.seed)
        state, self._restored_step = None, None
        resumed = self.checkpointer.latest_step() is not None
        if resumed:
            # Checkpoints: the warm start (before and after its evaluation), then during RL.
            restored = self.checkpointer.restore_latest_intact(abstract_like(self._make_state(self.params, rl_tx)))
            state, meta = restored.state, restored.meta
            self.params, self._restored_step = state.params, restored.step
            log.info("resumed %s at RL step %d from %s", self.workdir, meta["rl_step"],
                     self.checkpointer.step_path(restored.step))
        self._wall_base = float(meta.get("wall_seconds", 0.0))
        self._t_start = t_start
        if jax.process_index() == 0:  # records after the checkpoint are dropped (the warm start's eval too if redone)
            first_redone = meta["rl_step"] + (meta.get("warmstart") is not None)
            writer = MetricsWriter(self.workdir, tensorboard=spec.log.tensorboard, fresh=not resumed,
                                   resume_from_step=first_redone if resumed else None, restore=meta.get("rl_record"),
                                   wandb=open_wandb(spec.wandb, self.workdir, spec.record.tree))
        else:  # multi-host: only process 0 writes metrics (pdm_jax.distributed)
            writer = NullMetricsWriter()
        with wd.close_after(writer, "the metrics writer"):  # the first write error wins over the close's
            if not resumed:
                self._run_sft(sft_tx, writer)
                meta.update(phase="rl", sft_step=spec.sft.steps)
                state = self._make_state(self.params, rl_tx)
                if spec.sft.steps > 0:  # kept even if its evaluation fails
                    self._checkpoint(state, meta)
            if meta.get("warmstart") is None:
                self._evaluate_warm_start(state, meta, writer)
            summary = self._run_rl(state, rl_tx, rl_schedule, meta, writer)
        return summary

    def _evaluate_warm_start(self, state, meta, writer) -> None:
        """Writes the warm start as weights version 0, evaluates it and checkpoints the result.

        Version 0 is written in the file modes (the sampler's first version) and, with
        ``rl.kl_beta`` > 0, in every mode (the KL reference policy, read back on resume).
        """
        if self.sampler.writes_files or self.spec.rl.kl_beta > 0:
            self.sampler.push_weights(state.params, 0)
        self.params = state.params
        meta["warmstart"] = self.evaluate(0)
        writer.write(0, "eval", meta["warmstart"])
        log.info("warm start evaluated: %s", _fmt(meta["warmstart"]))
        self._checkpoint(state, meta)

    def _wall_seconds(self) -> float:
        return self._wall_base + (time.time() - self._t_start)

    def _checkpoint(self, state, meta, producer=None):
        # Ids: sft.steps for the warm start before its evaluation, sft.steps + 1 + RL step after it.
        meta["wall_seconds"] = self._wall_seconds()
        done = int(meta["rl_step"]) + (meta.get("warmstart") is not None)
        # Reward functions' per-row values are not in the queued file, and dynamic sampling's rows keep the values
        # their round gave: that combination re-samples its queued steps on resume (docs/sampler.md).
        keep = producer and not (self.spec.reward.functions and self.spec.dapo.dynamic_sampling)
        extra = queued.checkpoint_files(producer.snapshot(), **self._queued) if keep else None
        self.checkpointer.save(self.spec.sft.steps + done, state, dict(meta), extra_files=extra)

    def _run_sft(self, tx, writer) -> None:
        """Supervised warm start on the task's reference answers (`pdm_jax.warm_start`); updates self.params."""
        sft = self.spec.sft
        if sft.steps == 0:
            return
        state = self._make_state(self.params, tx)
        step_fn = self._jit_step(ts.make_sft_train_step(self.graphdef, tx), state)
        batch_at = lambda step: self._put_batch(sft_warmstart_batch(  # noqa: E731
            self.source, self.codec, step, sft.batch_size, self.spec.rl.max_new_tokens))
        state, _ = run_warm_start(sft, step_fn, state, batch_at, writer, disable=not self.spec.log.progress,
                                  **_tqdm_kwargs())
        self.params = state.params

    def _make_rollouts(self, position: int, step: int, round_: int = 0):
        """Rollouts of RL step ``step``: its P prompts from data position ``position``, the step's seed
        (`dapo.round_seed`: sampling round ``round_`` of dynamic sampling; round 0 the step's own).

        Returns ``(RolloutBatch, examples, generation seconds)``; called by the `RolloutProducer`.
        Per-host rollouts: only this process's prompts [lo, hi) (keyed as prompts lo.. of the step).
        """
        rl = self.spec.rl
        examples = self.source.train_batch(position, rl.prompts_per_step)
        prompts = [self.codec.encode_prompt(e.prompt) for e in examples]
        lo, hi = self._host_prompts
        t0 = time.time()
        rb = self.sampler.generate(prompts[lo:hi], GenerateParams(
            n=rl.group_size, temperature=self.spec.rollout.temperature, max_new_tokens=rl.max_new_tokens,
            top_k_logprobs=rl.top_k_logprobs, stop_token_ids=list(self.codec.stop_ids),
            return_routing=bool(self._replay), seed=dapo.round_seed(self.spec.seed * 1_000_003 + step, round_),
            first_prompt_index=lo))
        seconds = time.time() - t0
        self.rollout_counts["prompts"] += hi - lo
        self.rollout_counts["rows"] += rb.num_sequences
        return rb, examples[lo:hi], seconds

    def _step_batch(self, rb, ref, filler=None) -> StepBatch:
        """The host `StepBatch` of a scored rollout batch (advantages of ``rb.rewards``, checked by `RolloutBatch`:
        a non-finite reward is named with its row; reference logprobs when kl_beta > 0). DAPO's pieces
        (`pdm_jax.rl.dapo`): the overlong shaping added to the rewards, the loss of truncated rows (overlong
        filtering) and of dynamic sampling's ``filler`` rows masked."""
        rl = self.spec.rl
        adv = np.asarray(objectives.group_advantages(jnp.asarray(dapo.training_rewards(rb, self.spec.dapo)),
                                                     rl.group_size, normalize_std=rl.normalize_advantage_std))
        rb = dapo.without_loss(rb, dapo.no_loss_rows(rb, self.spec.dapo, filler))
        width = rb.prompt_ids.shape[1]  # per host: the step's longest prompt over all processes
        width = int(per_host.gather_max(width)) if self.per_host else width
        batch = StepBatch.from_rollouts(rb, adv, prompt_len=round_up(width, 8),
                                        completion_len=rl.max_new_tokens, routing=self._replay)
        if self.per_host:  # this process's rows -> the global device batch (pdm_jax.per_host)
            batch = per_host.assemble(batch, self.mesh)
        if ref is not None:
            ref_fn, ref_params = ref
            ref_lp = ref_fn(ref_params, batch if self.per_host else self._put_batch(batch))
            batch = batch.replace(ref_logprobs=ref_lp if self.per_host else np.asarray(ref_lp))
        return batch

    def _score(self, rb, examples) -> np.ndarray:
        """The task rewards ``[N]`` of a rollout batch (`evaluation.score_rollouts`: reward.functions' if set)."""
        return evaluation.score_rollouts(self.source, self.codec, rb, examples, self.spec.rl.group_size)

    def _reference_policy(self, state):
        """``(logprob_fn, frozen params of weights version 0)`` for the KL penalty, or None when kl_beta = 0."""
        if self.spec.rl.kl_beta <= 0:
            return None
        ref_params = jax.tree.map(lambda x: x, state.params)
        ref_params.replace_by_pure_dict(load_weights(self.sampler.weights_path(0), self.model_config))
        ref_params = jax.device_put(ref_params, self._params_sharding)
        return jax.jit(ts.make_logprob_fn(self.graphdef, self.spec.rl.temperature)), ref_params

    def _update(self, step_fn, state, batch: StepBatch, rl_step: int):
        """``num_iterations`` passes of ``num_minibatches`` optimizer steps over one rollout batch."""
        rl = self.spec.rl
        n_seq = batch.num_sequences
        mb = n_seq // rl.num_minibatches
        step_metrics = []
        rng = np.random.default_rng([self.spec.seed, rl_step - 1])
        for _ in range(rl.num_iterations):
            perm = rng.permutation(n_seq)
            for j in range(rl.num_minibatches):
                rows = perm[j * mb:(j + 1) * mb]
                host = None if self.per_host else batch.select(rows)
                sub = per_host.select_rows(batch, rows, self.mesh) if self.per_host else self._put_batch(host)
                if rl.pack_sequences:  # the packing plan of these rows travels with them (pdm_jax.rl.packing)
                    sub = with_packing(sub, self.mesh, host_batch=host, row_length=self.spec.packed_length,
                                       rows_per_micro_batch=rl.micro_batch_size)
                for cb in self.callbacks:
                    cb.before_update(self, rl_step, sub, state)
                state, m = step_fn(state, sub)
                for cb in self.callbacks:
                    cb.after_update(self, rl_step, sub, state, m)
                step_metrics.append(m)
        return state, jax.device_get(step_metrics)

    def _run_rl(self, state, tx, schedule, meta, writer) -> dict:
        spec = self.spec
        rl, sc = spec.rl, spec.step
        step_fn = self._jit_step(ts.make_rl_train_step(self.graphdef, tx, sc.trust_region, sc.policy_loss), state)
        ref = self._reference_policy(state)
        version = meta["sampler_version"]
        summary_path = os.path.join(self.workdir, "summary.json")
        if meta["rl_step"] >= rl.steps and (done := read_summary(summary_path)) is not None:
            log.info("all %d RL steps are done; summary in %s", rl.steps, summary_path)
            return done
        if not self.sampler.started:  # file modes: the version is pushed first if it is not on disk
            self.sampler.start(version, params=state.params)
        noise = f" + weight noise {spec.sampler.weight_noise:g}" if spec.sampler.weight_noise else ""
        log.info("sampler ready (%s, %s weights%s, version %d); %d GRPO steps to go", self.sampler.mode,
                 sampler_weights_format(spec.sampler), noise, version, rl.steps - meta["rl_step"])
        bar = tqdm(range(meta["rl_step"], rl.steps), desc="GRPO", disable=not spec.log.progress,
                   initial=meta["rl_step"], total=rl.steps, **_tqdm_kwargs())
        base_position = meta["data_position"] - meta["rl_step"] * rl.prompts_per_step
        self._queued = dict(max_staleness=rl.max_staleness,  # what batches sampled before a resume must share
                            key=queued.batch_key(rl, spec.rollout.temperature, spec.dapo.dynamic_sampling))
        ahead = queued.read(self.checkpointer, self._restored_step, **self._queued)
        make = lambda step: self._make_rollouts(base_position + step * rl.prompts_per_step, step)  # noqa: E731
        if spec.dapo.dynamic_sampling:  # scored in rounds; (rollouts, examples, seconds, Draw)
            make = DynamicSampler(spec.dapo, draw=self._make_rollouts, score=self._score,
                                  prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
                                  first_step=meta["rl_step"] + len(ahead),
                                  position=ahead[max(ahead)][3].data_end if ahead else meta["data_position"])
        producer = RolloutProducer(make, first_step=meta["rl_step"], last_step=rl.steps,
                                   max_staleness=rl.max_staleness, version=version, queued=ahead)
        profiler = StepProfiler(self.workdir, spec.profile.steps)
        run = dict(state=state, version=version, last_eval={}, base_position=base_position)
        try:
            for step in bar:
                profiler.before_step(step + 1)
                rec = self._rl_step(step, run, producer, step_fn, ref, schedule, meta, writer)
                profiler.after_step(step + 1)
                bar.set_postfix(reward=f"{rec['reward']:.2f}", masked=f"{rec['frac_masked']:.3f}",
                                kl=f"{rec['mean_topk_kl']:.4f}", refresh=False)
                self._fault_injection(step + 1)
        finally:
            producer.close()
            profiler.stop()
        log.info("process %d sampled %d prompts (%d rollouts) over this run's RL steps", jax.process_index(),
                 self.rollout_counts["prompts"], self.rollout_counts["rows"])
        self.params = run["state"].params
        if not run["last_eval"]:
            run["last_eval"] = self.evaluate(run["version"], run["state"].params)
        return self._write_summary(meta, run["last_eval"], writer)

    def _rl_step(self, step, run, producer, step_fn, ref, schedule, meta, writer) -> dict:
        """RL step ``step + 1``, every phase timed (`PhaseTimer`); updates ``run`` and ``meta``, writes its records.

        The ``rl`` record is written after the step's evaluation and checkpoint, so that it carries their times;
        the checkpoint's meta keeps it without them (``rl_record``), for a resume after a crash in between.
        """
        rl = self.spec.rl
        timer = PhaseTimer(STEP_PHASES)
        with timer.phase("sampling"):
            rb, examples, gen_seconds, *drawn = producer.get(step)  # drawn: [dynamic sampling's Draw]
        draw = drawn[0] if drawn else None
        with timer.phase("scoring"):  # dynamic sampling (a draw) scored its rounds
            rb, reward_rows = score_batch(self.source, self.codec, rb, examples, rl.group_size, scored=draw is not None)
        with timer.phase("advantages"):
            batch = self._step_batch(rb, ref, draw and draw.filler)
        with timer.phase("optimizer"):  # ends with the metrics' device_get: the device work is done
            run["state"], step_metrics = self._update(step_fn, run["state"], batch, step + 1)
        run["version"] = version = run["version"] + 1
        meta.update(sampler_version=version, rl_step=step + 1, data_position=draw.data_end if draw else
                    run["base_position"] + (step + 1) * rl.prompts_per_step)
        with timer.phase("weight_sync"):
            self.sampler.sync(run["state"].params, version)
        producer.notify_version(version)
        rows = dict(rewards=rb.rewards, length=rb.completion_mask.sum(1), weights_version=rb.weights_version,
                    **dapo.record_rows(rb, self.spec.dapo), **reward_rows)
        if self.per_host:  # every process's rows and the slowest process's generation time (collectives)
            rows, gen_seconds = per_host.gather_rows(rows, self.mesh), per_host.gather_max(gen_seconds)
        rec = rl_step_record(step_metrics, rows, learning_rate=float(schedule(int(run["state"].step) - 1)),
                             version=version, gen_seconds=gen_seconds, sampler_restarts=self.sampler.restarts_total,
                             sampler_stalls=self.sampler.stalls_total)
        rec.update(dapo.step_record(rows, self.spec.dapo, draw and draw.counts))
        if (step + 1) % self.spec.eval.every_steps == 0 or step + 1 == rl.steps:
            with timer.phase("eval"):
                run["last_eval"] = self.evaluate(version, run["state"].params)
            writer.write(step + 1, "eval", run["last_eval"])
            log.info("eval after RL step %d: %s", step + 1, _fmt(run["last_eval"]))
        if (step + 1) % self.spec.checkpoint.every_steps == 0 or step + 1 == rl.steps:
            with timer.phase("checkpoint"):
                self._checkpoint(run["state"], dict(meta, rl_record=dict(rec, step=step + 1)), producer)
        rec.update(step_timing(timer.record(), self.sampler.last_sync_seconds, gen_seconds))
        rec.update(compile_record(self.compile_counter.snapshot(), self.sampler.sampler_compile_stats))
        writer.write(step + 1, "rl", rec)
        return rec

    def _write_summary(self, meta, last_eval, writer) -> dict:
        """summary.json (fields: `pdm_jax.metrics.run_summary`) from the metrics file and the final meta."""
        summary = run_summary(read_metrics(writer.path), spec=self.spec, meta=meta, last_eval=last_eval,
                              wall_seconds=self._wall_seconds())
        if jax.process_index() == 0:
            wd.write_bytes(os.path.join(self.workdir, "summary.json"), json.dumps(summary, indent=2).encode())
            plot_curves(read_metrics(writer.path), os.path.join(self.workdir, "curves.png"), spec=self.spec)
            writer.log_run_end(summary, os.path.join(self.workdir, "curves.png"))
        return summary

    def _fault_injection(self, rl_step: int) -> None:
        """Test hooks (``debug.*``): kill the sampler or this process after an RL step."""
        dbg = self.spec.debug
        if dbg.kill_sampler_after_rl_step == rl_step:
            log.warning("debug: killing the sampler process after RL step %d", rl_step)
            self.sampler.kill_process()
        if dbg.kill_after_rl_step == rl_step:
            log.warning("debug: SIGKILL to the trainer after RL step %d", rl_step)
            os.kill(os.getpid(), signal.SIGKILL)
