"""Batched, jitted KV-cache generation with behaviour log-probabilities and top-K.

`SamplingEngine` holds a quantized copy of the policy (see `quantize.py`) and
turns prompts into a `RolloutBatch`: for every generated token the sampled id,
log mu of it, and the K most likely ids with their log mu, where
mu = softmax(z_q / tau) is *the distribution the token was drawn from*
(DESIGN.md section 1).

The batching programs live in `static_batching` and `continuous_batching`; the per-token draw and its
reproducible keys in `sampling`.

Finish reasons: ``"stop"`` when a stop token was generated (it is kept in the
completion and in the mask), ``"length"`` when ``max_new_tokens`` was reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax import sharding as shd
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.rollout import ROUTING_PAD, GenerateParams, RolloutBatch, build_batch, pad_axis
from pdm_jax.sampler import continuous_batching, static_batching, wire, wire_response
from pdm_jax.sampler import quantize as quant
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler.continuous_batching import _MIN_PHASE, cache_phases, tail_levels  # noqa: F401
from pdm_jax.sampler.limits import check_engine_mesh
from pdm_jax.sampler.spec import EngineSpec
from pdm_jax.sampler.sampling import Draw, hoist_layer_slices, laid_out, next_pow2, sampling_distribution  # noqa: F401
from pdm_jax.sampler.static_batching import cache_segments  # noqa: F401
# Request validation lives with the wire schema (its errors name wire fields); re-exported here.
from pdm_jax.sampler.wire import MAX_SEED, MIN_TEMPERATURE, RequestError  # noqa: F401
from pdm_jax.sampler.wire_request import validate_request  # noqa: F401

log = logging.getLogger(__name__)

def resolve_compute_dtype(compute_dtype, quantization: str, backend: Optional[str] = None):
    """The sampler's compute dtype: an explicit float32/bfloat16, or the choice of ``"auto"`` / None.

    ``auto``: float32 for quantization ``none`` (bit-compatible with the trainer);
    for ``bf16`` / ``fp8`` float32 on the CPU backend -- XLA:CPU has no fast bf16
    matmul (bf16 decode measured 3x slower than f32 at batch 32, ``bench/bench_sampler.py``),
    and the weights keep their bf16/fp8/int8/int4 values exactly in f32 -- and bfloat16 on
    TPU/GPU (`backend`, default ``jax.default_backend()``).

    Raises:
      ValueError: naming ``compute_dtype`` and its value for anything else.
    """
    quant.check_quantization(quantization)
    if compute_dtype is None or (isinstance(compute_dtype, str) and compute_dtype == "auto"):
        if quantization == "none" or (backend or jax.default_backend()) == "cpu":
            return jnp.dtype(jnp.float32)
        return jnp.dtype(jnp.bfloat16)
    try:
        dtype = jnp.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"compute_dtype = {compute_dtype!r}: must be one of {quant.COMPUTE_DTYPES}")
    return dtype


class StaleWeightsError(wts.WeightsError):
    """A weights load with a version that is not newer than the current one."""


def abstract_engine_model(config, dtype) -> Qwen3ForCausalLM:
    """The engine's model as abstract arrays (``nnx.eval_shape``) in ``dtype``; the dry run compiles the same.

    A MoE model's experts run with ``moe_implementation="auto"``: the grouped-matmul kernel for the
    platform the engine's programs are compiled for (`pdm_jax.models.moe.resolve_implementation`:
    megablox on TPU, row blocks on GPU, ``ragged_dot`` on CPU).
    """
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                                                   moe_implementation="auto"))



def make_sampler_mesh(data: int = 1, tensor: int = 1, devices=None):
    """The sharded engine's mesh: ``data`` x ``tensor`` devices (fsdp 1) over ``pdm_jax.sharding.MESH_AXES``.

    ``devices``: the first ``data * tensor`` of them are used (default ``jax.devices()``): a colocated
    engine takes a sub-mesh of the trainer's devices (or all of them), a server its own.
    Returns None for 1 x 1 (the single-device engine).
    Raises:
      ValueError: naming ``data`` / ``tensor`` for sizes < 1 or more devices than there are.
    """
    for name, v in (("data", data), ("tensor", tensor)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"sampler mesh: {name} must be an integer >= 1, got {v!r}")
    if data * tensor == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if data * tensor > len(devices):
        raise ValueError(f"sampler mesh: data x tensor = {data} x {tensor} = {data * tensor} devices, "
                         f"but only {len(devices)} are available")
    return shd.make_mesh(data=int(data), fsdp=1, tensor=int(tensor), devices=devices[:data * tensor])


class SamplingEngine:
    """Quantized-copy sampler with KV-cache decode; produces `RolloutBatch`es.

    Args:
      config: ``pdm_jax.models.qwen3.Qwen3Config``.
      params: trainer weights: an ``nnx.Module``, ``nnx.State`` or nested pure
        dict of arrays (any float dtype; f32 expected).
      spec: the engine's settings (`pdm_jax.sampler.spec.EngineSpec`: quantization, compute dtype, limits,
        buckets, batching, slots, parking, weight noise); default ``EngineSpec()``.
      settings: `EngineSpec` fields that replace the spec's (``SamplingEngine(cfg, params, batching="static")``);
        an unknown name is a TypeError.
      version: weights version of `params`, reported per sequence.
      weights_path: where `params` came from (for idempotent reloads), or None.
      device: a ``jax.Device`` that holds the sampler's weights and runs generation (a colocated
        engine: one of the trainer's devices). `set_params` then builds the copy there from
        parameters sharded anywhere (`quantize.prepare_sampler_params`' ``device``), never
        sharing a buffer with them, and counts NaN/inf in every leaf. None (a server, a
        file-fed engine): the default device.
      mesh: a ``jax.sharding.Mesh`` over ``pdm_jax.sharding.MESH_AXES`` (`make_sampler_mesh`): the
        sharded engine. Its weights (and their quantized copies) are placed by the model's logical-axis
        rules (`pdm_jax.sharding.param_shardings`: heads / kv heads / MLP / vocab over ``tensor``,
        ``embed`` over ``fsdp``), the programs are traced under `sharding.activation_sharding` (rows
        over ``data`` x ``fsdp``) and every KV cache is constrained to `sharding.KV_CACHE_K_AXES` /
        ``_V_AXES`` (rows over data, kv heads over tensor).  Batch buckets start at the row-shard
        count.  Same tokens as the single-device engine; log mu within float32 reduction-order
        rounding (tests/test_sampler_sharded.py).  Excludes `device`.  None: one device.
    Raises:
      ValueError: bad settings (`EngineSpec`), prompt + new tokens beyond the
        model's ``max_position_embeddings``; with `mesh`, attention heads,
        kv heads or the MLP width not divisible by the ``tensor`` axis, or ``max_batch_size`` /
        ``max_slots`` not divisible by the row shards (`check_engine_mesh`).
    """

    def __init__(self, config, params, spec: Optional[EngineSpec] = None, *, version: int = 0,
                 weights_path: Optional[str] = None, device=None, mesh=None,
                 output_axes_fn=quant.default_output_axes, **settings):
        spec = dataclasses.replace(spec or EngineSpec(), **settings)  # validated there (EngineSpec.__post_init__)
        if spec.max_prompt_length + spec.max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"SamplingEngine: max_prompt_length + max_new_tokens = "
                             f"{spec.max_prompt_length + spec.max_new_tokens} exceeds max_position_embeddings = "
                             f"{config.max_position_embeddings}")
        self.spec = spec
        self.config = config
        self.quantization = spec.quantization
        self.weight_noise = float(spec.weight_noise)
        self.weight_noise_seed = int(spec.weight_noise_seed)
        self.compute_dtype = resolve_compute_dtype(spec.compute_dtype, spec.quantization)
        self.max_prompt_length = int(spec.max_prompt_length)
        self.max_new_tokens = int(spec.max_new_tokens)
        self.max_batch_size = next_pow2(int(spec.max_batch_size))
        self.min_prompt_bucket = int(spec.min_prompt_bucket)
        self.min_new_tokens_bucket = int(spec.min_new_tokens_bucket)
        self.max_stop_tokens = int(spec.max_stop_tokens)
        self.max_sequences = int(spec.max_sequences)
        self.first_cache_segment = int(spec.first_cache_segment)
        self.share_prefill = bool(spec.share_prefill)
        self.batching = spec.batching
        self.max_slots = next_pow2(int(spec.max_batch_size if spec.max_slots is None else spec.max_slots))
        if mesh is not None and device is not None:
            raise ValueError("SamplingEngine: give either device (one device) or mesh (sharded), not both")
        self.mesh = mesh
        self.row_shards = 1 if mesh is None else check_engine_mesh(
            config, mesh, max_batch_size=self.max_batch_size, max_slots=self.max_slots)
        self.program_shapes = set()  # distinct (program, static shapes) run: each one compiled once (logged)
        self.min_cache_phase = _MIN_PHASE  # continuous batching: shortest cache phase (`cache_phases`; tests lower it)
        self.last_decode_steps = 0  # decode steps of the last program run (bench)
        self.parked_rows = 0  # rows parked so far by continuous programs (the spec's parking)
        self._output_axes_fn = output_axes_fn
        self.device = device
        self.slice_layers_once = hoist_layer_slices(device.platform if device is not None else
                                                   mesh.devices.flat[0].platform if mesh is not None else
                                                   jax.default_backend())
        dt = self.compute_dtype
        abstract_model = abstract_engine_model(config, dt)
        self._graphdef, self._abstract_state = nnx.split(abstract_model)
        self._shardings = None if mesh is None else nnx.to_pure_dict(
            shd.param_shardings(nnx.state(abstract_model, nnx.Param), mesh))
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()  # one weights load at a time; generation goes on while its files are read
        self.loading: Optional[dict] = None  # {"version", "since"} while a load reads its files (`health`)
        self.prefill_rows = 0  # prompt rows prefilled so far (padding rows included), with shared prefill
        self.prefill_rows_unshared = 0  # ... and what they would have been without it
        self._state = None
        self._version = None
        self._weights_path = None
        self.set_params(params, version=version, weights_path=weights_path)

    # ----------------------------------------------------------------- weights
    @property
    def version(self) -> int:
        """The weights version currently loaded."""
        return self._version

    @property
    def weights_path(self) -> Optional[str]:
        """The directory the current weights were loaded from (None if given in memory)."""
        return self._weights_path

    def set_params(self, params, *, version: int, weights_path: Optional[str] = None,
                   finite_checked: bool = False) -> None:
        """Quantizes `params` (module/state/pure dict, f32) and installs them as `version`.

        Raises:
          WeightsError: the quantizer refuses the weights (e.g. non-finite, fp8) or
            they do not fit the model; the current weights stay installed.
        """
        pure = wts.to_pure_dict(params)
        try:
            prepared = quant.prepare_sampler_params(pure, self.quantization, compute_dtype=self.compute_dtype,
                                                    check_finite=not finite_checked,
                                                    output_axes_fn=self._output_axes_fn, device=self.device,
                                                    check_all_finite=self.device is not None or self.mesh is not None,
                                                    shardings=self._shardings, weight_noise=self.weight_noise,
                                                    noise_seed=self.weight_noise_seed)
        except ValueError as e:  # e.g. a non-finite weight refused by the fp8 quantizer
            where = f" from {weights_path!r}" if weights_path else ""
            raise wts.WeightsError(f"weights version {version}{where} cannot be quantized "
                                   f"({self.quantization}): {e}") from e
        state = jax.tree.map(lambda x: x, self._abstract_state)
        try:
            nnx.replace_by_pure_dict(state, prepared)
        except Exception as e:
            raise wts.WeightsError(f"parameters do not match the model structure: {type(e).__name__}: {e}") from e
        bad = [(str(a.shape), str(b.shape)) for a, b in zip(jax.tree.leaves(state),
                                                            jax.tree.leaves(self._abstract_state))
               if tuple(a.shape) != tuple(b.shape)]
        if bad:
            raise wts.WeightsError(f"parameter shapes do not match the model: got {bad[0][0]}, expected {bad[0][1]}")
        with self._lock:
            # prepared on self.device / on the mesh
            self._state = jax.device_put(state) if self.device is None and self.mesh is None else state
            self._version = int(version)
            self._weights_path = None if weights_path is None else os.path.realpath(weights_path)

    def load_weights(self, path: str, version: int, *, root: Optional[str] = None) -> dict:
        """Loads weights `version` from a `save_weights` directory and re-quantizes.

        Accepted when ``version > self.version``, or ``version == self.version``
        and `path` is the directory the current weights came from (idempotent
        reload: the output is then identical).  The files are read without the lock generation holds (a slow or
        stuck read never stops serving; `health` reports ``loading`` meanwhile); `root` confines every read to a
        directory (`weights.ConfinedDir`: no link followed, no FIFO, sizes checked before reading).
        Returns ``{"version", "path", "seconds", "reloaded"}``.
        Raises:
          StaleWeightsError: version <= current (except the idempotent case).
          WeightsError: missing/incomplete/damaged directory (`weights.load_weights`
            checks its manifest), its recorded version differs from `version`
            (`weights.VersionMismatchError`), non-finite values, or shapes that do
            not match the model.  On any error the current weights stay.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) \
                or not 0 <= version <= wts.MAX_VERSION:
            raise wts.WeightsError(f"version must be an integer in [0, 2**31), got {version!r}")
        real = os.path.realpath(path)
        with self._load_lock:
            self._check_not_stale(version, real)
            t0 = time.perf_counter()
            self.loading = {"version": int(version), "since": time.monotonic()}
            try:
                pure = wts.load_weights(real, abstract=wts.to_pure_dict(self._abstract_state_f32()), version=version,
                                        root=root)
                with self._lock:
                    same = self._check_not_stale(version, real)
                    self.set_params(pure, version=int(version), weights_path=real,
                                    finite_checked=True)  # load refused NaN/inf
            finally:
                self.loading = None
            return wire_response.weights_loaded(version=int(version), path=real, seconds=time.perf_counter() - t0,
                                       reloaded=bool(same))

    def _check_not_stale(self, version: int, real: str) -> bool:
        """Raises StaleWeightsError unless `version` may load from `real` (`load_weights`); True for a reload."""
        with self._lock:
            same = version == self._version and self._weights_path is not None and real == self._weights_path
            if version < self._version or (version == self._version and not same):
                raise StaleWeightsError(
                    f"stale weights version {version}: the sampler holds version {self._version}"
                    f" (from {self._weights_path!r}); a new load needs a higher version, or the same version "
                    f"and the same path")
            return same

    def _abstract_state_f32(self):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), self._abstract_state)

    @property
    def params(self) -> dict:
        """The sampler's (quantized, compute-dtype) parameters as a nested pure dict."""
        return nnx.to_pure_dict(self._state)

    def model(self):
        """An ``nnx`` Qwen3ForCausalLM holding the sampler's current (quantized) weights."""
        return nnx.merge(self._graphdef, self._state)

    def health(self) -> dict:
        """``{"status", "model", "quantization", "weight_noise", "weight_noise_seed", "version", "compute_dtype",
        limits...}``."""
        c = self.config
        return wire_response.health_body(wire_response.EngineHealth(
            model=f"qwen3(L={c.num_hidden_layers},H={c.hidden_size},V={c.vocab_size})",
            quantization=self.quantization, weight_noise=self.weight_noise, weight_noise_seed=self.weight_noise_seed,
            version=self._version, compute_dtype=str(self.compute_dtype),
            vocab_size=c.vocab_size, max_prompt_length=self.max_prompt_length, max_new_tokens=self.max_new_tokens,
            weights_path=self._weights_path, loading=self.loading))

    # -------------------------------------------------------------- generation
    def validate(self, prompts, params: Optional[GenerateParams] = None, **fields) -> list:
        """`validate_request` of ``params`` with ``fields`` replaced (`GenerateParams.of`) against this engine's limits
        (raises RequestError; ``return_routing`` from a dense model is refused naming ``return_routing``)."""
        params = GenerateParams.of(params, **fields)
        if params.return_routing and not self.config.is_moe:
            raise RequestError(wire.RETURN_ROUTING, "the served model is dense (num_experts = 0): it has no "
                                                    "expert routing to return")
        if params.max_new_tokens is None:
            params = dataclasses.replace(params, max_new_tokens=self.max_new_tokens)
        return validate_request(prompts, params, vocab_size=self.config.vocab_size,
                                max_prompt_length=self.max_prompt_length, max_new_tokens_limit=self.max_new_tokens,
                                max_stop_tokens=self.max_stop_tokens, max_sequences=self.max_sequences)

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[GenerateParams] = None,
                 **fields) -> RolloutBatch:
        """Samples ``params.n`` completions per prompt; returns a RolloutBatch (rows prompt-major).

        Args:
          prompts: token-id lists, each 1..max_prompt_length long, ids in [0, V).
          params: the request (`GenerateParams`; None: its defaults), with ``fields`` replaced:
            n: samples per prompt (>= 1); row i*n+j is sample j of prompt i, group_ids = i.
            temperature: tau >= 0 (0 = greedy, logprobs then at tau = 1).
            max_new_tokens: 1..engine.max_new_tokens (default: the engine's).
            top_k_logprobs: K in [0, V]; topk_* arrays are [N, T, K] f32/int32.
            stop_token_ids: ids that end a sequence (kept, finish_reason "stop").
            seed: in [0, 2**63); None draws a fresh random seed.
            top_p, top_k: nucleus / top-k filters (off: 1.0 / 0).
            first_prompt_index: f >= 0: prompt i draws with the key of prompt f + i (module docstring);
              group_ids stay 0..len(prompts)-1.
            return_routing: MoE models only: also return ``routed_experts`` [N, P + T, L, k]
              (`rollout.routing_dtype`), the experts each layer ran for every prompt and completion
              token (routing replay, `RolloutBatch`); the tokens are the same either way.
        Returns:
          RolloutBatch with T = the longest completion; pads are id 0, logprob 0.
        Raises:
          RequestError: invalid request (names the field).
          TypeError: an unknown field.
        """
        params = GenerateParams.of(params, **fields)
        prompts = self.validate(prompts, params)
        n, seed, max_new_tokens = params.n, params.seed, params.max_new_tokens
        routing = bool(params.return_routing)
        max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        seed = secrets.randbelow(MAX_SEED + 1) if seed is None else int(seed)
        rows = [(i, j) for i in range(len(prompts)) for j in range(int(n))]
        draw = Draw(temperature=float(params.temperature), top_p=float(params.top_p), top_k=int(params.top_k),
                    max_new=max_new, k=int(params.top_k_logprobs), stops=list(params.stop_token_ids or ()), seed=seed,
                    n=int(n), routing=routing, key_offset=int(params.first_prompt_index))
        with self._lock:
            version, state = self._version, self._state
            if self.batching == "continuous":
                part = continuous_batching.run(self, state, prompts, rows, draw)
                return self._to_batch(prompts, rows, [part], version)
            parts = []
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start:start + self.max_batch_size]
                parts.append(static_batching.run(self, state, prompts, chunk, draw))
        return self._to_batch(prompts, rows, parts, version)

    def _layout(self):
        """The context programs run in: `sharding.activation_sharding` on the engine's mesh (the
        model's activation constraints and `laid_out` apply while tracing), or none."""
        return contextlib.nullcontext() if self.mesh is None else shd.activation_sharding(self.mesh)

    def _note_program(self, key: tuple) -> None:
        """Counts (``program_shapes``) and logs a program shape this engine has not run before: one compile
        each, plus a continuous bucket's tail program the first time a request needs it (engines of one model
        config share them: the jits are module-level)."""
        if key not in self.program_shapes:
            self.program_shapes.add(key)
            log.info("sampler: %d distinct generate programs; new: %s", len(self.program_shapes), key)

    def _to_batch(self, prompts, rows, parts, version) -> RolloutBatch:
        cat = {k: [p[k] for p in parts] for k in parts[0]}
        length = np.concatenate(cat["length"])
        t_out = int(max(length.max(), 1))
        tr = lambda a: np.concatenate([pad_axis(x[:, :t_out], t_out, 1) for x in a])  # noqa: E731
        routed = None
        if "routed" in cat:
            p_out = max(len(p) for p in prompts)
            routed = np.concatenate([_routing_rows(r, x.shape[1], p_out, t_out)
                                     for r, x in zip(cat["routed"], cat["tokens"])])
            last = length > 0  # a row's last token was sampled, never fed through the model: no routing
            routed[np.flatnonzero(last), p_out + length[last] - 1] = ROUTING_PAD
        return build_batch(
            prompts, group_ids=np.array([i for i, _ in rows], np.int32), lengths=length,
            completion_ids=tr(cat["tokens"]), behavior_logprobs=tr(cat["logp"]), topk_ids=tr(cat["topk_ids"]),
            topk_logprobs=tr(cat["topk_logp"]), weights_version=version,
            finish_reason=np.array(["stop" if s else "length" for s in np.concatenate(cat["stopped"])], dtype=object),
            routed_experts=routed)


def _routing_rows(routed, t_bucket: int, p_out: int, t_out: int) -> np.ndarray:
    """A program's ``routed`` [n, P_bucket + T_bucket, L, k] -> [n, p_out + t_out, L, k]: its prompt
    columns cut (or left-padded with `ROUTING_PAD`) to the last p_out, its completion columns to t_out."""
    p_bucket = routed.shape[1] - t_bucket
    prompt = routed[:, max(p_bucket - p_out, 0):p_bucket]
    prompt = np.pad(prompt, [(0, 0), (p_out - prompt.shape[1], 0), (0, 0), (0, 0)], constant_values=ROUTING_PAD)
    return np.concatenate([prompt, pad_axis(routed[:, p_bucket:p_bucket + t_out], t_out, 1, value=ROUTING_PAD)], axis=1)


def check_weights_path(path: str, checkpoint_root: str) -> str:
    """Resolves `path` (absolute, or relative to the root) and checks it lies under `checkpoint_root`.

    Raises:
      wts.WeightsError: not a non-empty string, a NUL byte, a ``..`` component,
        or a resolved path (symlinks followed) outside the root.
    """
    if not isinstance(path, str) or not path:
        raise wts.WeightsError(f"path must be a non-empty string, got {path!r}")
    if "\x00" in path:
        raise wts.WeightsError(f"path {path[:200]!r} contains a NUL byte; refused")
    if ".." in path.replace("\\", "/").split("/"):
        raise wts.WeightsError(f"path {path!r} contains '..'; refused")
    root = os.path.realpath(checkpoint_root)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise wts.WeightsError(f"path {path!r} is outside the checkpoint root {root!r}; refused")
    return full
