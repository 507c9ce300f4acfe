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

from pdm_jax import train_step as ts
from pdm_jax.config import compute_options, model_config_from_fields, resolve_sampler_mode, step_configs
from pdm_jax.distributed import opt_state_shardings
from pdm_jax.models.hf_io import load_config
from pdm_jax.models.presets import PRESETS, get_preset
from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.models.tokenizer import char_vocab_size
from pdm_jax.rollout import StepBatch, round_up
from pdm_jax.sharding import MeshConfig, activation_sharding, make_mesh, param_partition_specs, param_shardings


#: HBM per chip in GiB (vendor datasheets: TPU v4 32, v5e 16, v5p 95, v6e Trillium 32; H100 SXM 80; H200 141).
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "H100": 80, "H200": 141}
MODES = ("auto", "compile", "analytic")
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


def resolve_model_config(config):
    """The ``Qwen3Config`` a run config trains, without loading weights.

    Order: ``model.preset``; ``model.hf_path/config.json`` if it exists; a
    preset named like the checkpoint directory (``.../Qwen3-8B-Base`` ->
    ``qwen3_8b``, ``.../Qwen3-30B-A3B-Base`` -> ``qwen3_30b_a3b``); the explicit ``model.*`` fields with the vocabulary of the
    tokenizer (char tokenizer: ``len(symbols)`` + pad + eos; or
    ``tokenizer.path/tokenizer.json``).

    Raises:
      ValueError: naming ``model.hf_path`` when none of these applies.
    """
    mc = config.model
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
    tc = config.tokenizer
    if tc.kind == "char":
        vocab = char_vocab_size(tc.symbols)
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


def resolve_attention(attention: str, chip: str, seq: int) -> str:
    """``model.attention`` as the target chip would run it: "auto" is dense up to 512 tokens, else the
    chip's fused kernel (splash on TPU, cudnn on GPU), as ``pdm_jax.models.attention`` resolves it."""
    if attention != "auto":
        return attention
    if seq <= 512:
        return "dense"
    return "cudnn" if chip.startswith("H") else "splash"


def step_shape(config, chip: Optional[str] = None) -> StepShape:
    """The mini-batch the trainer feeds one jitted step (sequences, padded lengths, K, chunk, attention, remat)."""
    rl = config.rl
    n = rl.prompts_per_step * rl.group_size
    if rl.num_minibatches < 1 or n % rl.num_minibatches:
        raise ValueError(f"rl.num_minibatches = {rl.num_minibatches} must divide prompts_per_step x group_size = {n}")
    p = round_up(int(config.sampler.max_prompt_length), 8)
    return StepShape(batch=n // rl.num_minibatches, prompt_len=p, completion_len=int(rl.max_new_tokens),
                     top_k=int(rl.top_k_logprobs), logits_chunk_size=int(rl.logits_chunk_size),
                     micro_batch_size=int(rl.micro_batch_size),
                     attention=resolve_attention(config.model.attention, chip or config.dry_run.chip,
                                                 p + int(rl.max_new_tokens)),
                     remat=config.model.remat, scan_layers=bool(config.model.get("scan_layers", True)))


def mesh_sizes(config, num_devices: int) -> dict:
    """{"data", "fsdp", "tensor"} sizes of ``config.mesh`` on ``num_devices`` (-1 resolved)."""
    m = config.mesh
    d, f, t = MeshConfig(data=m.data, fsdp=m.fsdp, tensor=m.tensor).axis_sizes(num_devices)
    return {"data": d, "fsdp": f, "tensor": t}


def _abstract_model(model_cfg, dtype, param_dtype, **compute):
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                                   **compute))


def _dtype(name):
    return jnp.dtype(name)


def param_bytes_per_device(model_cfg, sizes: dict, param_dtype) -> tuple[int, int]:
    """(total parameter count, bytes of the parameters held by one device) under the sharding rules."""
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
      parameter bytes (kept across the backward pass when the layers are unrolled
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
    n_heads, n_kv, f, v = div(c.num_attention_heads), div(c.num_key_value_heads), div(c.intermediate_size), div(c.vocab_size)
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
    gathered = 2 * (full_params - params)
    if shape.remat != "none" or shape.scan_layers:  # gathered per layer as it runs: ~3 layers' worth live
        gathered = int(gathered * min(1.0, 3 / c.num_hidden_layers))
    out = dict(params=params, optimizer=2 * params, gradients=gradients, gathered=gathered,
               activations=int(activations), loss=int(loss), batch=int(batch))
    out["total"] = sum(out.values())
    out["num_params"] = n_params
    return out


def sampler_plan(config, model_cfg, num_devices: int, chip: str) -> dict:
    """ANALYTIC per-device bytes of the rollout engine (pdm_jax.sampler.engine) for this config on ``chip``.

    * ``weights``: the sampler's copy, sharded on its mesh (``sampler.mesh`` data x tensor, fsdp 1;
      `param_bytes_per_device` with the model's rules), in its compute dtype: ``sampler.compute_dtype``,
      "auto" resolved for an accelerator (`engine.resolve_compute_dtype`: float32 for quantization none,
      bfloat16 for bf16 / fp8 / int8, whose values are held dequantized in it);
    * ``kv_cache``: ``slots x (P + T) x layers x 2 x kv_heads x head_dim x dtype bytes`` / (data x tensor),
      the tensor axis only where it divides the kv heads (P = ``sampler.max_prompt_length``, T =
      ``rl.max_new_tokens``; slots = ``sampler.max_slots`` (0: ``max_batch_size``) with continuous
      batching, ``max_batch_size`` with static batches; both rounded up to a power of two, as the engine does);
    * ``prompt_store`` (continuous batching): one rollout request's prompts prefilled once,
      ``max(next_pow2(rl.prompts_per_step), slots / 4) x P`` more cache entries, split the same way;
    * ``park`` (continuous batching with ``sampler.park_rows`` > 0 and more than one cache phase): the
      parked rows' first-phase slots, ``park_rows x slots x (P + T/4)`` (P + T/2 where T/4 is under 32
      tokens; `engine.cache_phases`) more cache entries, split the same way.

    Activations of the decode step (per-slot logits, attention scores) are not counted.  ``colocated``:
    the engine shares the trainer's chips (``sampler.mode`` colocated, or auto, which resolves to it on
    TPU / GPU); otherwise it runs on devices of its own.
    Returns a dict of ints (bytes, plus ``total``) and the descriptive fields ``mesh``, ``slots``, ``dtype``,
    ``quantization``, ``colocated``.
    Raises:
      ValueError: ``sampler.mesh`` larger than ``num_devices`` in colocated mode (naming the field).
    """
    from pdm_jax.sampler.engine import cache_phases, resolve_compute_dtype  # lazy: the dry run's imports stay light
    from pdm_jax.sampler.wire import DEFAULT_PARK_ROWS

    sc = config.sampler
    mesh_cfg = sc.get("mesh") or {}
    d, t = int(mesh_cfg.get("data", 1)), int(mesh_cfg.get("tensor", 1))
    backend = "gpu" if chip.startswith("H") else "tpu"
    colocated = resolve_sampler_mode(str(sc.get("mode", "auto")), backend=backend) == "colocated"
    if colocated and d * t > num_devices:
        raise ValueError(f"sampler.mesh = data {d} x tensor {t} needs {d * t} devices; the colocated sampler "
                         f"shares the trainer's {num_devices}")
    dtype = resolve_compute_dtype(str(sc.get("compute_dtype", "auto")), str(sc.quantization), backend=backend)
    _, weights = param_bytes_per_device(model_cfg, {"data": d, "fsdp": 1, "tensor": t}, dtype)
    pow2 = lambda n: 1 << (max(int(n), 1) - 1).bit_length()  # noqa: E731  (engine._next_pow2)
    continuous = str(sc.get("batching", "static")) == "continuous"
    slots = pow2((int(sc.get("max_slots", 0)) if continuous else 0) or int(sc.max_batch_size))
    c = model_cfg
    kv_t = t if c.num_key_value_heads % t == 0 else 1
    per_entry = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * dtype.itemsize  # one token, one row
    p, new = int(sc.max_prompt_length), int(config.rl.max_new_tokens)
    kv_cache = slots * (p + new) * per_entry // (d * kv_t)
    store_rows = max(pow2(config.rl.prompts_per_step), slots // 4) if continuous else 0
    prompt_store = store_rows * p * per_entry // (d * kv_t)
    caps = cache_phases(new)
    park_rows = int(sc.get("park_rows", DEFAULT_PARK_ROWS)) if continuous and len(caps) > 1 else 0
    park = park_rows * slots * (p + caps[0]) * per_entry // (d * kv_t)
    out = dict(weights=weights, kv_cache=kv_cache, prompt_store=prompt_store, park=park)
    out["total"] = sum(out.values())
    return dict(out, mesh=(d, t), slots=slots, dtype=str(dtype), quantization=str(sc.quantization),
                colocated=colocated)


def compiled_sampler_plan(config, model_cfg, sp: dict) -> dict:
    """XLA:CPU ``memory_analysis`` of the sharded continuous-batching program (`engine._continuous_program`:
    prefill of one request's prompt store + the slot decode loops) on ``sp["mesh"]`` fake devices, from
    abstract inputs (weights as ``ShapeDtypeStruct`` with the engine's ``NamedSharding``s; one request of
    ``rl.prompts_per_step`` prompts x ``rl.group_size`` samples).  Per device: ``argument`` (weights and
    the request), ``output`` (the rollouts), ``temp`` (KV cache, prompt store, activations), ``total``
    (their sum) and ``compile_seconds``.  An estimate of the accelerator's (CPU fusion and layouts).
    """
    from pdm_jax.sampler import engine as eng  # lazy: the dry run's own imports stay light
    from pdm_jax.sampler.wire import MAX_STOP_TOKEN_IDS

    d, t = sp["mesh"]
    mesh = make_mesh(data=d, fsdp=1, tensor=t, devices=jax.devices()[:d * t])
    dtype = _dtype(sp["dtype"])
    model = _abstract_model(model_cfg, dtype, dtype)
    graphdef, state = nnx.split(model)
    state = _with_shardings(state, param_shardings(nnx.state(model, nnx.Param), mesh))
    sc, rl = config.sampler, config.rl
    pow2 = lambda n: 1 << (max(int(n), 1) - 1).bit_length()  # noqa: E731
    slots, p, new = sp["slots"], int(sc.max_prompt_length), int(rl.max_new_tokens)
    n_pad, u_pad = max(pow2(rl.prompts_per_step * rl.group_size), slots), max(pow2(rl.prompts_per_step), slots // 4)
    arg = jax.ShapeDtypeStruct
    args = (graphdef, state, arg((u_pad, p), jnp.int32), arg((u_pad, p), jnp.bool_), arg((n_pad,), jnp.int32),
            arg((n_pad,), jnp.uint32), arg((n_pad,), jnp.uint32), arg((2,), jnp.uint32), arg((), jnp.float32),
            arg((), jnp.float32), arg((), jnp.int32), arg((n_pad,), jnp.int32), arg((MAX_STOP_TOKEN_IDS,), jnp.int32),
            arg((), jnp.int32))
    t0 = time.perf_counter()
    with activation_sharding(mesh):
        compiled = eng._CONTINUOUS_JIT.lower(*args, slots=slots, num_new=new, k_logprobs=int(rl.top_k_logprobs),
                                             cache_dtype=dtype).compile()
    m = compiled.memory_analysis()
    out = dict(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
               temp=int(m.temp_size_in_bytes))
    out["total"] = sum(out.values())
    out["compile_seconds"] = time.perf_counter() - t0
    return out


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves carrying the matching leaves of `shardings` (same leaf order)."""
    leaves, treedef = jax.tree.flatten(tree)
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(sh) != len(leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(sh)} shardings")
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sh)])


def compiled_plan(config, model_cfg, shape: StepShape, sizes: dict, *, activation_constraints: bool = True) -> dict:
    """Compiles the real sharded RL train step on abstract inputs; per-device bytes from memory_analysis.

    Needs ``prod(sizes)`` devices (fake CPU devices, :func:`prepare_devices`).
    ``activation_constraints``: trace under ``sharding.activation_sharding(mesh)``
    as the trainer does (without it XLA replicates activations under FSDP).
    Returns ``{"argument", "output", "alias", "temp", "total"}`` in bytes
    (``total`` = argument + output - alias + temp: live bytes at the peak, with
    the donated state's outputs aliased to its inputs) and ``compile_seconds``.

    Raises:
      RuntimeError: fewer devices than the mesh needs.
    """
    n_dev = math.prod(sizes.values())
    if len(jax.devices()) < n_dev:
        raise RuntimeError(f"the mesh {sizes} needs {n_dev} devices, JAX has {len(jax.devices())}")
    mesh = make_mesh(devices=jax.devices()[:n_dev], **sizes)
    mc = config.model
    compute = compute_options(mc)
    if shape.attention in ("splash", "cudnn"):  # the chip's kernel does not compile for CPU devices:
        compute["attention"] = "blockwise"  # its memory behaviour (linear in T) is the blockwise kernel's
    else:
        compute["attention"] = shape.attention
    abstract = _abstract_model(model_cfg, _dtype(mc.dtype), _dtype(mc.param_dtype), **compute)
    graphdef, abs_params = nnx.split(abstract)
    abs_params = _with_shardings(abs_params, param_shardings(abs_params, mesh))
    configs = step_configs(config, max_response_length=shape.completion_len)
    tx, _ = configs.rl_optimizer.build()
    abs_opt = _with_shardings(jax.eval_shape(tx.init, abs_params), opt_state_shardings(tx, abs_params, mesh))
    replicated = NamedSharding(mesh, P())
    abs_state = ts.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=abs_params,
                              opt_state=abs_opt)
    b, p, t, k = shape.batch, shape.prompt_len, shape.completion_len, shape.top_k

    def arg(shp, dt):
        spec = P(("data", "fsdp"), *([None] * (len(shp) - 1)))
        return jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))

    batch = StepBatch(prompt_ids=arg((b, p), jnp.int32), prompt_mask=arg((b, p), jnp.bool_),
                      completion_ids=arg((b, t), jnp.int32), completion_mask=arg((b, t), jnp.bool_),
                      behavior_logprobs=arg((b, t), jnp.float32), topk_ids=arg((b, t, k), jnp.int32),
                      topk_logprobs=arg((b, t, k), jnp.float32), advantages=arg((b,), jnp.float32),
                      ref_logprobs=arg((b, t), jnp.float32) if configs.policy_loss.kl_beta > 0 else None)
    loss_cfg = dataclasses.replace(configs.policy_loss, logits_chunk_size=shape.logits_chunk_size,
                                   micro_batch_size=shape.micro_batch_size)
    step = ts.make_rl_train_step(graphdef, tx, configs.trust_region, loss_cfg)
    state_sharding = jax.tree.map(lambda x: x.sharding, abs_state)
    t0 = time.time()
    jitted = jax.jit(step, in_shardings=(state_sharding, jax.tree.map(lambda x: x.sharding, batch)),
                     out_shardings=(state_sharding, None), donate_argnums=0)
    if activation_constraints:
        with activation_sharding(mesh):
            lowered = jitted.lower(abs_state, batch)
    else:
        lowered = jitted.lower(abs_state, batch)
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    out = dict(argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
               alias=int(ma.alias_size_in_bytes), temp=int(ma.temp_size_in_bytes))
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_seconds"] = time.time() - t0
    return out


def plan(config, *, mode: Optional[str] = None, chip: Optional[str] = None,
         num_devices: Optional[int] = None) -> dict:
    """The dry-run report for ``config`` (analytic always; compiled per ``mode``).

    Args override ``config.dry_run.{mode,chip,num_devices}``.

    Returns a dict with ``model`` (Qwen3Config), ``num_params``, ``shape``
    (StepShape), ``mesh`` sizes, ``chip``, ``hbm_bytes``, ``analytic`` (bytes
    per category), ``compiled`` (memory_analysis bytes or None),
    ``compiled_note`` (why it was not compiled, if so), ``sampler`` (`sampler_plan`)
    and ``sampler_compiled`` (`compiled_sampler_plan`, with ``dry_run.compile_sampler`` when the
    train step was compiled and the sampler mesh fits the devices; else None).

    Raises:
      ValueError: unknown chip or mode, or a config error naming the field.
    """
    dr = config.get("dry_run") or {}
    mode = mode or dr.get("mode", "auto")
    chip = chip or dr.get("chip", "v5p")
    num_devices = int(num_devices or dr.get("num_devices", 8))
    if mode not in MODES:
        raise ValueError(f"dry_run.mode must be one of {MODES}, got {mode!r}")
    if chip not in CHIP_HBM_GIB:
        raise ValueError(f"dry_run.chip must be one of {sorted(CHIP_HBM_GIB)}, got {chip!r}")
    step_configs(config)  # config errors before any work
    model_cfg = resolve_model_config(config)
    shape = step_shape(config, chip)
    sizes = mesh_sizes(config, num_devices)
    analytic = analytic_plan(model_cfg, shape, sizes, dtype=config.model.dtype, param_dtype=config.model.param_dtype)
    n_params = analytic.pop("num_params")
    compiled, note = None, ""
    if mode == "auto" and n_params > int(dr.get("max_compile_params", 2_000_000_000)):
        note = (f"not compiled: {n_params / 1e9:.1f}B parameters > dry_run.max_compile_params "
                f"(set dry_run.mode=compile to compile on CPU anyway)")
    elif mode in ("auto", "compile"):
        if len(jax.devices()) < num_devices:
            note = f"not compiled: {len(jax.devices())} JAX devices < {num_devices} (run the CLI with --dry_run)"
        else:
            compiled = compiled_plan(config, model_cfg, shape, sizes)
    else:
        note = "not compiled: dry_run.mode=analytic"
    sp = sampler_plan(config, model_cfg, num_devices, chip)
    sampler_compiled = None
    if dr.get("compile_sampler", False) and compiled is not None and math.prod(sp["mesh"]) <= len(jax.devices()):
        sampler_compiled = compiled_sampler_plan(config, model_cfg, sp)
    return dict(model=model_cfg, num_params=n_params, shape=shape, mesh=sizes, chip=chip,
                hbm_bytes=CHIP_HBM_GIB[chip] * GIB, analytic=analytic, compiled=compiled, compiled_note=note,
                sampler=sp, sampler_compiled=sampler_compiled)


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
        f"attention={s.attention}, remat={s.remat}, scan_layers={s.scan_layers}",
        "",
        f"ANALYTIC estimate, per device        {unit}",
    ]
    for k in ("params", "optimizer", "gradients", "gathered", "activations", "loss", "batch", "total"):
        lines.append(f"  {k:<30}{g(report['analytic'][k])}")
    a_total = report["analytic"]["total"]
    lines.append(f"  {'fits in HBM?':<30}{'yes' if a_total <= hbm else 'NO':>10}  ({100 * a_total / hbm:.0f}% of HBM)")
    c = report["compiled"]
    if c is not None:
        lines += ["", f"COMPILED (XLA CPU memory_analysis, {c['compile_seconds']:.0f} s), per device   {unit}"]
        if mc.is_moe:
            lines.append("  (MoE: XLA:CPU lowers ragged_dot as a dense dot over an E-fold expanded input, so its temp "
                         "overstates a TPU's)")
        for k in ("argument", "output", "alias", "temp", "total"):
            lines.append(f"  {k:<30}{g(c[k])}")
        lines.append(f"  {'fits in HBM?':<30}{'yes' if c['total'] <= hbm else 'NO':>10}  "
                     f"({100 * c['total'] / hbm:.0f}% of HBM)")
    else:
        lines += ["", f"COMPILED: {report['compiled_note']}"]
    lines += [""] + _sampler_lines(report["sampler"], a_total, hbm, g, unit, report.get("sampler_compiled"))
    # The verdict (last line): the analytic plan for the target chip (the compiled one is XLA:CPU's estimate).
    verdict = "fits" if a_total <= hbm else "does not fit"
    lines += ["", f"per-device total {a_total / GIB:.2f} GiB of {hbm / GIB:.0f} GiB HBM: {verdict}"]
    return "\n".join(lines)


def _sampler_lines(sp: dict, train_total: int, hbm: int, g, unit: str, compiled=None) -> list:
    """The report's sampler section (`sampler_plan`, `compiled_sampler_plan` when it ran): its keys are
    prefixed ``sampler_`` so that the train step's ``  key  value`` lines stay unique."""
    d, t = sp["mesh"]
    lines = [f"SAMPLER (rollout engine), ANALYTIC, per device of its {d} x {t} (data x tensor) mesh   {unit}",
             f"  ({sp['quantization']} weights held in {sp['dtype']}, {sp['slots']} slots)"]
    for k in ("weights", "kv_cache", "prompt_store", "park", "total"):
        lines.append(f"  {'sampler_' + k:<30}{g(sp[k])}")
    if sp["colocated"]:
        both = train_total + sp["total"]
        lines += ["  colocated: the sampler lives on the same chips as the train step (sampler.mode)",
                  f"  {'train_plus_sampler':<30}{g(both)}",
                  f"  {'fits in HBM?':<30}{'yes' if both <= hbm else 'NO':>10}  ({100 * both / hbm:.0f}% of HBM)"]
    else:
        lines += ["  on its own devices (sampler.mode subprocess / remote)",
                  f"  {'fits in HBM?':<30}{'yes' if sp['total'] <= hbm else 'NO':>10}  "
                  f"({100 * sp['total'] / hbm:.0f}% of HBM)"]
    if compiled is not None:
        lines.append(f"  COMPILED sampler program (XLA CPU memory_analysis, {compiled['compile_seconds']:.0f} s), "
                     f"per device   {unit}")
        for k in ("argument", "output", "temp", "total"):
            lines.append(f"  {'sampler_compiled_' + k:<30}{g(compiled[k])}")
    return lines


def main(config) -> dict:
    """Runs :func:`plan` and prints :func:`format_report`; returns the report."""
    report = plan(config)
    print(format_report(report), flush=True)
    return report
