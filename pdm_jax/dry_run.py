"""Dry run: will this config's RL train step fit the target chips? (no checkpoint, no data needed)

``python -m pdm_jax.train --config=configs/qwen3_dapo.py:size=8b --dry_run`` prints a
per-device memory table of the sharded RL train step (one optimizer step on a
mini-batch of ``prompts_per_step * group_size / num_minibatches`` sequences of
``sampler.max_prompt_length + rl.max_new_tokens`` tokens) against the HBM of
``config.dry_run.chip`` on a mesh of ``config.dry_run.num_devices`` chips:

* **analytic** (always): parameters, gradients and AdamW state from the exact
  sharded parameter shapes (``pdm_jax.sharding`` rules on an ``AbstractMesh``),
  and an activation / loss model of the step (see :func:`analytic_plan`);
* **compiled** (``dry_run.mode`` "compile", or "auto" for models up to
  ``dry_run.max_compile_params``): the real jitted train step
  (``train_step.make_rl_train_step``, donated state, batch split over
  ``("data", "fsdp")``) is lowered on abstract inputs
  (``jax.ShapeDtypeStruct`` with ``NamedSharding``) and compiled for
  ``num_devices`` fake CPU devices; XLA's ``memory_analysis()`` gives the
  per-device argument, output and temporary bytes. CPU compilation makes
  different fusion and layout choices than TPU/GPU compilers, so the compiled
  numbers are an estimate of the accelerator's, not a measurement of it.

Fake CPU devices must be requested before JAX starts its backend:
:func:`prepare_devices` sets ``XLA_FLAGS=--xla_force_host_platform_device_count``
(the CLI calls it first thing); if the backend is already up with too few
devices the dry run falls back to the analytic plan and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Optional

# Importing jax does not start its backend: prepare_devices (the CLI's first call) still can set it up.
import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import xla_bridge
from jax.sharding import NamedSharding, PartitionSpec as P

from pdm_jax import aot
from pdm_jax.rl import train_step as ts
from pdm_jax.config import resolve_sampler_mode
from pdm_jax.distributed import opt_state_shardings
from pdm_jax.models.hf_io import load_config
from pdm_jax.models.presets import PRESETS, count_params, get_preset
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.models.tokenizer import char_vocab_size
from pdm_jax.rollout import round_up, routing_dtype
from pdm_jax.sampler import continuous_batching as cb
from pdm_jax.sampler import engine as eng
from pdm_jax.sampler.engine import abstract_engine_model, next_pow2
from pdm_jax.sampler.wire import MAX_STOP_TOKEN_IDS
from pdm_jax.rl.packing import PackingPlan
from pdm_jax.rl.step_batch import StepBatch
from pdm_jax.run_spec import RunSpec, run_spec
from pdm_jax.sections import compute_options, model_config_from_fields
from pdm_jax.sharding import (activation_sharding, kv_cache_specs, make_mesh, param_partition_specs,
                              param_shardings)


CHIP_HBM_GIB = aot.CHIP_HBM_GIB
GIB = 1024 ** 3

# Activation model of one decoder layer (bytes per token, see analytic_plan); the constants are
# counts of [tokens, width] buffers alive for the backward pass of this model's layer code.
_ACT_D_BUFFERS = 9  # residual in/out, 2 RMSNorm inputs/outputs (f32 statistics), o_proj and down outputs, misc
_ACT_QKV_BUFFERS = 3  # projection, q/k norm, RoPE output for q, k (v: projection only)
_ACT_F_BUFFERS = 4  # gate, up, silu(gate), silu(gate) * up
# Qwen3-MoE layer (pdm_jax.models.moe, ragged_dot path), per token: the F buffers above for each of its K
# expert assignments at width I, plus K gathered inputs and K expert outputs [K, D] in the compute dtype,
# and in f32 the router logits and softmax [2, E] and the weighted outputs [K, D].
_MOE_D_BUFFERS = 2
# Scanned layers: JAX's scan saves every residual of the layer body as its own stacked buffer, where XLA
# fuses and drops some in an unrolled program; measured on XLA:CPU for the tiny data-parallel config
# (compiled temp per token and layer, scanned / unrolled, attention buffers aside): 1.74.
_SCAN_RESIDUAL_FACTOR = 1.7
_LOSS_V_BUFFERS = 4  # logits, log-softmax, tail log pi (trust region), softmax for the backward
#: Bytes per [query, key] pair of the rollout engine's prefill attention: four f32 buffers (scores, masked scores,
#: exponentials, probabilities), as XLA:TPU allocates them (the 8B engine on v5p:2x2x1 prefilling 64 prompts of
#: 2,048 tokens, 8 heads a chip: 31.5 GiB of temporaries beside its prompt store; docs/scaling.md).
_PREFILL_SCORE_BYTES = 16


def prepare_devices(num_devices: int) -> bool:
    """Requests ``num_devices`` fake CPU devices if JAX's backend is not started yet; returns success.

    Sets ``JAX_PLATFORMS=cpu`` (and ``jax_platforms``, which jax read from the
    environment when it was imported) and ``--xla_force_host_platform_device_count``.
    Returns False (nothing changed) when a backend is already initialised with
    fewer devices.
    """
    if xla_bridge.backends_are_initialized():
        return len(jax.devices()) >= num_devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={num_devices}").strip()
    return True


def resolve_model_config(spec: RunSpec):
    """The ``Qwen3Config`` a run (its `pdm_jax.run_spec.RunSpec`) trains, without loading weights.

    Order: ``model.preset``; ``model.hf_path/config.json`` if it exists; a
    preset named like the checkpoint directory (``.../Qwen3-8B-Base`` ->
    ``qwen3_8b``, ``.../Qwen3-30B-A3B-Base`` -> ``qwen3_30b_a3b``); the explicit ``model.*`` fields with the
    vocabulary of the tokenizer (char tokenizer: ``len(symbols)`` + pad + eos; BPE: ``tokenizer.vocab_size``; or
    ``tokenizer.path/tokenizer.json``).

    Raises:
      ValueError: naming ``model.hf_path`` when none of these applies.
    """
    mc = spec.model
    if mc.preset:
        return get_preset(mc.preset)
    if mc.hf_path:
        if os.path.exists(os.path.join(mc.hf_path, "config.json")):
            return load_config(mc.hf_path)
        m = re.search(r"qwen3-(\d+(?:\.\d+)?)b(?:-a(\d+)b)?", os.path.basename(os.path.normpath(mc.hf_path)).lower())
        name = f"qwen3_{m.group(1).replace('.', 'p')}b" if m else None
        if m and m.group(2):  # a Qwen3-MoE name: Qwen3-30B-A3B -> qwen3_30b_a3b
            name += f"_a{m.group(2)}b"
        if name in PRESETS:
            return get_preset(name)
        raise ValueError(f"model.hf_path = {mc.hf_path!r}: no config.json there and the name matches no preset "
                         f"{sorted(PRESETS)}; set model.preset for a dry run")
    tc = spec.tokenizer
    if tc.kind == "char":
        vocab = char_vocab_size(tc.symbols)
    elif tc.kind == "bpe":  # the most it trains to
        vocab = tc.vocab_size
    else:
        with open(os.path.join(tc.path, "tokenizer.json")) as f:
            tok = json.load(f)
        vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    return model_config_from_fields(mc, vocab)


@dataclasses.dataclass
class StepShape:
    """Static shapes of one RL optimizer step: B sequences of P prompt + T completion tokens, top-K."""

    batch: int
    prompt_len: int
    completion_len: int
    top_k: int
    logits_chunk_size: int
    micro_batch_size: int = 0  # sequences per micro-batch (0: the whole mini-batch at once)
    attention: str = "dense"  # the training forward's attention, "auto" resolved for the target chip
    remat: str = "none"  # the per-layer remat policy (pdm_jax.models.REMAT_POLICIES)
    scan_layers: bool = False  # the layers run under lax.scan (model.scan_layers)
    packed_length: int = 0  # rl.pack_sequences: tokens per packed row (0: not packed)
    packed_rows: int = 0  # packed rows of the step (rows_per_micro_batch x micro-batches; see packed_rows_bound)

    @property
    def rows(self) -> int:
        """The model's rows per step: packed rows when packed, else the sequences."""
        return self.packed_rows if self.packed_length else self.batch

    @property
    def row_length(self) -> int:
        """Tokens per model row: the packed length, or P + T."""
        return self.packed_length or self.prompt_len + self.completion_len


def resolve_attention(attention: str, chip: str, seq: int) -> str:
    """``model.attention`` as the target chip would run it: "auto" is dense up to 512 tokens, else the
    chip's fused kernel (splash on TPU, cudnn on GPU), as ``pdm_jax.models.attention`` resolves it."""
    if attention != "auto":
        return attention
    if seq <= 512:
        return "dense"
    return "cudnn" if chip.startswith("H") else "splash"


def step_shape(spec: RunSpec, chip: Optional[str] = None) -> StepShape:
    """The mini-batch the trainer feeds one jitted step (sequences, padded lengths, K, chunk, attention, remat)."""
    rl = spec.rl
    n = rl.prompts_per_step * rl.group_size
    if rl.num_minibatches < 1 or n % rl.num_minibatches:
        raise ValueError(f"rl.num_minibatches = {rl.num_minibatches} must divide prompts_per_step x group_size = {n}")
    p = round_up(spec.sampler.max_prompt_length, 8)
    b = n // rl.num_minibatches
    packed = spec.packed_length if rl.pack_sequences else 0
    return StepShape(batch=b, prompt_len=p, completion_len=int(rl.max_new_tokens),
                     top_k=int(rl.top_k_logprobs), logits_chunk_size=int(rl.logits_chunk_size),
                     micro_batch_size=int(rl.micro_batch_size),
                     attention=resolve_attention(spec.model.attention, chip or spec.dry_run.chip,
                                                 packed or p + int(rl.max_new_tokens)),
                     remat=spec.model.remat, scan_layers=spec.model.scan_layers,
                     packed_length=packed, packed_rows=packed_rows_bound(b, int(rl.micro_batch_size)) if packed else 0)


def packed_rows_bound(batch: int, rows_per_micro_batch: int) -> int:
    """The most packed rows a mini-batch of ``batch`` sequences can need (one sequence per row), as
    ``pdm_jax.rl.packing.plan_packing`` rounds them: whole micro-batches, or a power of two."""
    return round_up(batch, rows_per_micro_batch) if rows_per_micro_batch > 0 else next_pow2(batch)


def mesh_sizes(spec: RunSpec, num_devices: int) -> dict:
    """{"data", "fsdp", "tensor"} sizes of the run's ``mesh`` on ``num_devices`` (-1 resolved)."""
    d, f, t = spec.mesh.axis_sizes(num_devices)
    return {"data": d, "fsdp": f, "tensor": t}


def _abstract_model(model_cfg, dtype, param_dtype, **compute):
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                                   **compute))


def _dtype(name):
    return jnp.dtype(name)


_PARAM_BYTES: dict = {}  # (model config, mesh sizes, dtype) -> param_bytes_per_device (dry_run_fit plans many)


def param_bytes_per_device(model_cfg, sizes: dict, param_dtype) -> tuple[int, int]:
    """(total parameter count, bytes of the parameters held by one device) under the sharding rules."""
    key = (model_cfg, tuple(sizes.items()), str(_dtype(param_dtype)))
    if key not in _PARAM_BYTES:
        _PARAM_BYTES[key] = _param_bytes_per_device(model_cfg, sizes, param_dtype)
    return _PARAM_BYTES[key]


def _param_bytes_per_device(model_cfg, sizes: dict, param_dtype) -> tuple[int, int]:
    abstract = _abstract_model(model_cfg, _dtype(param_dtype), _dtype(param_dtype))
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes.keys()))
    state = nnx.state(abstract, nnx.Param)
    specs = param_partition_specs(state, mesh=mesh)
    itemsize = _dtype(param_dtype).itemsize
    count = per_device = 0
    for (_, var), (_, spec) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
        spec = spec.get_value() if hasattr(spec, "get_value") else spec
        n = math.prod(var.get_value().shape)
        shards = 1
        for axes in spec:
            for a in (axes,) if isinstance(axes, str) else (axes or ()):
                shards *= sizes[a]
        count += n
        per_device += -(-n // shards) * itemsize
    return count, per_device


def analytic_plan(model_cfg, shape: StepShape, sizes: dict, *, dtype="float32", param_dtype="float32") -> dict:
    """Analytic per-device bytes of one RL train step (forward, backward, AdamW update).

    * ``params``: exact, from the sharded parameter shapes;
    * ``optimizer``: AdamW first and second moments (parameter dtype) = 2 x params;
    * ``gradients``: one parameter-sized buffer (two with micro-batches: the accumulator);
    * ``gathered``: sharded (FSDP / tensor) parameters all-gathered for use and
      their gradients before the reduce-scatter, upper bound 2 x (full - local)
      parameters in the compute dtype (XLA casts before it gathers; calibrated on XLA:TPU's
      compile of the Qwen3 recipes) (kept across the backward pass when the layers are unrolled
      without remat; with remat or scanned layers, which gather each layer's
      parameters inside the loop body, about three layers' worth, 3 / L of it);
    * ``activations``: buffers kept for the backward pass, per token of the
      local batch (B / (data*fsdp) sequences of P+T tokens, or the micro-batch's
      ``micro_batch_size`` / (data*fsdp) with ``rl.micro_batch_size``), per layer:
      ``a * (9 D + 3 (N+K) H + K H + 4 F)`` plus, for dense attention, the scores
      and probabilities ``(4 + a) N (P+T)`` (blockwise / splash / cudnn: only the
      output and log-sum-exp, ``N (a H + 4)``) (a = compute dtype bytes; heads, kv
      heads and F divided by the tensor axis when it divides them). With
      ``model.remat=full`` a layer keeps only its input (``a D``) and one layer's
      buffers are live again while it is recomputed; the dots policies keep the
      matmul outputs ``a ((N + 2K) H + 2 D + 2 F)``; with ``model.scan_layers`` the
      per-layer buffers besides attention count ``_SCAN_RESIDUAL_FACTOR`` times (JAX's scan
      keeps each residual of the layer body, XLA fuses some away when unrolled); in a
      Qwen3-MoE layer ``4 F`` becomes ``4 k I + 2 k D`` (k experts per token of width I,
      their gathered inputs and outputs) plus ``4 (2 E + k D)`` bytes in f32 (router logits
      and softmax, the weighted outputs), and the dots policies keep ``2 k I + k D + E``
      in place of ``2 F``; expert kernels are sharded over ``expert`` by the rules like any
      parameter (``params`` counts all E experts, not only the active ones); a mixed sparse /
      dense MoE model (``decoder_sparse_step`` > 1 or ``mlp_only_layers``) counts each layer by
      its own MLP, unscanned (such models always run unrolled);
    * ``loss``: 4 f32 ``[B, T, V]`` buffers (logits, log-softmax, the trust
      region's tail log pi, the softmax of the backward), or with
      ``logits_chunk_size`` c the same for ``[B, c, V]`` plus the ``[B, T, D]``
      hidden states and ``[B, T]`` per-token outputs;
    * ``batch``: the step's inputs.

    Returns a dict of bytes (ints) plus ``total``.
    """
    a = _dtype(dtype).itemsize
    tp = sizes["tensor"]
    dp = sizes["data"] * sizes["fsdp"]
    div = lambda n: n // tp if n % tp == 0 else n  # noqa: E731  (non-dividing axes stay replicated)
    c = model_cfg
    n_heads, n_kv = div(c.num_attention_heads), div(c.num_key_value_heads)
    f, v = div(c.intermediate_size), div(c.vocab_size)
    b_loc = -(-shape.batch // dp)
    # Activations and the loss's buffers live for one micro-batch at a time (its rows spread over all shards).
    m_loc = -(-shape.micro_batch_size // dp) if shape.micro_batch_size else b_loc
    seq = shape.prompt_len + shape.completion_len
    tokens = m_loc * seq
    h, d = c.head_dim, c.hidden_size
    dense = shape.attention == "dense"
    # Dense attention keeps its [S] scores and probabilities per query and head; the fused / blockwise
    # kernels keep only their output and log-sum-exp (their tiles are transient).
    attention = (4 + a) * n_heads * seq if dense else n_heads * (h * a + 4)
    scan = shape.scan_layers and not c.is_mixed  # mixed sparse / dense MoE models always run unrolled

    def layer_bytes(sparse: bool) -> tuple:
        """(bytes per token of one layer's buffers, bytes per token it keeps for the backward)."""
        if sparse:  # k expert assignments per token at width I (sharded over tensor like F)
            k, i = c.num_experts_per_tok, div(c.moe_intermediate_size)
            mlp_a, mlp_f32 = _ACT_F_BUFFERS * k * i + _MOE_D_BUFFERS * k * d, 4 * (2 * c.num_experts + k * d)
            mlp_dots = 2 * k * i + k * d + c.num_experts
        else:
            mlp_a, mlp_f32, mlp_dots = _ACT_F_BUFFERS * f, 0, 2 * f
        per_token = ((a * (_ACT_D_BUFFERS * d + _ACT_QKV_BUFFERS * (n_heads + n_kv) * h + n_kv * h + mlp_a)
                      + mlp_f32) * (_SCAN_RESIDUAL_FACTOR if scan else 1) + attention)
        if shape.remat == "none":
            return per_token, per_token
        if shape.remat == "full":  # each layer keeps its input; one layer's buffers are live while recomputed
            return per_token, a * d
        # dots policies keep the matmul outputs (q, k, v, o, gate, up, down) and recompute the rest
        return per_token, (a * ((n_heads + 2 * n_kv) * h + 2 * d + mlp_dots)
                           + (attention if shape.remat == "dots_saveable" and dense else 0))

    # Each layer by its own MLP: the sparse MoE block or (dense models, the dense layers of mixed MoE) the MLP.
    layers = [layer_bytes(c.is_moe and c.is_sparse_layer(j)) for j in range(c.num_hidden_layers)]
    recomputed = 0 if shape.remat == "none" else max(per_token for per_token, _ in layers)
    activations = tokens * (sum(kept for _, kept in layers) + recomputed) + tokens * d * a  # + embeddings
    t = shape.completion_len
    if shape.logits_chunk_size and shape.logits_chunk_size < t:
        loss = (_LOSS_V_BUFFERS * m_loc * shape.logits_chunk_size * v * 4 + 2 * m_loc * t * d * a
                + 8 * b_loc * t * 4)
    else:
        loss = _LOSS_V_BUFFERS * m_loc * t * v * 4
    n_params, params = param_bytes_per_device(c, sizes, param_dtype)
    full_params = n_params * _dtype(param_dtype).itemsize
    batch = b_loc * (shape.prompt_len * 5 + t * (4 + 1 + 4 + 8 * shape.top_k) + 4)
    gradients = params * (2 if shape.micro_batch_size else 1)  # + the accumulator of the micro-batch scan
    # XLA moves the compute-dtype cast before the all-gather (half the bytes to move): the gathered copies and
    # their gradients are compute-dtype arrays (XLA:TPU, the 8B / 30B-A3B recipes: docs/scaling.md).
    gathered = 2 * (full_params - params) * min(a, _dtype(param_dtype).itemsize) // _dtype(param_dtype).itemsize
    if shape.remat != "none" or shape.scan_layers:  # gathered per layer as it runs: ~3 layers' worth live
        gathered = int(gathered * min(1.0, 3 / c.num_hidden_layers))
    out = dict(params=params, optimizer=2 * params, gradients=gradients, gathered=gathered,
               activations=int(activations), loss=int(loss), batch=int(batch))
    out["total"] = sum(out.values())
    out["num_params"] = n_params
    return out


def sampler_plan(spec: RunSpec, model_cfg, num_devices: int, chip: str, *, per_host: Optional[int] = None) -> dict:
    """ANALYTIC per-device bytes of the rollout engine (pdm_jax.sampler.engine) for this run on ``chip``.

    * ``weights``: the sampler's copy, sharded on its mesh (``sampler.mesh`` data x tensor, fsdp 1;
      `param_bytes_per_device` with the model's rules), in its compute dtype: ``sampler.compute_dtype``,
      "auto" resolved for an accelerator (`engine.resolve_compute_dtype`: float32 for quantization none,
      bfloat16 for bf16 / fp8 / int8 / int4, whose values are held dequantized in it);
    * ``kv_cache``: ``slots x (P + T) x layers x 2 x kv_heads x head_dim x dtype bytes`` / (data x tensor),
      the tensor axis only where it divides the kv heads (P = ``sampler.max_prompt_length``, T =
      ``rl.max_new_tokens``; slots = ``sampler.max_slots`` (0: ``max_batch_size``) with continuous
      batching, ``max_batch_size`` with static batches; both rounded up to a power of two, as the engine does);
    * ``prompt_store`` (continuous batching): one rollout request's prompts prefilled once,
      ``max(next_pow2(prompts), slots / 4) x P`` more cache entries, split the same way (prompts:
      ``rl.prompts_per_step``, or its share per host with ``sampler.per_host_rollouts`` on a slice of
      more than one host: each process samples the groups its devices train on);
    * ``park`` (continuous batching with parking on and more than one cache phase): the parked rows'
      first-phase slots, `continuous_batching.park_entries` x (P + T/4) (P + T/2 where T/4 is under 32
      tokens; `engine.cache_phases`) more cache entries, split the same way.

    * ``outputs``: the rollouts the engine carries, [rows, T] tokens and log mu and [rows, T x K] top-K ids and
      log mu (4 bytes each; rows: the request's, at least the slots), on every device; with MoE routing replay
      also [rows, P + T, layers, k] in `rollout.routing_dtype` (int8, int16 past 127 experts);
    * ``prefill``: the attention scores of one prefill chunk (`EngineSpec.prefill_chunk` prompts, a multiple of
      the data axis: `continuous_batching.prefill_rows_at_once`;
      ``_PREFILL_SCORE_BYTES`` per query-key pair, heads split over the tensor axis);
    * ``lm_head``: the LM head gathered whole, V x D in the compute dtype, where the tensor axis splits the
      vocabulary (XLA:TPU gathers it for the last position's logits);
    * ``transient``: the largest of the decode loop (KV cache + prompt store + park + outputs + LM head), the
      prefill (KV cache + prompt store + outputs + prefill) and the compaction (`continuous_batching._compact`:
      1.5 x the KV cache + 2 x the outputs), calibrated on XLA:TPU's compiles (docs/scaling.md);
    * ``total``: weights + transient.

    The decode step's own activations (per-slot logits, attention scores) are not counted.  ``colocated``:
    the engine shares the trainer's chips (``sampler.mode`` colocated, or auto, which resolves to it on
    TPU / GPU); otherwise it runs on devices of its own. ``per_host``: a host's local chips (default
    `aot.chips_per_host`); a colocated engine's mesh must fit in them, as the trainer checks
    (`config.check_sampler_mesh`), and must split the model as the engine checks (`engine.check_engine_mesh`).
    Returns a dict of ints (bytes) and the descriptive fields ``mesh``, ``slots``, ``dtype``,
    ``quantization``, ``colocated``, ``hosts``, ``request_prompts`` (prompts in one host's request) and
    ``prefill_chunk`` (prompts prefilled at once).
    Raises:
      ValueError: ``sampler.mesh`` larger than a host's chips in colocated mode, or not splitting the model
        (naming the field).
    """
    from pdm_jax.sampler.continuous_batching import park_entries, prefill_rows_at_once
    from pdm_jax.sampler.engine import (cache_phases, check_engine_mesh,  # lazy: the dry run's imports stay light
                                        resolve_compute_dtype)

    sc = spec.sampler
    d, t = sc.mesh_data, sc.mesh_tensor
    backend = aot.chip_platform(chip)
    colocated = resolve_sampler_mode(sc.mode, backend=backend) == "colocated"
    per_host = per_host or aot.chips_per_host(chip, num_devices)
    if colocated and d * t > per_host:
        raise ValueError(f"sampler.mesh = data {d} x tensor {t} needs {d * t} devices; a colocated sampler runs on "
                         f"one host's own chips ({per_host} of {chip} per host; sampler.mode = colocated)")
    dtype = resolve_compute_dtype(sc.compute_dtype, sc.quantization, backend=backend)
    _, weights = param_bytes_per_device(model_cfg, {"data": d, "fsdp": 1, "tensor": t}, dtype)
    pow2 = next_pow2
    continuous = sc.batching == "continuous"
    slots = pow2((sc.max_slots if continuous else 0) or sc.max_batch_size)
    try:
        check_engine_mesh(model_cfg, jax.sharding.AbstractMesh((d, 1, t), ("data", "fsdp", "tensor")),
                          max_batch_size=sc.max_batch_size, max_slots=slots)
    except ValueError as e:
        raise ValueError(f"sampler.mesh = {d} x {t}: {e}") from None
    hosts = max(1, -(-num_devices // per_host))
    prompts = spec.rl.prompts_per_step
    if hosts > 1 and spec.rollout.per_host_rollouts:  # each process samples the groups its devices hold
        if prompts % hosts:  # the trainer refuses it at start-up too (pdm_jax.per_host)
            raise ValueError(f"rl.prompts_per_step = {prompts}: with sampler.per_host_rollouts each of the {hosts} "
                             f"hosts ({num_devices} x {chip}, {per_host} per host) samples whole groups, so the "
                             "prompts must divide by the hosts")
        prompts //= hosts
    c = model_cfg
    kv_t = t if c.num_key_value_heads % t == 0 else 1
    per_entry = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * dtype.itemsize  # one token, one row
    p, new = sc.max_prompt_length, spec.rl.max_new_tokens
    kv_cache = slots * (p + new) * per_entry // (d * kv_t)
    store_rows = max(pow2(prompts), slots // 4) if continuous else 0
    prompt_store = store_rows * p * per_entry // (d * kv_t)
    caps = cache_phases(new)
    park = (park_entries(sc.engine, slots, caps) if continuous else 0) * (p + caps[0]) * per_entry // (d * kv_t)
    k = spec.rl.top_k_logprobs
    rows = max(pow2(prompts * spec.rl.group_size), slots) if continuous else slots
    outputs = rows * new * (2 + 2 * k) * 4  # tokens, log mu, top-K ids and log mu: int32 / f32, every device
    if spec.model.moe_routing_replay and c.is_moe:
        outputs += rows * (p + new) * c.num_hidden_layers * c.num_experts_per_tok * jnp.dtype(
            routing_dtype(c.num_experts)).itemsize  # `rollout.routing_dtype`: int16 for 128 experts
    heads = c.num_attention_heads // t if c.num_attention_heads % t == 0 else c.num_attention_heads
    chunk = prefill_rows_at_once(store_rows, sc.engine.prefill_chunk, d) if continuous else slots
    prefill = _PREFILL_SCORE_BYTES * chunk * heads * p * p // d
    lm_head = c.vocab_size * c.hidden_size * dtype.itemsize if t > 1 else 0
    out = dict(weights=weights, kv_cache=kv_cache, prompt_store=prompt_store, park=park, outputs=outputs,
               prefill=prefill, lm_head=lm_head)
    out["transient"] = max(kv_cache + prompt_store + park + outputs + lm_head,  # the decode loop
                           kv_cache + prompt_store + outputs + prefill,  # the prefill of one chunk
                           kv_cache * 3 // 2 + 2 * outputs)  # the compaction: the carry and its half, both live
    out["total"] = weights + out["transient"]
    return dict(out, mesh=(d, t), slots=slots, dtype=str(dtype), quantization=sc.quantization,
                colocated=colocated, hosts=hosts, request_prompts=prompts, prefill_chunk=chunk)


def compiled_sampler_plan(spec: RunSpec, model_cfg, sp: dict, *, devices=None) -> dict:
    """``memory_analysis`` of the sharded continuous-batching programs (`cb._continuous_program`:
    prefill of one request's prompt store + the slots' decode loop; `cb._continuous_compact` and
    `cb._continuous_tail`) compiled for ``devices`` (default: the
    first ``data x tensor`` fake CPU devices; a TPU slice's or deviceless GPUs from `pdm_jax.aot`), from
    abstract inputs (weights as ``ShapeDtypeStruct`` with the engine's ``NamedSharding``s; one request of
    ``sp["request_prompts"]`` prompts x ``rl.group_size`` samples, a host's share with per-host rollouts).
    Per device: ``argument`` (weights and the request), ``output`` (the main loop's carry: KV cache and the
    rollouts), ``temp`` (prompt store, park, activations), ``total`` (their sum, or the larger of ``compact_total``
    and ``tail_total``: the programs run after it, `cb._continuous_compact` (the weights, the carry and the
    carry gathered into half the slots) and `cb._continuous_tail` (the weights, the half carry, its smaller
    levels, outputs and temporaries)), ``compile_seconds`` and ``flops`` (`aot.cost_flops`, all programs).
    XLA:CPU's figures are an estimate of an accelerator's (CPU fusion and layouts).
    """

    mesh, dtype, graphdef, state = _engine_on_mesh(model_cfg, sp, devices)
    sc, rl = spec.sampler, spec.rl
    pow2 = next_pow2
    slots, p, new = sp["slots"], sc.max_prompt_length, rl.max_new_tokens
    prompts = int(sp.get("request_prompts", rl.prompts_per_step))
    n_pad, u_pad = max(pow2(prompts * rl.group_size), slots), max(pow2(prompts), slots // 4)
    replicated = NamedSharding(mesh, P())
    arg = functools.partial(jax.ShapeDtypeStruct, sharding=replicated)
    queue = cb.ContinuousQueue(
        prompt_ids_UxP=arg((u_pad, p), jnp.int32), prompt_mask_UxP=arg((u_pad, p), jnp.bool_),
        row_entry_N=arg((n_pad,), jnp.int32), row_prompt_N=arg((n_pad,), jnp.uint32),
        row_sample_N=arg((n_pad,), jnp.uint32), seed_2=arg((2,), jnp.uint32), temperature=arg((), jnp.float32),
        top_p=arg((), jnp.float32), top_k=arg((), jnp.int32), max_new_N=arg((n_pad,), jnp.int32),
        stop_ids_S=arg((MAX_STOP_TOKEN_IDS,), jnp.int32), num_rows=arg((), jnp.int32))
    slice_once = eng.hoist_layer_slices(mesh.devices.flat[0].platform)  # as the engine on that platform runs it

    def lower(program, prev):  # the main program, then (``prev``: the one before) the compaction and the tail
        with activation_sharding(mesh):
            if program == "main":
                shape = cb.ContinuousShape.for_engine(  # the trainer's requests: no top-p / top-k, its park, routing
                    sc.engine, slots=slots, num_new=new, k_logprobs=rl.top_k_logprobs, cache_dtype=dtype,
                    slice_layers_once=slice_once, may_filter=False, routing=spec.model.moe_routing_replay and
                    model_cfg.is_moe, prefill_chunk=sp["prefill_chunk"] if sc.batching == "continuous" else 0)
                return cb._CONTINUOUS_JIT.lower(graphdef, state, queue, shape)
            outs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), prev.out_info)
            if program == "compact":
                return cb._CONTINUOUS_COMPACT_JIT.lower(outs[0], slots=slots), outs[1]
            return cb._CONTINUOUS_TAIL_JIT.lower(graphdef, state, outs, req, slots=slots,
                                                  slice_layers_once=slice_once)
    t0, out, compiled, req = time.perf_counter(), {}, None, None
    for program in ("main", "compact", "tail")[:1 + 2 * (len(cb.tail_levels(slots, new)) > 1)]:
        lowered = lower(program, compiled)
        if program == "compact":
            lowered, req = lowered
        compiled, exhausted = _compile_or_exhausted(lowered)
        if exhausted is not None:
            return dict(exhausted, argument=0, output=0, total=exhausted["temp"],
                        compile_seconds=time.perf_counter() - t0, flops=None)
        m = compiled.memory_analysis()
        sizes = dict(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
                     temp=int(m.temp_size_in_bytes))
        flops = aot.cost_flops(compiled)
        if program == "main":
            out = dict(sizes, total=sum(sizes.values()), flops=flops)
            continue
        # the compaction's arguments are the carry alone: the weights (the main program's arguments) stay resident
        out[f"{program}_total"] = sum(sizes.values()) + (out["argument"] if program == "compact" else 0)
        out["total"] = max(out["total"], out[f"{program}_total"])
        out["flops"] = None if out["flops"] is None or flops is None else out["flops"] + flops
    out["compile_seconds"] = time.perf_counter() - t0
    return out


def _engine_on_mesh(model_cfg, sp: dict, devices=None) -> tuple:
    """(mesh, compute dtype, graphdef, abstract weights with the engine's ``NamedSharding``s) of the sampler
    plan `sp` (its ``mesh`` and ``dtype``) on the first ``data x tensor`` of `devices` (default: JAX's)."""
    d, t = sp["mesh"]
    devices = list(jax.devices() if devices is None else devices)[:d * t]
    mesh = make_mesh(data=d, fsdp=1, tensor=t, devices=devices)
    dtype = _dtype(sp["dtype"])
    model = abstract_engine_model(model_cfg, dtype)
    graphdef, state = nnx.split(model)
    return mesh, dtype, graphdef, _with_shardings(state, param_shardings(nnx.state(model, nnx.Param), mesh))


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of the sharded ``ShapeDtypeStruct`` leaves of `tree` (its shard of each)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def compiled_decode_step(spec: RunSpec, model_cfg, sp: dict, *, devices=None) -> dict:
    """XLA's bytes accessed by one decode step of the rollout engine, beside its floor, per device.

    The step is `Qwen3ForCausalLM.decode` of one token per slot (``sp["slots"]`` rows) through every layer
    against a KV cache of P + T slots (``sampler.max_prompt_length`` + ``rl.max_new_tokens``: the longest
    cache phase), the LM head included, compiled alone for `devices` on the engine's mesh: without its loop, since
    ``cost_analysis`` counts a loop body once (and without a loop, where the layers are sliced makes no
    difference: `engine.hoist_layer_slices`). Returns ``bytes_accessed`` (``cost_analysis``),
    ``floor`` (the weights' bytes + the whole KV cache's bytes, read once each: what any decode step of this
    cache must move), ``weights``, ``kv_cache``, ``ratio`` (bytes_accessed / floor) and ``compile_seconds``;
    ``bytes_accessed`` and ``ratio`` are None where the compiler reports no cost or refuses the step for want of
    memory (then ``exhausted`` holds its message).
    """
    mesh, dtype, graphdef, state = _engine_on_mesh(model_cfg, sp, devices)
    slots, s = int(sp["slots"]), spec.sampler.max_prompt_length + spec.rl.max_new_tokens
    cache = jax.eval_shape(lambda: abstract_engine_model(model_cfg, dtype).init_cache(slots, s, dtype=dtype))
    cache = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
                         cache, kv_cache_specs(cache, mesh=mesh))
    rows = NamedSharding(mesh, P())
    arg = functools.partial(jax.ShapeDtypeStruct, sharding=rows)

    def step(state, cache, ids_Bx1, pos_Bx1, index_B, kv_mask_BxS):
        return nnx.merge(graphdef, state).decode(ids_Bx1, pos_Bx1, cache, index_B, kv_mask_BxS)

    t0 = time.perf_counter()
    with activation_sharding(mesh):
        lowered = jax.jit(step, donate_argnums=(1,)).lower(
            state, cache, arg((slots, 1), jnp.int32), arg((slots, 1), jnp.int32), arg((slots,), jnp.int32),
            arg((slots, s), jnp.bool_))
    compiled, exhausted = _compile_or_exhausted(lowered)
    weights, kv = _bytes_per_device(state), _bytes_per_device(cache)
    out = dict(weights=weights, kv_cache=kv, floor=weights + kv, bytes_accessed=None, ratio=None,
               compile_seconds=time.perf_counter() - t0)
    if exhausted is not None:
        out["exhausted"] = exhausted["exhausted"]
    else:
        accessed = aot.cost_bytes_accessed(compiled)
        if accessed is not None:
            out.update(bytes_accessed=int(accessed), ratio=accessed / out["floor"])
    return out


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves carrying the matching leaves of `shardings` (same leaf order)."""
    leaves, treedef = jax.tree.flatten(tree)
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(sh) != len(leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(sh)} shardings")
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sh)])


_EXHAUSTED_GIB = re.compile(r"\(([0-9.]+)([KMGT])\)")  # "... HLO temporaries (175.70G) exceeds available HBM (95.74G)"
_EXHAUSTED_USED = re.compile(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT])")  # "Used 21.90G of 7.48G hbm."


def _compile_or_exhausted(lowered):
    """``(compiled, None)``, or ``(None, figures)`` when the compiler refuses the program for want of memory:
    XLA:TPU stops at ``RESOURCE_EXHAUSTED: ... HLO temporaries (175.70G) exceeds available HBM (95.74G)``.
    ``figures``: ``exhausted`` (the compiler's message), ``temp`` (the bytes it asked for: a lower bound of
    the program's total; 0 when the message names none) and ``hbm`` (what it had), bytes; a refused
    program never fits (`verdict`); other compile errors propagate."""
    try:
        return lowered.compile(), None
    except Exception as e:  # noqa: BLE001  (jax.errors.JaxRuntimeError; its class moved between releases)
        message = str(e)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
        used = _EXHAUSTED_USED.search(message)
        if used:
            sizes = [float(used.group(1)) * scale[used.group(2)], float(used.group(3)) * scale[used.group(4)]]
        else:
            sizes = [float(v) * scale[u] for v, u in _EXHAUSTED_GIB.findall(message)]
        line = next((ln for ln in message.splitlines() if "RESOURCE_EXHAUSTED" in ln), message)
        return None, dict(exhausted=line.strip()[:300], temp=int(sizes[0]) if sizes else 0,
                          hbm=int(sizes[1]) if len(sizes) > 1 else 0)


def training_attention(attention: str, platform: str) -> tuple[str, str]:
    """(the kernel a compile for ``platform`` uses for the step's resolved ``attention``, a note when it stands
    in for another): splash on TPU; cuDNN on GPU where the cuDNN library is installed; blockwise (linear in T,
    like both) on CPU or where the chip's kernel cannot be built."""
    if attention == "splash" and platform != "tpu" or attention == "cudnn" and platform == "cpu":
        return "blockwise", ""
    if attention == "cudnn" and not aot.has_module("nvidia.cudnn"):
        return "blockwise", ("cuDNN attention needs the cuDNN library on the compiling host (pip install "
                             "nvidia-cudnn-cu12); compiled with blockwise attention")
    return attention, ""


def lowered_train_step(spec: RunSpec, model_cfg, shape: StepShape, sizes: dict, *, devices=None, platform: str = "cpu",
                       activation_constraints: bool = True):
    """The trainer's sharded RL train step lowered on abstract inputs for ``devices`` (a ``jax.stages.Lowered``).

    The step is `train_step.make_rl_train_step` with donated state and the batch split over
    ``("data", "fsdp")``, the model's kernels as ``platform`` runs them (`training_attention`).
    ``activation_constraints``: trace under ``sharding.activation_sharding(mesh)`` as the trainer does
    (without it XLA replicates activations under FSDP).

    Raises:
      RuntimeError: fewer devices than the mesh needs.
    """
    n_dev = math.prod(sizes.values())
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n_dev:
        raise RuntimeError(f"the mesh {sizes} needs {n_dev} devices, have {len(devices)}")
    mesh = make_mesh(devices=devices[:n_dev], **sizes)
    mc = spec.model
    compute = compute_options(mc)
    compute["attention"], _ = training_attention(shape.attention, platform)
    abstract = _abstract_model(model_cfg, _dtype(mc.dtype), _dtype(mc.param_dtype), **compute)
    graphdef, abs_params = nnx.split(abstract)
    abs_params = _with_shardings(abs_params, param_shardings(abs_params, mesh))
    steps = spec.step
    tx, _ = steps.rl_optimizer.build()
    abs_opt = _with_shardings(jax.eval_shape(tx.init, abs_params), opt_state_shardings(tx, abs_params, mesh))
    replicated = NamedSharding(mesh, P())
    abs_state = ts.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=abs_params,
                              opt_state=abs_opt)
    b, p, t, k = shape.batch, shape.prompt_len, shape.completion_len, shape.top_k

    def arg(shp, dt):
        spec = P(("data", "fsdp"), *([None] * (len(shp) - 1)))
        return jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))

    plan = None
    if shape.packed_length:  # rl.pack_sequences: the plan's index arrays, packed rows split like the batch
        n_rows, length = shape.packed_rows, shape.packed_length
        i32, flag = (arg((n_rows, length), dt) for dt in (jnp.int32, jnp.bool_))
        plan = PackingPlan(src_row=i32, src_col=i32, segment_ids=i32, token_mask=flag, target_col=i32,
                           target_mask=flag, unpack_index=arg((b, t), jnp.int32),
                           num_micro_batches=n_rows // (shape.micro_batch_size or n_rows), planned_for=(b, p, t))
    batch = StepBatch(prompt_ids=arg((b, p), jnp.int32), prompt_mask=arg((b, p), jnp.bool_),
                      completion_ids=arg((b, t), jnp.int32), completion_mask=arg((b, t), jnp.bool_),
                      behavior_logprobs=arg((b, t), jnp.float32), topk_ids=arg((b, t, k), jnp.int32),
                      topk_logprobs=arg((b, t, k), jnp.float32), advantages=arg((b,), jnp.float32),
                      ref_logprobs=arg((b, t), jnp.float32) if steps.policy_loss.kl_beta > 0 else None,
                      packing=plan)
    loss_cfg = dataclasses.replace(steps.policy_loss, logits_chunk_size=shape.logits_chunk_size,
                                   micro_batch_size=shape.micro_batch_size, max_response_length=shape.completion_len)
    step = ts.make_rl_train_step(graphdef, tx, steps.trust_region, loss_cfg)
    state_sharding = jax.tree.map(lambda x: x.sharding, abs_state)
    jitted = jax.jit(step, in_shardings=(state_sharding, jax.tree.map(lambda x: x.sharding, batch)),
                     out_shardings=(state_sharding, None), donate_argnums=0)
    if activation_constraints:
        with activation_sharding(mesh):
            return jitted.lower(abs_state, batch)
    return jitted.lower(abs_state, batch)


def compiled_plan(spec: RunSpec, model_cfg, shape: StepShape, sizes: dict, *, devices=None, platform: str = "cpu",
                  activation_constraints: bool = True) -> dict:
    """Compiles `lowered_train_step`; per-device bytes from its memory_analysis.

    ``devices``: the ``prod(sizes)`` devices to compile for (default the fake CPU devices,
    :func:`prepare_devices`; a TPU slice's or deviceless GPUs from `pdm_jax.aot`), on ``platform``
    (``"cpu"``, ``"tpu"``, ``"gpu"``).
    Returns ``{"argument", "output", "alias", "temp", "total"}`` in bytes
    (``total`` = argument + output - alias + temp: live bytes at the peak, with
    the donated state's outputs aliased to its inputs), ``compile_seconds``, ``flops``
    (`aot.cost_flops`) and ``attention_note`` (`training_attention`).

    Raises:
      RuntimeError: fewer devices than the mesh needs.
    """
    t0 = time.time()
    compiled, exhausted = _compile_or_exhausted(lowered_train_step(
        spec, model_cfg, shape, sizes, devices=devices, platform=platform,
        activation_constraints=activation_constraints))
    if exhausted is not None:  # the compiler's refusal: its temporaries alone exceed the chip
        return dict(exhausted, argument=0, output=0, alias=0, total=exhausted["temp"],
                    compile_seconds=time.time() - t0, flops=None,
                    attention_note=training_attention(shape.attention, platform)[1])
    ma = compiled.memory_analysis()
    out = dict(argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
               alias=int(ma.alias_size_in_bytes), temp=int(ma.temp_size_in_bytes))
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_seconds"] = time.time() - t0
    out["flops"] = aot.cost_flops(compiled)
    out["attention_note"] = training_attention(shape.attention, platform)[1]
    return out


def counted_flops(spec: RunSpec, model_cfg, shape: StepShape, sizes: dict, *, devices=None,
                  platform: str = "cpu") -> dict:
    """FLOPs per device of one optimizer step as the compiler counts them, every loop iteration included.

    XLA's ``cost_analysis`` counts a while loop's body once (checked: the 30B-A3B step scanned over 4 and
    48 layers reports the same FLOPs), and the step loops over layers (``model.scan_layers``), micro-batches
    and loss chunks. So the count comes from two more compiles of the same step without loops: layers
    unrolled, no micro-batches, the loss unchunked, one sequence per batch shard, with 1 and 2 layers. Their
    difference is one layer (every layer of a dense or all-sparse model is the same program), so
    ``flops = (f(1) + (L - 1) (f(2) - f(1))) x sequences per batch shard``: the compiler's counts, added up.

    Returns ``{"flops", "per_layer", "compile_seconds"}``, or ``{"flops": None, "note": why}`` for a mixed
    sparse / dense MoE model (its layers differ) or when a compile fails.
    """
    if model_cfg.is_mixed:
        return dict(flops=None, note="not counted: a mixed sparse / dense MoE model's layers differ")
    shards = sizes["data"] * sizes["fsdp"]
    flat = spec._replace(model=dataclasses.replace(spec.model, scan_layers=False),
                         rl=dataclasses.replace(spec.rl, micro_batch_size=0, logits_chunk_size=0))
    one = dataclasses.replace(shape, batch=shards, micro_batch_size=0, logits_chunk_size=0, scan_layers=False,
                              packed_rows=shards if shape.packed_length else 0)
    t0, counts = time.time(), []
    for layers in (1, 2):
        cfg = dataclasses.replace(model_cfg, num_hidden_layers=layers)
        try:
            compiled = lowered_train_step(flat, cfg, one, sizes, devices=devices, platform=platform).compile()
        except Exception as e:  # noqa: BLE001  (e.g. the unchunked loss does not fit a small chip)
            return dict(flops=None, note=f"not counted: the loop-free {layers}-layer step did not compile "
                                         f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        counts.append(aot.cost_flops(compiled))
    if None in counts:
        return dict(flops=None, note="not counted: the compiler gives no cost analysis")
    per_layer = counts[1] - counts[0]
    rows = shape.rows / shards  # model rows per batch shard (packed rows when packed)
    return dict(flops=(counts[0] + (model_cfg.num_hidden_layers - 1) * per_layer) * rows,
                per_layer=per_layer * rows, compile_seconds=time.time() - t0)


def _resolve_target(spec: RunSpec, compiler: str, chip: str, num_devices: int, topology: Optional[str], n_params: int):
    """(resolved compiler, its devices or None, a note when nothing is compiled)."""
    dr = spec.dry_run
    resolved = aot.resolve_compiler(compiler, chip)
    if resolved == "none":
        return resolved, None, "not compiled: dry_run.compiler=none"
    if resolved == "cpu":
        limit = dr.max_compile_params
        if compiler == "auto" and n_params > limit:
            hint = aot.TPU_INSTALL_HINT if aot.chip_platform(chip) == "tpu" else aot.GPU_INSTALL_HINT
            return "none", None, (f"not compiled: {n_params / 1e9:.1f}B parameters > dry_run.max_compile_params for "
                                  f"XLA:CPU, and XLA:{aot.chip_platform(chip).upper()} is not installed ({hint})")
        if len(jax.devices()) < num_devices:
            return "none", None, (f"not compiled: {len(jax.devices())} JAX devices < {num_devices} "
                                  "(run the CLI with --dry_run)")
    return resolved, aot.target_devices(resolved, chip, num_devices, topology), ""


def plan(spec, *, compiler: Optional[str] = None, chip: Optional[str] = None,
         num_devices: Optional[int] = None, topology: Optional[str] = None) -> dict:
    """The dry-run report for ``spec``: the analytic plan always, the compiled ones per ``dry_run.compiler``.

    ``spec``: the run's `pdm_jax.run_spec.RunSpec`, or a run ConfigDict, read by ``run_spec(config, dry_run=True)``
    (every config error before any work; no file or device needed). Args override
    ``dry_run.{compiler,chip,num_devices,topology}``. ``compiler``:

    * ``"tpu"`` / ``"gpu"``: XLA:TPU / XLA:GPU compile the train step and the rollout engine's
      program ahead of time for the slice (`pdm_jax.aot`), with the kernels, mesh and dtypes the
      run uses there (attention ``auto`` -> splash / cuDNN);
    * ``"cpu"``: XLA:CPU on fake CPU devices (splash / cuDNN stand in as blockwise attention), the
      sampler only with ``dry_run.compile_sampler``;
    * ``"none"``: the analytic plan alone;
    * ``"auto"`` (default): the chip's compiler when it is installed, else XLA:CPU for models up to
      ``dry_run.max_compile_params``, else none.

    Returns a dict with ``model`` (Qwen3Config), ``num_params``, ``shape`` (StepShape), ``mesh`` sizes,
    ``chip``, ``hbm_bytes``, ``compiler`` (resolved), ``target`` (e.g. "XLA:TPU v5p:4x4x4"),
    ``analytic`` (bytes per category), ``compiled`` (`compiled_plan` or None), ``compiled_note``,
    ``sampler`` (`sampler_plan`), ``sampler_compiled`` (`compiled_sampler_plan` or None) and ``verdict``
    (`verdict`).

    Raises:
      ValueError: unknown chip or compiler, a topology that does not match ``num_devices``, or a config
        error naming the field.
      aot.CompilerUnavailable: ``tpu`` / ``gpu`` asked for and not installed (the message says how).
    """
    spec = spec if isinstance(spec, RunSpec) else run_spec(spec, dry_run=True)
    dr = spec.dry_run
    compiler = compiler or dr.compiler
    chip = chip or dr.chip
    num_devices = int(dr.num_devices if num_devices is None else num_devices)
    topology = topology or dr.topology or None
    aot.chip_platform(chip)  # names dry_run.chip
    if compiler not in aot.COMPILERS:
        raise ValueError(f"dry_run.compiler must be one of {aot.COMPILERS}, got {compiler!r}")
    if num_devices < 1:
        raise ValueError(f"dry_run.num_devices must be >= 1, got {num_devices}")
    model_cfg = resolve_model_config(spec)
    shape = step_shape(spec, chip)
    sizes = mesh_sizes(spec, num_devices)
    analytic = analytic_plan(model_cfg, shape, sizes, dtype=spec.model.dtype, param_dtype=spec.model.param_dtype)
    n_params = analytic.pop("num_params")
    resolved, devices, note = _resolve_target(spec, compiler, chip, num_devices, topology, n_params)
    per_host = aot.devices_per_process(devices) if devices is not None and resolved != "cpu" \
        else aot.chips_per_host(chip, num_devices)
    sp = sampler_plan(spec, model_cfg, num_devices, chip, per_host=per_host)
    eval_plan = None
    if spec.eval.engine == "f32":  # a second, unquantized f32 engine on the trainer's chips
        ec = spec._replace(sampler=dataclasses.replace(spec.sampler, quantization="none", compute_dtype="auto"))
        eval_plan = sampler_plan(ec, model_cfg, num_devices, chip, per_host=per_host)
    compiled = sampler_compiled = None
    if devices is not None:
        compiled = compiled_plan(spec, model_cfg, shape, sizes, devices=devices, platform=resolved)
        if resolved != "cpu" and not compiled.get("exhausted"):
            compiled["counted"] = (counted_flops(spec, model_cfg, shape, sizes, devices=devices, platform=resolved)
                                   if dr.count_flops else dict(flops=None, note="not counted: dry_run.count_flops "
                                                                                 "= False"))
        if resolved != "cpu" or dr.compile_sampler:
            n = math.prod(sp["mesh"])
            if sp["colocated"]:
                sampler_devices = devices[:n]  # the engine's sub-mesh of the trainer's chips (the first host's)
            else:
                sampler_devices = (aot.target_devices(resolved, chip, n) if resolved != "cpu"
                                   else (jax.devices()[:n] if len(jax.devices()) >= n else None))
            if sampler_devices is not None:
                sampler_compiled = compiled_sampler_plan(spec, model_cfg, sp, devices=sampler_devices)
                sampler_compiled["decode_step"] = compiled_decode_step(spec, model_cfg, sp, devices=sampler_devices)
    report = dict(model=model_cfg, num_params=n_params, shape=shape, mesh=sizes, chip=chip,
                  hbm_bytes=aot.CHIP_HBM_GIB[chip] * GIB, compiler=resolved,
                  target=aot.label(resolved, chip, topology, num_devices) if devices is not None else "analytic plan",
                  analytic=analytic, compiled=compiled, compiled_note=note, sampler=sp, eval_engine=eval_plan,
                  sampler_compiled=sampler_compiled, model_flops=model_flops(model_cfg, shape, num_devices),
                  moe_implementation=spec.model.moe_implementation)
    report["verdict"] = verdict(report)
    report["step"] = dict(prompts_per_step=spec.rl.prompts_per_step, group_size=spec.rl.group_size,
                          num_minibatches=spec.rl.num_minibatches, max_prompt_length=spec.sampler.max_prompt_length,
                          max_new_tokens=spec.rl.max_new_tokens)
    report["estimate"] = step_time_estimate(report, report["step"])
    return report


def model_flops(model_cfg, shape: StepShape, num_devices: int) -> dict:
    """Model FLOPs of one optimizer step per device (the usual accounting, an estimate by formula).

    * ``flops``: ``6 N D`` (forward + backward; ``8 N D`` with full remat, the forward recomputed), N the
      parameters a token's matmuls use (MoE: its routed experts only; the input embedding, a gather, not
      counted), D the step's tokens per device; the LM head's ``[D, V]`` matmul runs on the completion
      tokens only (the loss reads no prompt logits), so it counts ``T`` of the ``P + T`` tokens; packed
      (``rl.pack_sequences``) the rows are ``shape.packed_rows`` of ``L`` tokens and the head runs at all L.
    * ``attention_flops``: causal attention's two ``[S, S]`` matmuls, ``2 x 2 N_heads H S^2 / 2`` per layer
      and sequence forward, times 3 (4 with full remat).

    Returns {"tokens_per_device", "active_params", "flops", "attention_flops"}.
    """
    c = model_cfg
    head = c.hidden_size * c.vocab_size
    body = count_params(c, non_embedding=True, active=True)  # neither the embedding nor an untied LM head
    seq = shape.row_length
    rows = shape.rows / num_devices
    factor = 8 if shape.remat == "full" else 6
    head_positions = seq if shape.packed_length else shape.completion_len  # packed: the head runs everywhere
    flops = factor * rows * (body * seq + head * head_positions)
    attention = (factor // 2) * rows * c.num_hidden_layers * 2 * c.num_attention_heads * c.head_dim * seq ** 2
    return dict(tokens_per_device=rows * seq, active_params=body + head, flops=flops, attention_flops=attention)


def verdict(report: dict) -> dict:
    """What shares a chip, added up from the best account there is: the target compiler's where it compiled,
    else the analytic plan. Returns {"total", "fits", "source", "parts"} (bytes; ``parts`` names each piece).

    Colocated sampler: the train state (the step's arguments) and the sampler's weights stay resident, and
    the step's transient buffers (its outputs beyond the donated state, its temporaries) and the engine's
    (KV cache, prompt store, park, decode buffers, rollouts) are live at different times: resident + the
    larger transient. A sampler on devices of its own must fit its own chips as well. ``fits`` is True
    only when every part fits.
    """
    hbm, c, sc, sp, a = report["hbm_bytes"], report["compiled"], report["sampler_compiled"], report["sampler"], \
        report["analytic"]
    if c is not None:
        train_resident, train_transient = c["argument"], c["total"] - c["argument"]
        source = report["target"]
    else:
        train_resident = a["params"] + a["optimizer"] + a["batch"]
        train_transient = a["total"] - train_resident
        source = "analytic plan"
    if sc is not None:
        sampler_resident, sampler_transient = sc["argument"], sc["total"] - sc["argument"]
    else:
        sampler_resident, sampler_transient = sp["weights"], sp["total"] - sp["weights"]
    sampler_src = "compiled" if sc is not None else "analytic"
    train = train_resident + train_transient
    parts = dict(train_resident=train_resident, train_transient=train_transient,
                 sampler_resident=sampler_resident, sampler_transient=sampler_transient)
    ev = report.get("eval_engine")
    eval_resident = ev["weights"] if ev else 0
    eval_transient = ev["total"] - ev["weights"] if ev else 0
    if ev:
        parts.update(eval_resident=eval_resident, eval_transient=eval_transient)
        train_resident += eval_resident  # kept between evaluations, on the trainer's chips
        train_transient = max(train_transient, eval_transient)
        train = train_resident + train_transient
    if sp["colocated"]:
        total = train_resident + sampler_resident + max(train_transient, sampler_transient)
        fits, what = total <= hbm, f"train step + colocated sampler ({sampler_src})"
    else:
        sampler = sampler_resident + sampler_transient
        total = max(train, sampler)
        fits, what = train <= hbm and sampler <= hbm, f"train step; sampler on its own chips ({sampler_src})"
    refused = [name for name, x in (("train step", c), ("sampler", sc)) if x is not None and x.get("exhausted")]
    if refused:  # the compiler's own refusal, whatever figures its message gave
        fits, what = False, what + f"; the compiler refused the {' and the '.join(refused)} for want of memory"
    return dict(total=int(total), fits=bool(fits), source=f"{source}, {what}", parts=parts,
                colocated=bool(sp["colocated"]))


def step_time_estimate(report: dict, rl: dict) -> dict:
    """A LOWER BOUND on one RL step's time at the chip's datasheet peak, per `plan`'s ``report``; ``rl``: the
    step's ``prompts_per_step``, ``group_size``, ``num_minibatches``, ``max_prompt_length``, ``max_new_tokens``.

    * training: the optimizer step's FLOPs per device (XLA's count with every iteration where it compiled,
      ``compiled["counted"]``; else `model_flops`' ``8 N D`` / ``6 N D`` + causal attention) x
      ``rl.num_minibatches``, at `aot.CHIP_PEAK_BF16_FLOPS`;
    * sampling, per host's engine (its ``data x tensor`` chips, one host's request): ``ceil(rows / slots) x T``
      decode steps (every response ``rl.max_new_tokens`` long), each reading its bytes at
      `aot.CHIP_HBM_BYTES_PER_S`: the compiled decode step's ``bytes_accessed`` where it compiled, else the
      floor, the engine's weights + the KV cache filled to its average length ``P + T/2`` (of ``P + T``);
      plus the prefill, ``2 N P`` FLOPs per prompt at peak.

    The colocated engine and the train step share the chips, so the step is their sum. ``tokens_per_s_per_chip``
    counts the step's ``prompts x samples x (P + T)`` tokens over the step's time and the slice's chips.
    Returns seconds and rates (floats) and ``source`` (which counts were used).
    """
    shape, mf, sp = report["shape"], report["model_flops"], report["sampler"]
    chip, n = report["chip"], math.prod(report["mesh"].values())
    peak, bw = aot.CHIP_PEAK_BF16_FLOPS[chip], aot.CHIP_HBM_BYTES_PER_S[chip]
    counted = ((report.get("compiled") or {}).get("counted") or {}).get("flops")
    opaque = shape.attention == "splash" and report["compiler"] == "tpu"  # splash declares no FLOPs
    flops = (counted + (mf["attention_flops"] if opaque else 0)) if counted else mf["flops"] + mf["attention_flops"]
    train = flops * rl["num_minibatches"] / peak
    rows = sp["request_prompts"] * rl["group_size"]
    p, t = rl["max_prompt_length"], rl["max_new_tokens"]
    steps = math.ceil(rows / sp["slots"]) * t
    step_bytes = ((report.get("sampler_compiled") or {}).get("decode_step") or {}).get("bytes_accessed")
    decode_src = "compiled decode step's bytes" if step_bytes else "weights + KV cache at its average fill"
    if not step_bytes:
        step_bytes = sp["weights"] + sp["kv_cache"] * (p + t / 2) / (p + t)
    active = mf["active_params"]
    prefill = 2 * active * p * sp["request_prompts"] / math.prod(sp["mesh"]) / peak
    sample = steps * step_bytes / bw + prefill
    total = train + sample
    tokens = rl["prompts_per_step"] * rl["group_size"] * (p + t)
    return dict(train_s=train, sample_s=sample, decode_steps=steps, decode_step_bytes=float(step_bytes),
                step_s=total, tokens_per_step=tokens, tokens_per_s_per_chip=tokens / total / n,
                source=("compiled FLOPs" if counted else "model FLOPs (8 N D / 6 N D + attention)")
                + f", {decode_src}")


def estimate_lines(report: dict) -> list:
    """The report's ESTIMATE lines (`step_time_estimate`)."""
    e, rl = report["estimate"], report["step"]
    return [f"ESTIMATE of one RL step at {report['chip']}'s datasheet peak (a LOWER BOUND, never measured; "
            f"{e['source']}):",
            f"  training  {e['train_s']:9.1f} s  ({rl['num_minibatches']} optimizer steps)",
            f"  sampling  {e['sample_s']:9.1f} s  ({e['decode_steps']:,} decode steps of "
            f"{e['decode_step_bytes'] / GIB:.2f} GiB per chip, every response {rl['max_new_tokens']} tokens)",
            f"  step      {e['step_s']:9.1f} s  = {e['tokens_per_s_per_chip']:,.0f} tokens/s per chip at most "
            f"({e['tokens_per_step']:,} prompt + completion tokens per step)"]


def format_report(report: dict) -> str:
    """A human-readable memory table of :func:`plan`'s report (GiB per device vs the chip's HBM)."""
    s, m, hbm = report["shape"], report["mesh"], report["hbm_bytes"]
    unit, scale = ("GiB", GIB) if report["analytic"]["total"] >= GIB else ("MiB", 2 ** 20)
    g = lambda x: f"{x / scale:10.3f}"  # noqa: E731
    n = report["num_params"]
    size = f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    mc = report["model"]
    moe = (f"-MoE, {mc.num_experts} experts top-{mc.num_experts_per_tok} of width {mc.moe_intermediate_size}"
           if mc.is_moe else "")
    lines = [
        f"dry run: {size}-parameter Qwen3{moe} (V={report['model'].vocab_size}, "
        f"L={report['model'].num_hidden_layers}, D={report['model'].hidden_size}), "
        f"mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']} on {math.prod(m.values())} x {report['chip']} "
        f"({hbm / GIB:.0f} GiB HBM each)",
        f"step: {s.batch} sequences x ({s.prompt_len} prompt + {s.completion_len} completion) tokens, K={s.top_k}, "
        f"logits_chunk_size={s.logits_chunk_size or 'off'}, micro_batch_size={s.micro_batch_size or 'off'}, "
        f"attention={s.attention}, remat={s.remat}, scan_layers={s.scan_layers}"
        + (f"; packed into {s.packed_rows} rows of {s.packed_length} tokens (rl.pack_sequences: the most a "
           "mini-batch can need; the analytic plan counts the padded rows)" if s.packed_length else ""),
        "",
        f"ANALYTIC estimate, per device        {unit}",
    ]
    for k in ("params", "optimizer", "gradients", "gathered", "activations", "loss", "batch", "total"):
        lines.append(f"  {k:<30}{g(report['analytic'][k])}")
    a_total = report["analytic"]["total"]
    lines.append(f"  {'fits in HBM?':<30}{'yes' if a_total <= hbm else 'NO':>10}  ({100 * a_total / hbm:.0f}% of HBM)")
    c = report["compiled"]
    if c is not None:
        lines += ["", f"COMPILED by {report['target']} (memory_analysis, {c['compile_seconds']:.0f} s), "
                      f"per device   {unit}"]
        if report["compiler"] == "cpu":
            lines.append("  (XLA:CPU: its fusion and layouts, an estimate of the accelerator's"
                         + ("; splash / cuDNN compiled as blockwise attention" if s.attention in ("splash", "cudnn")
                            else "") + ")")
        if c.get("attention_note"):
            lines.append(f"  ({c['attention_note']})")
        if c.get("exhausted"):
            lines += [f"  the compiler refused it: {c['exhausted']}",
                      f"  {'temp (at least)':<30}{g(c['temp'])}"]
        else:
            for k in ("argument", "output", "alias", "temp", "total"):
                lines.append(f"  {k:<30}{g(c[k])}")
        lines.append(f"  {'fits in HBM?':<30}{'yes' if c['total'] <= hbm else 'NO':>10}  "
                     f"({100 * c['total'] / hbm:.0f}% of HBM)")
        lines += _flops_lines(report)
    else:
        lines += ["", f"COMPILED: {report['compiled_note']}"]
    lines += [""] + _sampler_lines(report["sampler"], hbm, g, unit, report.get("sampler_compiled"),
                                   report["target"])
    v = report["verdict"]
    p = v["parts"]
    lines += ["", f"WHAT SHARES A CHIP ({v['source']}), per device   {unit}",
              f"  {'train_state_resident':<30}{g(p['train_resident'])}  (the step's arguments: parameters, "
              "AdamW moments, batch)",
              f"  {'train_step_transient':<30}{g(p['train_transient'])}  (its outputs beyond the donated state, "
              "temporaries)",
              f"  {'sampler_weights_resident':<30}{g(p['sampler_resident'])}  (the engine's arguments: its "
              "weight copy, a request)",
              f"  {'sampler_transient':<30}{g(p['sampler_transient'])}  (KV cache, prompt store, park, decode "
              "buffers, rollouts)"]
    if "eval_resident" in p:
        lines += [f"  {'eval_engine_resident':<30}{g(p['eval_resident'])}  (eval.engine = f32: an unquantized f32 "
                  "copy on the trainer's chips, analytic; eval.engine = rollout has none)",
                  f"  {'eval_engine_transient':<30}{g(p['eval_transient'])}  (its KV cache and prompt store)"]
    if v["colocated"]:
        lines.append("  total = the residents + the largest transient (the programs run one after another)")
    else:
        lines.append("  the sampler runs on chips of its own: each side must fit")
    if "estimate" in report:
        lines += [""] + estimate_lines(report)
    lines += ["", f"per-device total {v['total'] / GIB:.2f} GiB of {hbm / GIB:.0f} GiB HBM ({v['source']}): "
                  f"{'fits' if v['fits'] else 'does not fit'}"]
    return "\n".join(lines)


def _flops_lines(report: dict) -> list:
    """The step's FLOPs per device: XLA's count of the compiled program (each loop body once), the count with
    every iteration (`counted_flops`, XLA:TPU / XLA:GPU), the model FLOPs beside it and a roofline time
    labelled as an estimate. A Pallas kernel counts only the FLOPs it declares to XLA: megablox's gmm
    declares them, splash attention does not, so with splash the comparison leaves attention out of the
    model side too."""
    c, mf, s = report["compiled"], report["model_flops"], report["shape"]
    if c.get("exhausted"):
        return ["  (no FLOPs: the compiler refused the program)"]
    if c.get("flops") is None:
        return ["  (no FLOPs: this compiler gives no cost analysis)"]
    opaque_attention = s.attention == "splash" and report["compiler"] == "tpu"  # splash declares no cost
    lines = [f"  {'compiled_tflops':<30}{c['flops'] / 1e12:10.4g}  per device (XLA cost_analysis: each loop "
             "body counted once)",
             f"  {'model_tflops':<30}{mf['flops'] / 1e12:10.4g}  ({'8' if s.remat == 'full' else '6'} x "
             f"{mf['active_params'] / 1e9:.3g}B params per token x {mf['tokens_per_device']:,.0f} tokens, the LM "
             + ("head at every packed position)" if s.packed_length else "head on completion tokens)"),
             f"  {'attention_tflops':<30}{mf['attention_flops'] / 1e12:10.4g}  (causal S^2 matmuls"
             + (": splash declares no FLOPs to XLA, not in its count)" if opaque_attention else ")")]
    counted = c.get("counted") or {}
    if counted.get("flops") is not None:
        flops = counted["flops"]
        expected = mf["flops"] + (0 if opaque_attention else mf["attention_flops"])
        peak = aot.CHIP_PEAK_BF16_FLOPS[report["chip"]]
        roofline = (flops + (mf["attention_flops"] if opaque_attention else 0)) / peak
        lines += [f"  {'counted_tflops':<30}{flops / 1e12:10.4g}  (every layer, micro-batch and loss chunk: "
                  f"loop-free 1- and 2-layer compiles, {counted['compile_seconds']:.0f} s)",
                  f"  {'counted / expected':<30}{flops / expected:10.3f}  (expected: model"
                  + ("" if opaque_attention else " + attention") + " FLOPs; the rest is the loss head's softmax, "
                  "the mask, norms, padding)",
                  f"  {'roofline_seconds':<30}{roofline:10.4g}"
                  f"  ESTIMATE: counted{' + attention' if opaque_attention else ''} FLOPs at {peak / 1e12:.0f} "
                  "TFLOP/s peak bf16, never measured on a chip"]
    elif counted.get("note"):
        lines.append(f"  counted_tflops: {counted['note']}")
    return lines


def _sampler_lines(sp: dict, hbm: int, g, unit: str, compiled=None, target: str = "XLA:CPU") -> list:
    """The report's sampler section (`sampler_plan`, `compiled_sampler_plan` when it ran): its keys are
    prefixed ``sampler_`` so that the train step's ``  key  value`` lines stay unique."""
    d, t = sp["mesh"]
    lines = [f"SAMPLER (rollout engine), ANALYTIC, per device of its {d} x {t} (data x tensor) mesh   {unit}",
             f"  ({sp['quantization']} weights held in {sp['dtype']}, {sp['slots']} slots, requests of "
             f"{sp.get('request_prompts', '?')} prompts"
             + (f": one host's share of {sp['hosts']} hosts)" if sp.get("hosts", 1) > 1 else ")")]
    for k in ("weights", "kv_cache", "prompt_store", "park", "outputs", "prefill", "lm_head", "total"):
        lines.append(f"  {'sampler_' + k:<30}{g(sp[k])}" + (f"  ({sp['prefill_chunk']} prompts at once)"
                                                             if k == "prefill" else ""))
    if sp["colocated"]:
        lines += ["  colocated: the sampler lives on the same chips as the train step (sampler.mode); both are "
                  "added up below"]
    else:
        lines += ["  on its own devices (sampler.mode subprocess / remote)",
                  f"  {'fits in HBM?':<30}{'yes' if sp['total'] <= hbm else 'NO':>10}  "
                  f"({100 * sp['total'] / hbm:.0f}% of HBM)"]
    if compiled is not None:
        lines.append(f"  COMPILED sampler program by {target} (memory_analysis, {compiled['compile_seconds']:.0f} s), "
                     f"per device   {unit}")
        if compiled.get("exhausted"):
            lines += [f"  the compiler refused it: {compiled['exhausted']}",
                      f"  {'sampler_compiled_temp_at_least':<30}{g(compiled['temp'])}"]
        for k in () if compiled.get("exhausted") else ("argument", "output", "temp", "compact_total", "tail_total",
                                                       "total"):
            if k not in compiled:  # no tail (fewer than 2 slots)
                continue
            lines.append(f"  {'sampler_compiled_' + k:<30}{g(compiled[k])}")
        lines.append(f"  {'fits in HBM?':<30}{'yes' if compiled['total'] <= hbm else 'NO':>10}  "
                     f"({100 * compiled['total'] / hbm:.0f}% of HBM, alone)")
    step = (compiled or {}).get("decode_step")
    if step is not None:
        lines.append(f"  ONE DECODE STEP by {target} (cost_analysis, {step['compile_seconds']:.0f} s), per device   "
                     f"{unit}")
        for k in ("weights", "kv_cache", "floor"):
            lines.append(f"  {'decode_step_' + k:<30}{g(step[k])}")
        if step.get("exhausted"):
            lines.append(f"  the compiler refused the step: {step['exhausted']}")
        elif step["bytes_accessed"] is None:
            lines.append("  decode_step_bytes_accessed      (the compiler reports no cost)")
        else:
            lines.append(f"  {'decode_step_bytes_accessed':<30}{g(step['bytes_accessed'])}  "
                         f"({step['ratio']:.2f}x the floor: weights + KV cache, each read once)")
    return lines


def main(spec) -> dict:
    """Runs :func:`plan` (``spec``: a `RunSpec` or a run ConfigDict) and prints :func:`format_report`; returns the
    report (``dry_run.fit``: the CLI runs `dry_run_fit.main` instead)."""
    report = plan(spec)
    print(format_report(report), flush=True)
    return report
