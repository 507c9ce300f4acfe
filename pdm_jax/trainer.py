"""The RL loop: prompts -> sampler service -> rewards -> advantages -> jitted steps -> weights push.

One `Trainer` owns every side effect of a run (DESIGN.md §3): the sampler
process, the orbax checkpoints, weights pushed to the sampler, metrics files,
evaluation. The math lives in pure functions (`pdm_jax.train_step`,
`pdm_jax.trust_region`, `pdm_jax.objectives`).

Phases of a run (all resumable from ``--workdir``):

1. optional supervised warm start on the task's reference answers (``config.sft``);
2. evaluation of the warm start (avg@k at the training temperature, greedy);
3. ``config.rl.steps`` GRPO steps. Each step: ``prompts_per_step`` prompts x
   ``group_size`` samples from the sampler (weights version v, possibly up to
   ``max_staleness`` versions behind), verifier rewards, group advantages,
   ``num_iterations`` passes of ``num_minibatches`` jitted, mesh-sharded
   optimizer steps with the trust-region mask, then version v+1 is saved with
   orbax and loaded by the sampler;
4. final evaluation, ``summary.json`` and ``curves.png``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from pdm_jax import objectives, train_step as ts, trust_region
from pdm_jax.checkpointing import Checkpointer, abstract_like
from pdm_jax.config import model_config_from_fields
from pdm_jax.metrics import MetricsWriter, plot_curves, read_metrics
from pdm_jax.rollout import RolloutBatch

log = logging.getLogger("pdm_jax.trainer")

QUANTIZATIONS = ("none", "bf16", "fp8")
SAMPLER_MODES = ("subprocess", "remote", "in_process")
CORRECT_SCORE = 0.999  # a verifier score at or above this counts as a correct answer


# ----------------------------------------------------------------------------- config checks
def _need_number(field: str, value, integer: bool = False) -> None:
    """Raises ValueError naming ``field`` unless ``value`` is a real number (an int if ``integer``); bools are refused."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds):
        raise ValueError(f"{field} = {value!r}: must be {'an integer' if integer else 'a number'}")


# Numeric fields validate_config compares (an int or a float); a None or a string there is a named error.
_INT_FIELDS = ("rl.group_size", "rl.prompts_per_step", "rl.num_minibatches", "rl.num_iterations", "rl.max_staleness",
               "rl.steps", "rl.max_new_tokens", "rl.top_k_logprobs", "sft.steps", "sft.batch_size",
               "eval.every_steps", "eval.samples_per_prompt", "eval.num_prompts", "checkpoint.every_steps",
               "checkpoint.max_to_keep", "sampler.max_prompt_length", "sampler.max_batch_size", "sampler.retries",
               "sampler.max_restarts", "model.max_position_embeddings")
_FLOAT_FIELDS = ("rl.temperature", "rl.learning_rate", "sft.learning_rate", "rl.adam_b1", "rl.adam_b2",
                 "rl.weight_decay", "rl.tis_cap", "rl.kl_beta", "sampler.startup_timeout_s",
                 "sampler.request_timeout_s")


def trust_region_config(config: ml_collections.ConfigDict) -> trust_region.TrustRegionConfig:
    """Builds the (validated) TrustRegionConfig from ``config.trust_region``.

    Raises ValueError naming the field (``trust_region.<name>``) and its value.
    """
    tr = config.trust_region
    for name in ("delta", "clip_eps_low", "clip_eps_high"):
        _need_number(f"trust_region.{name}", tr[name])
    for name in ("delta_low", "delta_high"):
        if tr[name] is not None:
            _need_number(f"trust_region.{name}", tr[name])
    try:
        return trust_region.TrustRegionConfig(
            mask=tr.mask, divergence=tr.divergence, estimator=tr.estimator, delta=float(tr.delta),
            delta_low=None if tr.delta_low is None else float(tr.delta_low),
            delta_high=None if tr.delta_high is None else float(tr.delta_high),
            clip_eps_low=float(tr.clip_eps_low), clip_eps_high=float(tr.clip_eps_high),
            nonfinite=tr.nonfinite)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("trust_region.") else f"trust_region: {msg}") from None


def validate_config(config: ml_collections.ConfigDict, *, vocab_size: Optional[int] = None) -> None:
    """Checks a run config before any work; raises ValueError naming the field and value.

    Checked: trust region (mask, divergence, estimator, delta > 0, ...), group size >= 2,
    mini-batches dividing the rollout batch, K in [1, vocab_size], sampler mode,
    quantization, timeouts and retries, staleness >= 0, step counts, evaluation sizes, the
    mesh against ``jax.device_count()``, the model shape (head counts, sizes) when it is
    built from ``model.*``, and that configured local paths (model.hf_path,
    tokenizer.path, data.path) exist.
    """
    for fields, integer in ((_INT_FIELDS, True), (_FLOAT_FIELDS, False)):
        for field in fields:
            group, name = field.split(".")
            _need_number(field, config[group][name], integer)
    trust_region_config(config)
    rl = config.rl

    def need(cond, field, value, what):
        if not cond:
            raise ValueError(f"{field} = {value!r}: {what}")

    need(rl.group_size >= 2, "rl.group_size", rl.group_size, "GRPO needs at least 2 samples per prompt")
    need(rl.prompts_per_step >= 1, "rl.prompts_per_step", rl.prompts_per_step, "must be >= 1")
    n = rl.prompts_per_step * rl.group_size
    need(rl.num_minibatches >= 1 and n % rl.num_minibatches == 0, "rl.num_minibatches", rl.num_minibatches,
         f"must divide the rollout batch of prompts_per_step x group_size = {n} sequences")
    need(rl.num_iterations >= 1, "rl.num_iterations", rl.num_iterations, "must be >= 1")
    need(rl.max_staleness >= 0, "rl.max_staleness", rl.max_staleness, "must be >= 0")
    need(rl.steps >= 0, "rl.steps", rl.steps, "must be >= 0")
    need(config.sft.steps >= 0, "sft.steps", config.sft.steps, "must be >= 0")
    need(rl.temperature > 0, "rl.temperature", rl.temperature, "must be > 0 (the trust region compares tempered distributions)")
    need(rl.max_new_tokens >= 1, "rl.max_new_tokens", rl.max_new_tokens, "must be >= 1")
    need(rl.top_k_logprobs >= 1, "rl.top_k_logprobs", rl.top_k_logprobs, "K must be >= 1")
    if vocab_size is not None:
        need(rl.top_k_logprobs <= vocab_size, "rl.top_k_logprobs", rl.top_k_logprobs,
             f"K is larger than the vocabulary size {vocab_size}")
    need(math.isfinite(rl.learning_rate) and rl.learning_rate > 0, "rl.learning_rate", rl.learning_rate,
         "must be finite and > 0")
    need(math.isfinite(config.sft.learning_rate) and config.sft.learning_rate > 0, "sft.learning_rate",
         config.sft.learning_rate, "must be finite and > 0")
    for name in ("adam_b1", "adam_b2"):
        value = rl[name]
        need(0.0 <= value < 1.0, f"rl.{name}", value, "must be in [0, 1)")
    need(rl.weight_decay >= 0, "rl.weight_decay", rl.weight_decay, "must be >= 0")
    need(math.isfinite(rl.tis_cap) and rl.tis_cap > 0, "rl.tis_cap", rl.tis_cap, "C must be finite and > 0")
    need(rl.kl_estimator in objectives.KL_KINDS, "rl.kl_estimator", rl.kl_estimator,
         f"must be one of {objectives.KL_KINDS}")
    need(math.isfinite(rl.temperature), "rl.temperature", rl.temperature, "must be finite")
    for field in ("eval.every_steps", "checkpoint.every_steps", "checkpoint.max_to_keep", "sft.batch_size",
                  "sampler.max_prompt_length", "sampler.max_batch_size"):
        group, name = field.split(".")
        need(config[group][name] >= 1, field, config[group][name], "must be >= 1")
    if not config.model.hf_path and not config.model.preset:
        context = config.sampler.max_prompt_length + rl.max_new_tokens
        need(context <= config.model.max_position_embeddings, "rl.max_new_tokens", rl.max_new_tokens,
             f"sampler.max_prompt_length + rl.max_new_tokens = {context} exceeds "
             f"model.max_position_embeddings = {config.model.max_position_embeddings}")
    need(config.sampler.mode in SAMPLER_MODES, "sampler.mode", config.sampler.mode, f"must be one of {SAMPLER_MODES}")
    need(config.sampler.quantization in QUANTIZATIONS, "sampler.quantization", config.sampler.quantization,
         f"must be one of {QUANTIZATIONS}")
    if config.sampler.mode == "remote":
        need(bool(config.sampler.address), "sampler.address", config.sampler.address, "required when sampler.mode = 'remote'")
    for name in ("startup_timeout_s", "request_timeout_s"):
        value = config.sampler[name]
        need(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"sampler.{name}", value,
             "must be a finite number of seconds > 0")
    for name in ("retries", "max_restarts"):
        need(config.sampler[name] >= 0, f"sampler.{name}", config.sampler[name], "must be >= 0")
    mesh = config.mesh
    try:
        from pdm_jax.sharding import MeshConfig

        MeshConfig(data=mesh.data, fsdp=mesh.fsdp, tensor=mesh.tensor).axis_sizes(jax.device_count())
    except ValueError as e:
        raise ValueError(f"mesh = (data={mesh.data}, fsdp={mesh.fsdp}, tensor={mesh.tensor}) on "
                         f"{jax.device_count()} device(s): {e}") from None
    for name in ("dtype", "param_dtype"):
        value = config.model[name]
        try:
            ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
        except TypeError:
            ok = False
        need(ok, f"model.{name}", value, "must be a floating dtype name (float32, bfloat16, ...)")
    if config.model.preset and not config.model.hf_path:
        from pdm_jax.models.presets import PRESETS

        need(config.model.preset in PRESETS, "model.preset", config.model.preset, f"must be one of {sorted(PRESETS)}")
    if not config.model.hf_path and not config.model.preset:
        try:
            model_config_from_fields(config.model, vocab_size or 1)
        except ValueError as e:  # names Qwen3Config.<field>: the same names under model.
            raise ValueError(f"model: {e} (set as model.<field> in the run config)") from None
    need(config.eval.samples_per_prompt >= 1, "eval.samples_per_prompt", config.eval.samples_per_prompt, "must be >= 1")
    need(config.eval.num_prompts >= 1, "eval.num_prompts", config.eval.num_prompts, "must be >= 1")
    for field, path in (("model.hf_path", config.model.hf_path), ("data.path", config.data.path),
                        ("data.eval_path", config.data.get("eval_path", "")),
                        ("tokenizer.path", config.tokenizer.path if config.tokenizer.kind == "path" else "")):
        if path:
            need(os.path.exists(path), field, path, "no such file or directory")
    need(config.tokenizer.kind in ("char", "path"), "tokenizer.kind", config.tokenizer.kind, "must be 'char' or 'path'")
    if config.tokenizer.kind == "path":
        need(bool(config.tokenizer.path), "tokenizer.path", config.tokenizer.path, "required when tokenizer.kind = 'path'")
    else:
        need(not config.tokenizer.path, "tokenizer.path", config.tokenizer.path,
             "is ignored when tokenizer.kind = 'char' (which builds its own); set tokenizer.kind=path to use it")
    ts.PolicyLossConfig(policy_loss=rl.policy_loss, tis_cap=rl.tis_cap, dual_clip=rl.dual_clip,
                        loss_aggregation=rl.loss_aggregation, kl_beta=rl.kl_beta, temperature=rl.temperature,
                        logits_chunk_size=int(rl.get("logits_chunk_size", 0)))
    need(rl.loss_aggregation in objectives.AGGREGATION_MODES, "rl.loss_aggregation", rl.loss_aggregation,
         f"must be one of {objectives.AGGREGATION_MODES}")


# ----------------------------------------------------------------------------- helpers
def _pad_to(x: np.ndarray, length: int, axis: int, left: bool = False, value=0) -> np.ndarray:
    extra = length - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of length {x.shape[axis]} to {length}")
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (extra, 0) if left else (0, extra)
    return np.pad(x, pad, constant_values=value)


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def rollout_to_arrays(rb: RolloutBatch, advantages: np.ndarray, prompt_len: int, completion_len: int) -> dict:
    """Host arrays of the train-step batch (pdm_jax.train_step layout), padded to static lengths.

    Also carries ``weights_version`` [N] int32 (the sampler's version of each row): the
    step ignores it; callbacks (the token-level analysis) read it.
    """
    return dict(
        prompt_ids=_pad_to(rb.prompt_ids, prompt_len, 1, left=True),
        prompt_mask=_pad_to(rb.prompt_mask, prompt_len, 1, left=True, value=False),
        completion_ids=_pad_to(rb.completion_ids, completion_len, 1),
        completion_mask=_pad_to(rb.completion_mask, completion_len, 1, value=False),
        behavior_logprobs=_pad_to(rb.behavior_logprobs, completion_len, 1),
        topk_ids=_pad_to(rb.topk_ids, completion_len, 1),
        topk_logprobs=_pad_to(rb.topk_logprobs, completion_len, 1),
        advantages=np.asarray(advantages, np.float32),
        weights_version=np.asarray(rb.weights_version, np.int32),
    )


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def _tqdm_kwargs() -> dict:
    """Fewer progress-bar refreshes when stderr is a file (logs stay readable)."""
    import sys

    return {} if sys.stderr.isatty() else dict(mininterval=10.0)


class SamplerFailure(RuntimeError):
    """The sampler could not serve a request after the configured restarts/retries."""


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """A resumable GRPO run with trust-region masks (see module docstring).

    Args:
      config: a ConfigDict following pdm_jax/config.py (validated at start).
      workdir: run directory; checkpoints, weights pushed to the sampler,
        metrics.jsonl, TensorBoard events, summary.json and curves.png go here.
        An existing workdir is resumed from its latest checkpoint.

      callbacks: objects with ``before_update(trainer, rl_step, batch, state)``
        and ``after_update(trainer, rl_step, batch, state, metrics)``, called
        around every optimizer step of the RL phase with the device batch
        (pdm_jax.train_step layout) and the TrainState (read-only: the step
        donates the old state, so read what you need in before_update). Used
        by the token-level analysis; they must not change training.

    Raises:
      ValueError: a bad config (names the field) or a missing path.
      SamplerFailure: the sampler never came up, or died more than
        ``sampler.max_restarts`` times.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, callbacks=()):
        validate_config(config)
        self.config = config
        self.callbacks = list(callbacks)
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.tr_config = trust_region_config(config)
        from pdm_jax.data import make_source

        self.tokenizer = self._setup_tokenizer()
        self.vocab_size = len(self.tokenizer)
        validate_config(config, vocab_size=self.vocab_size)
        self.source = make_source(config.data)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer at {config.tokenizer.path or 'workdir/tokenizer'} has no eos_token")
        self.model_config, model = self._setup_model()
        context = config.sampler.max_prompt_length + config.rl.max_new_tokens
        if context > self.model_config.max_position_embeddings:
            raise ValueError(f"rl.max_new_tokens = {config.rl.max_new_tokens}: sampler.max_prompt_length + "
                             f"rl.max_new_tokens = {context} exceeds the model's max_position_embeddings = "
                             f"{self.model_config.max_position_embeddings}")
        self.graphdef, params = nnx.split(model)
        self.mesh = self._setup_mesh()
        self._params_sharding = self._param_shardings(params)
        params = jax.device_put(params, self._params_sharding)
        self.params = params
        self._sampler = None
        self._sampler_proc = None
        self._sampler_lock = threading.RLock()
        self._sampler_generation = 0
        self._restarts_total = 0
        self._eval_engine = None
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                         max_to_keep=config.checkpoint.max_to_keep)
        if jax.process_index() == 0:  # multi-host: one process writes run files
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2))

    # ---------------------------------------------------------------- setup
    def _setup_tokenizer(self):
        from pdm_jax.models.tokenizer import build_char_tokenizer, load_tokenizer

        tc = self.config.tokenizer
        if tc.kind == "char":
            path = os.path.join(self.workdir, "tokenizer")
            if not os.path.exists(os.path.join(path, "tokenizer.json")):
                build_char_tokenizer(tc.symbols, path)
            return load_tokenizer(path)
        return load_tokenizer(tc.path)

    def _setup_model(self):
        from pdm_jax.models import Qwen3ForCausalLM

        mc = self.config.model
        dtype = jnp.dtype(mc.dtype)
        param_dtype = jnp.dtype(mc.param_dtype)
        if mc.hf_path:
            from pdm_jax.models.hf_io import from_pretrained

            model = from_pretrained(mc.hf_path, dtype=dtype)
            cfg = model.config
        else:
            if mc.preset:
                from pdm_jax.models.presets import get_preset

                cfg = get_preset(mc.preset)
            else:
                cfg = model_config_from_fields(mc, self.vocab_size)
            model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(self.config.seed), dtype=dtype, param_dtype=param_dtype)
        if cfg.vocab_size < self.vocab_size:
            raise ValueError(f"model vocab_size {cfg.vocab_size} is smaller than the tokenizer's {self.vocab_size}")
        model_dir = os.path.join(self.workdir, "model")
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
        return cfg, model

    def _setup_mesh(self):
        from pdm_jax.sharding import make_mesh

        m = self.config.mesh
        return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor)

    def _param_shardings(self, params):
        from pdm_jax.sharding import param_shardings

        return param_shardings(params, self.mesh)

    def _put_batch(self, arrays: dict) -> dict:
        # Rows split over ("data", "fsdp"); with several processes each feeds only the rows its
        # devices hold (jax.make_array_from_process_local_data); others are replicated.
        from pdm_jax.distributed import put_global_batch

        return put_global_batch(arrays, self.mesh, batch_axes=("data", "fsdp"))

    def _make_state(self, params, tx) -> ts.TrainState:
        # Optimizer moments sharded like their parameters, scalars replicated on the mesh (a bare
        # jit(tx.init) leaves them on one device: wrong for multi-device and multi-host steps).
        from jax.sharding import NamedSharding, PartitionSpec as P

        from pdm_jax.distributed import opt_state_shardings

        opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, self.mesh))(params)
        step = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=NamedSharding(self.mesh, P()))()
        return ts.TrainState(step=step, params=params, opt_state=opt_state)

    def _jit_step(self, step_fn, state):
        from pdm_jax.sharding import activation_sharding

        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        jitted = jax.jit(step_fn, in_shardings=(state_sharding, None), out_shardings=(state_sharding, None),
                         donate_argnums=0)

        def run(state, batch):
            # Traced under the mesh so the model's activation constraints apply (batch over data x fsdp);
            # without them XLA replicates activations under FSDP (3x the temp memory, pdm_jax.dry_run).
            with activation_sharding(self.mesh):
                return jitted(state, batch)

        return run

    # ---------------------------------------------------------------- tokenization
    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt (chat template applied when the source is a chat source)."""
        if self.source.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def decode_completion(self, ids: np.ndarray, mask: np.ndarray) -> str:
        """Text of a completion's valid tokens, without the stop token and special tokens."""
        toks = [int(t) for t, m in zip(ids, mask) if m and int(t) != self.eos_id]
        return self.tokenizer.decode(toks, skip_special_tokens=True)

    # ---------------------------------------------------------------- SFT warm start
    def _sft_batch(self, start: int, count: int, prompt_len: int, completion_len: int) -> dict:
        exs = self.source.train_batch(start, count)
        p_ids = np.zeros((count, prompt_len), np.int32)
        p_mask = np.zeros((count, prompt_len), bool)
        c_ids = np.zeros((count, completion_len), np.int32)
        c_mask = np.zeros((count, completion_len), bool)
        for i, ex in enumerate(exs):
            p = self.encode_prompt(ex.prompt)[-prompt_len:]
            c = (list(self.tokenizer(self.source.sft_target(ex), add_special_tokens=False)["input_ids"])
                 + [self.eos_id])[:completion_len]
            p_ids[i, prompt_len - len(p):] = p
            p_mask[i, prompt_len - len(p):] = True
            c_ids[i, :len(c)] = c
            c_mask[i, :len(c)] = True
        return dict(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask)

    def _prompt_bucket(self, prompts) -> int:
        return _round_up(max(len(p) for p in prompts), 8)

    # ---------------------------------------------------------------- sampler
    def _weights_path(self, version: int) -> str:
        return os.path.join(self.workdir, "weights", f"v{version:06d}")

    def push_weights(self, params, version: int) -> str:
        """Saves `params` as weights version `version` (orbax) and keeps the two newest versions on disk."""
        from pdm_jax.sampler.weights import save_weights

        path = self._weights_path(version)
        if os.path.exists(path):
            shutil.rmtree(path)
        save_weights(params, path, version=version)
        root = os.path.join(self.workdir, "weights")
        keep = {os.path.basename(self._weights_path(v)) for v in (version, version - 1, 0)}
        for name in os.listdir(root):
            if name.startswith("v") and name not in keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        return path

    def _engine_limits(self) -> dict:
        sc, rl = self.config.sampler, self.config.rl
        return dict(max_prompt_length=int(sc.max_prompt_length),
                    max_new_tokens=int(rl.max_new_tokens), max_batch_size=int(sc.max_batch_size))

    def _make_engine(self, version: int, quantization: str):
        from pdm_jax.sampler.engine import InProcessSampler, SamplingEngine
        from pdm_jax.sampler.weights import load_weights

        path = self._weights_path(version)
        engine = SamplingEngine(self.model_config, load_weights(path, self.model_config), quantization=quantization,
                                version=version, weights_path=path, **self._engine_limits())
        return InProcessSampler(engine, checkpoint_root=self.workdir)

    def _start_sampler(self, version: int):
        sc = self.config.sampler
        path = self._weights_path(version)
        if sc.mode == "subprocess":
            from pdm_jax.sampler.launcher import start_sampler_server

            self._sampler_proc = start_sampler_server(
                model_config=os.path.join(self.workdir, "model", "config.json"), weights=path,
                version=version, quantization=sc.quantization, checkpoint_root=self.workdir,
                startup_timeout_s=sc.startup_timeout_s,
                client_kwargs=dict(timeout_s=sc.request_timeout_s, retries=sc.retries),
                **self._engine_limits())
            self._sampler = self._sampler_proc.client
        elif sc.mode == "remote":
            from pdm_jax.sampler.client import SamplerClient

            self._sampler_proc = None
            self._sampler = SamplerClient(sc.address, timeout_s=sc.request_timeout_s, retries=sc.retries,
                                          token=sc.token or None)
            try:
                self._sampler.health()
            except Exception as e:  # noqa: BLE001 - any transport error means "not reachable"
                raise SamplerFailure(f"sampler.address = {sc.address!r} is not reachable "
                                     f"(after {sc.retries} retries): {e}") from e
            self._sampler.load_weights(path, version)
        else:
            self._sampler_proc = None
            self._sampler = self._make_engine(version, sc.quantization)
        self._sampler_version = version
        self._sampler_generation += 1

    def _sampler_call(self, fn_name: str, *args, **kwargs):
        """Calls the sampler; restarts a dead subprocess sampler (with the current weights) and retries.

        Generation requests carry a seed, so a retried request returns the same
        rollouts: no training batch is lost or duplicated.
        """
        restarts = 0
        while True:
            generation = self._sampler_generation
            try:
                return getattr(self._sampler, fn_name)(*args, **kwargs)
            except (ValueError, TypeError):
                raise
            except Exception as e:  # connection errors, timeouts, 5xx after the client's own retries
                proc = getattr(self, "_sampler_proc", None)
                if proc is None or restarts >= self.config.sampler.max_restarts:
                    raise SamplerFailure(f"sampler call {fn_name} failed after {restarts} restarts: {e}") from e
                restarts += 1
                with self._sampler_lock:
                    if generation != self._sampler_generation:
                        continue  # another thread already restarted it
                    self._restarts_total += 1
                    log.warning("sampler call %s failed (%s); restarting the sampler (%d/%d)", fn_name, e,
                                restarts, self.config.sampler.max_restarts)
                    try:
                        proc.stop()
                    except Exception:  # noqa: BLE001 - it may already be gone
                        pass
                    self._start_sampler(self._sampler_version)

    def _fault_injection(self, rl_step: int) -> None:
        """Test hooks (config.debug): kill the sampler or this process after an RL step."""
        dbg = self.config.get("debug")
        if dbg is None:
            return
        if dbg.kill_sampler_after_rl_step == rl_step and self._sampler_proc is not None:
            log.warning("debug: killing the sampler process after RL step %d", rl_step)
            self._sampler_proc.proc.kill()
        if dbg.kill_after_rl_step == rl_step:
            log.warning("debug: SIGKILL to the trainer after RL step %d", rl_step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _sync_sampler(self, params, version: int) -> None:
        path = self.push_weights(params, version)
        self._sampler_call("load_weights", path, version)
        self._sampler_version = version

    def _stop_sampler(self):
        proc = getattr(self, "_sampler_proc", None)
        if proc is not None:
            proc.stop()
            self._sampler_proc = None
        self._sampler = None

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, version: int) -> dict:
        """avg@k accuracy (k = eval.samples_per_prompt at the training temperature) and greedy accuracy.

        Runs an in-process, unquantized engine on weights version `version`
        (the trainer's own parameters) over the first eval.num_prompts held-out prompts.
        """
        ec = self.config.eval
        if self._eval_engine is None:
            self._eval_engine = self._make_engine(version, "none")
        elif self._eval_engine.version != version:
            self._eval_engine.load_weights(self._weights_path(version), version)
        exs = self.source.eval_examples()[: ec.num_prompts]
        if len(exs) < ec.num_prompts:
            raise ValueError(f"eval.num_prompts = {ec.num_prompts} but the source has only {len(exs)} held-out prompts")
        prompts = [self.encode_prompt(e.prompt) for e in exs]
        out = {}
        rb = self._eval_engine.generate(prompts, n=ec.samples_per_prompt, temperature=self.config.rl.temperature,
                                        max_new_tokens=self.config.rl.max_new_tokens, top_k_logprobs=1,
                                        stop_token_ids=[self.eos_id], seed=10_007 + self.config.seed)
        scores = self._score(rb, exs, ec.samples_per_prompt)
        # Accuracy counts fully correct answers only (some verifiers give partial credit).
        out["eval_accuracy"] = float(np.mean(scores >= CORRECT_SCORE))
        out["eval_reward"] = float(np.mean(scores))
        if ec.greedy:
            rb = self._eval_engine.generate(prompts, n=1, temperature=0.0, max_new_tokens=self.config.rl.max_new_tokens,
                                            top_k_logprobs=1, stop_token_ids=[self.eos_id], seed=0)
            out["eval_greedy_accuracy"] = float(np.mean(self._score(rb, exs, 1) >= CORRECT_SCORE))
        return out

    def _score(self, rb: RolloutBatch, examples, n: int) -> np.ndarray:
        """Verifier rewards [N] f32 of each completion against its prompt's example (rows prompt-major)."""
        texts = [self.decode_completion(rb.completion_ids[i], rb.completion_mask[i]) for i in range(rb.num_sequences)]
        exs = [examples[i // n] for i in range(rb.num_sequences)]
        if hasattr(self.source, "score_batch"):  # concurrent verification (math-verify workers)
            return np.asarray(self.source.score_batch(texts, exs), np.float32)
        return np.asarray([self.source.score(t, e) for t, e in zip(texts, exs)], np.float32)

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        """Runs (or resumes) the whole job; returns the summary dict also written to summary.json."""
        cfg = self.config
        t_start = time.time()
        sft_tx, _ = ts.make_optimizer(cfg.sft.learning_rate, warmup_steps=cfg.sft.warmup_steps,
                                      max_grad_norm=cfg.rl.max_grad_norm)
        rl_tx, rl_schedule = ts.make_optimizer(cfg.rl.learning_rate, weight_decay=cfg.rl.weight_decay,
                                               b1=cfg.rl.adam_b1, b2=cfg.rl.adam_b2,
                                               max_grad_norm=cfg.rl.max_grad_norm,
                                               warmup_steps=cfg.rl.warmup_steps)
        meta = dict(phase="sft", sft_step=0, rl_step=0, data_position=0, sampler_version=0,
                    wall_seconds=0.0, warmstart=None, seed=int(cfg.seed))
        state = None
        resumed = self.checkpointer.latest_step() is not None
        if resumed:
            # Checkpoints are written once the warm start is done and evaluated, then during RL.
            state, meta = self.checkpointer.restore(abstract_like(self._make_state(self.params, rl_tx)))
            self.params = state.params
            log.info("resumed %s at RL step %d", self.workdir, meta["rl_step"])
        self._wall_base = float(meta.get("wall_seconds", 0.0))
        self._t_start = t_start
        if jax.process_index() == 0:
            writer = MetricsWriter(self.workdir, tensorboard=cfg.log.tensorboard,
                                   resume_from_step=meta["rl_step"] + 1 if resumed else None)
        else:  # multi-host: only process 0 writes metrics (pdm_jax.distributed)
            from pdm_jax.distributed import NullMetricsWriter

            writer = NullMetricsWriter()
        try:
            if not resumed:
                self._run_sft(sft_tx, writer)
                # The warm start becomes sampler version 0, evaluated before any RL step.
                self.push_weights(self.params, 0)
                meta["warmstart"] = self.evaluate(0)
                writer.write(0, "eval", meta["warmstart"])
                log.info("warm start evaluated: %s", _fmt(meta["warmstart"]))
                meta["phase"] = "rl"
                meta["sft_step"] = int(cfg.sft.steps)
                state = self._make_state(self.params, rl_tx)
                self._checkpoint(state, meta)
            summary = self._run_rl(state, rl_tx, rl_schedule, meta, writer)
        finally:
            self._stop_sampler()
            writer.close()
        return summary

    def _wall_seconds(self) -> float:
        return self._wall_base + (time.time() - self._t_start)

    def _checkpoint(self, state, meta):
        meta["wall_seconds"] = self._wall_seconds()
        self.checkpointer.save(int(self.config.sft.steps) + int(meta["rl_step"]) + 1, state, dict(meta))

    def _run_sft(self, tx, writer) -> None:
        """Supervised warm start on the task's reference answers (config.sft); updates self.params."""
        cfg = self.config
        if cfg.sft.steps == 0:
            return
        from tqdm.auto import tqdm

        state = self._make_state(self.params, tx)
        step_fn = self._jit_step(ts.make_sft_train_step(self.graphdef, tx), state)
        probe = self.source.train_batch(0, 64)
        prompt_len = self._prompt_bucket([self.encode_prompt(e.prompt) for e in probe])
        completion_len = cfg.rl.max_new_tokens
        bs = cfg.sft.batch_size
        bar = tqdm(range(cfg.sft.steps), desc="warm start (SFT)", disable=not cfg.log.progress, **_tqdm_kwargs())
        m = {}
        for step in bar:
            batch = self._put_batch(self._sft_batch(step * bs, bs, prompt_len, completion_len))
            state, m = step_fn(state, batch)
            if (step + 1) % 50 == 0 or step + 1 == cfg.sft.steps:
                m = jax.device_get(m)
                bar.set_postfix(loss=f"{float(m['loss']):.3f}", acc=f"{float(m['token_accuracy']):.3f}",
                                refresh=False)
                writer.write(step + 1, "sft", m)
        self.params = state.params

    def _run_rl(self, state, tx, schedule, meta, writer) -> dict:
        cfg = self.config
        rl = cfg.rl
        from tqdm.auto import tqdm

        loss_cfg = ts.PolicyLossConfig(
            policy_loss=rl.policy_loss, tis_cap=rl.tis_cap, clip_eps_low=cfg.trust_region.clip_eps_low,
            clip_eps_high=cfg.trust_region.clip_eps_high, dual_clip=rl.dual_clip,
            loss_aggregation=rl.loss_aggregation, max_response_length=rl.max_new_tokens,
            kl_beta=rl.kl_beta, kl_estimator=rl.kl_estimator, temperature=rl.temperature,
            logits_chunk_size=int(rl.get("logits_chunk_size", 0)))
        step_fn = self._jit_step(ts.make_rl_train_step(self.graphdef, tx, self.tr_config, loss_cfg), state)
        ref_fn = ref_params = None
        if rl.kl_beta > 0:
            from pdm_jax.sampler.weights import load_weights

            ref_params = jax.tree.map(lambda x: x, state.params)
            ref_params.replace_by_pure_dict(load_weights(self._weights_path(0), self.model_config))
            ref_params = jax.device_put(ref_params, self._params_sharding)
            ref_fn = jax.jit(ts.make_logprob_fn(self.graphdef, rl.temperature))
        version = meta["sampler_version"]
        summary_path = os.path.join(self.workdir, "summary.json")
        if meta["rl_step"] >= rl.steps and os.path.exists(summary_path):
            log.info("all %d RL steps are done; summary in %s", rl.steps, summary_path)
            with open(summary_path) as f:
                return json.load(f)
        if not os.path.exists(self._weights_path(version)):
            self.push_weights(state.params, version)
        self._start_sampler(version)
        log.info("sampler ready (%s, %s weights, version %d); %d GRPO steps to go", cfg.sampler.mode,
                 cfg.sampler.quantization, version, rl.steps - meta["rl_step"])
        n_seq = rl.prompts_per_step * rl.group_size
        mb = n_seq // rl.num_minibatches
        bar = tqdm(range(meta["rl_step"], rl.steps), desc="GRPO", disable=not cfg.log.progress,
                   initial=meta["rl_step"], total=rl.steps, **_tqdm_kwargs())
        producer = _RolloutProducer(self, meta["data_position"], meta["rl_step"], rl.steps)
        last_eval = {}
        try:
            for step in bar:
                t0 = time.time()
                rb, examples, gen_seconds = producer.get(step, version)
                t_gen = time.time() - t0
                rewards = self._score(rb, examples, rl.group_size)
                rb = rb.replace(rewards=rewards)
                adv = np.asarray(objectives.group_advantages(jnp.asarray(rewards), rl.group_size,
                                                             normalize_std=rl.normalize_advantage_std))
                prompt_len = _round_up(rb.prompt_ids.shape[1], 8)
                arrays = rollout_to_arrays(rb, adv, prompt_len, rl.max_new_tokens)
                if ref_fn is not None:
                    arrays["ref_logprobs"] = np.asarray(ref_fn(ref_params, self._put_batch(arrays)))
                t1 = time.time()
                step_metrics = []
                rng = np.random.default_rng([cfg.seed, step])
                for _ in range(rl.num_iterations):
                    perm = rng.permutation(n_seq)
                    for j in range(rl.num_minibatches):
                        rows = perm[j * mb:(j + 1) * mb]
                        sub = self._put_batch({k: v[rows] for k, v in arrays.items()})
                        for cb in self.callbacks:
                            cb.before_update(self, step + 1, sub, state)
                        state, m = step_fn(state, sub)
                        for cb in self.callbacks:
                            cb.after_update(self, step + 1, sub, state, m)
                        step_metrics.append(m)
                step_metrics = jax.device_get(step_metrics)
                t_train = time.time() - t1
                version += 1
                meta["sampler_version"] = version
                meta["rl_step"] = step + 1
                meta["data_position"] = producer.data_position_after(step)
                self._sync_sampler(state.params, version)
                producer.notify_version(version)
                tokens = int(rb.completion_mask.sum())
                rec = {k: float(np.mean([float(m[k]) for m in step_metrics])) for k in step_metrics[0]}
                first = step_metrics[0]
                rec.update(
                    reward=float(rewards.mean()),
                    accuracy=float((rewards >= CORRECT_SCORE).mean()),
                    response_length=float(rb.completion_mask.sum(1).mean()),
                    frac_masked_first_minibatch=float(first["frac_masked"]),
                    learning_rate=float(schedule(int(state.step) - 1)),
                    step_seconds=time.time() - t0,
                    generate_seconds=t_gen,
                    train_seconds=t_train,
                    sampler_tokens_per_second=tokens / max(gen_seconds, 1e-9),
                    staleness=float(np.mean(version - 1 - rb.weights_version)),
                    sampler_restarts=float(self._restarts_total),
                )
                if (step + 1) % cfg.eval.every_steps == 0 or step + 1 == rl.steps:
                    last_eval = self.evaluate(version)
                    writer.write(step + 1, "eval", last_eval)
                    log.info("eval after RL step %d: %s", step + 1, _fmt(last_eval))
                writer.write(step + 1, "rl", rec)
                bar.set_postfix(reward=f"{rec['reward']:.2f}", masked=f"{rec['frac_masked']:.3f}",
                                kl=f"{rec['mean_topk_kl']:.4f}", refresh=False)
                if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == rl.steps:
                    self._checkpoint(state, meta)
                self._fault_injection(step + 1)
        finally:
            producer.close()
        self.params = state.params
        wall = self._wall_seconds()
        if not last_eval:
            last_eval = self.evaluate(version)
        warm = meta.get("warmstart") or {}
        summary = dict(
            warmstart_accuracy=warm.get("eval_accuracy"),
            warmstart_greedy_accuracy=warm.get("eval_greedy_accuracy"),
            final_accuracy=last_eval.get("eval_accuracy"),
            final_greedy_accuracy=last_eval.get("eval_greedy_accuracy"),
            steps=int(meta["rl_step"]),
            sft_steps=int(cfg.sft.steps),
            wall_seconds=float(wall),
            eval_prompts=int(cfg.eval.num_prompts),
            eval_samples_per_prompt=int(cfg.eval.samples_per_prompt),
            trust_region=dict(cfg.trust_region.to_dict()),
            sampler_quantization=cfg.sampler.quantization,
        )
        if jax.process_index() == 0:
            with open(os.path.join(self.workdir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            plot_curves(read_metrics(writer.path), os.path.join(self.workdir, "curves.png"))
        return summary


class _RolloutProducer:
    """Produces rollout batches in step order, with at most `max_staleness` versions of lag.

    With max_staleness = 0 generation is synchronous (batch i is sampled with
    version i, right after the trainer pushed it). With max_staleness = s > 0 a
    background thread samples batch i as soon as the sampler holds a version
    >= i - s, overlapping generation with training. Batch i always uses the
    prompts at data positions [i*P, (i+1)*P) and the seed derived from (seed, i),
    so a retried or resumed batch is the same batch.
    """

    def __init__(self, trainer: Trainer, data_position: int, first_step: int, last_step: int):
        self.t = trainer
        self.rl = trainer.config.rl
        self.base_position = data_position - first_step * self.rl.prompts_per_step
        self.staleness = int(self.rl.max_staleness)
        self.version = trainer._sampler_version
        self._cv = threading.Condition()
        self._ready: dict[int, tuple] = {}
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread = None
        if self.staleness > 0:
            self._thread = threading.Thread(target=self._loop, args=(first_step, last_step), daemon=True)
            self._thread.start()

    def data_position_after(self, step: int) -> int:
        return self.base_position + (step + 1) * self.rl.prompts_per_step

    def _make(self, step: int):
        rl = self.rl
        examples = self.t.source.train_batch(self.base_position + step * rl.prompts_per_step, rl.prompts_per_step)
        prompts = [self.t.encode_prompt(e.prompt) for e in examples]
        t0 = time.time()
        rb = self.t._sampler_call(
            "generate", prompts, n=rl.group_size, temperature=rl.temperature, max_new_tokens=rl.max_new_tokens,
            top_k_logprobs=rl.top_k_logprobs, stop_token_ids=[self.t.eos_id],
            seed=int(self.t.config.seed) * 1_000_003 + step)
        return rb, examples, time.time() - t0

    def _loop(self, first, last):
        try:
            for step in range(first, last):
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self.version >= step - self.staleness)
                    if self._stop:
                        return
                item = self._make(step)
                with self._cv:
                    self._ready[step] = item
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced in get()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def get(self, step: int, version: int):
        if self._thread is None:
            return self._make(step)
        with self._cv:
            self._cv.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                raise self._error
            return self._ready.pop(step)

    def notify_version(self, version: int):
        with self._cv:
            self.version = version
            self._cv.notify_all()

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)


class TrainerCallback:
    """Base class of RL-phase hooks (see `Trainer`): both methods do nothing by default."""

    def before_update(self, trainer: Trainer, rl_step: int, batch: dict, state: ts.TrainState) -> None:
        """Called before each optimizer step with the device batch and the current state."""

    def after_update(self, trainer: Trainer, rl_step: int, batch: dict, state: ts.TrainState, metrics: dict) -> None:
        """Called after each optimizer step with the same batch, the new state and the step's metrics."""
