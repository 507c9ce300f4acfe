"""Qwen3 dense and MoE decoder in Flax NNX, numerically matching Hugging Face's ``Qwen3ForCausalLM``.

Checked against ``transformers`` 5.24 ``models/qwen3/modeling_qwen3.py`` (f32 RMSNorm, per-head q/k RMSNorm before
rotate-half RoPE, GQA with scale ``head_dim**-0.5``, SwiGLU, tied or untied head): parity to <= 1e-4 in f32 in
``tests/test_qwen3.py`` (logits of ``scripts/make_qwen3_reference.py``). Axes: B batch, T query length, S key length
(cache slots), D hidden, N query heads, K kv heads, G = N // K, H head dim, F MLP width, V vocab, L layers.

Parameters (``pdm_jax.models.hf_io`` maps HF's ``[out, in]`` weights; ``layers`` is one ``DecoderLayer`` stacked over
L, row ``i`` = HF's ``model.layers.{i}``, run under ``jax.lax.scan``; logical axes in ``out_sharding``)::

    embed_tokens.embedding       [V, D]
    layers.input_layernorm.scale            [L, D]
    layers.self_attn.q_proj.kernel          [L, D, N, H]
    layers.self_attn.k_proj.kernel          [L, D, K, H]
    layers.self_attn.v_proj.kernel          [L, D, K, H]
    layers.self_attn.o_proj.kernel          [L, N, H, D]
    layers.self_attn.q_norm.scale           [L, H]
    layers.self_attn.k_norm.scale           [L, H]
    layers.post_attention_layernorm.scale   [L, D]
    layers.mlp.gate_proj.kernel             [L, D, F]
    layers.mlp.up_proj.kernel               [L, D, F]
    layers.mlp.down_proj.kernel             [L, F, D]
    norm.scale                              [D]
    lm_head.kernel                          [D, V]   (absent when tie_word_embeddings)

The training forward uses the attention kernel ``attention=`` selects (``pdm_jax.models.attention``), optional
per-layer remat and a scanned or unrolled stack; ``decode`` attends densely over its KV cache, layers unrolled."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax import sharding as shd
from pdm_jax.models import attention as attn_lib
from pdm_jax.models import moe as moe_lib

Array = jax.Array

_INIT_STD = 0.02  # HF Qwen3 initializer_range default; only matters for random init.


# ---- Config ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 hyper-parameters, dense or MoE (HF ``Qwen3Config`` / ``Qwen3MoeConfig`` names, transformers 5.24).

    MoE (``num_experts`` > 0; ``Qwen3MoeConfig``'s defaults): a sparse layer's MLP is ``num_experts`` SwiGLU experts
    of width ``moe_intermediate_size`` behind a linear router, each token to its ``num_experts_per_tok`` most
    probable (weights renormalised when ``norm_topk_prob``). Layer ``i`` is sparse iff not in ``mlp_only_layers`` and
    ``(i+1) % decoder_sparse_step == 0``; otherwise dense (a mixed model, ``is_mixed``, keeps two stacks:
    ``layer_plan``). ``router_aux_loss_coef``: HF's load-balancing loss weight.

    Raises:
      ValueError: naming the field and value: a non-positive size, ``num_attention_heads`` not divisible by
        ``num_key_value_heads``, an odd ``head_dim``, ``rms_norm_eps``/``rope_theta`` <= 0; a negative
        ``num_experts``, a non-positive ``num_experts_per_tok`` / ``moe_intermediate_size`` /
        ``decoder_sparse_step``, ``num_experts_per_tok`` > ``num_experts``, a negative or non-finite
        ``router_aux_loss_coef``, a non-bool ``norm_topk_prob``, or ``mlp_only_layers`` not distinct layer indices."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    # Qwen3-MoE (HF ``Qwen3MoeConfig``; ``num_experts`` = 0 is the dense model and the other MoE fields are then
    # unused).
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "Qwen3Config.num_attention_heads must be divisible by num_key_value_heads, got "
                f"num_attention_heads={self.num_attention_heads}, "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
                    or not math.isfinite(value)):
                raise ValueError(f"Qwen3Config.{name} must be a positive finite float, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"Qwen3Config.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        self._check_moe()

    def _check_moe(self):
        """Validates the Qwen3-MoE fields (see the class docstring)."""
        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))

        if not is_int(self.num_experts) or self.num_experts < 0:
            raise ValueError(f"Qwen3Config.num_experts must be an int >= 0 (0 = dense), "
                             f"got {self.num_experts!r}")
        for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3Config.num_experts_per_tok must be <= num_experts = {self.num_experts}, "
                f"got {self.num_experts_per_tok}")
        if not isinstance(self.norm_topk_prob, (bool, np.bool_)):
            raise ValueError(f"Qwen3Config.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        coef = self.router_aux_loss_coef
        if (not isinstance(coef, numbers.Real) or isinstance(coef, (bool, np.bool_))
                or not math.isfinite(coef) or coef < 0):
            raise ValueError(
                f"Qwen3Config.router_aux_loss_coef must be a finite float >= 0, got {coef!r}")
        layers = self.mlp_only_layers
        if isinstance(layers, list):  # a JSON list; stored as a tuple (the config is hashed)
            layers = tuple(layers)
            object.__setattr__(self, "mlp_only_layers", layers)
        if (not isinstance(layers, tuple) or not all(is_int(i) for i in layers)
                or len(set(layers)) != len(layers)
                or not all(0 <= i < self.num_hidden_layers for i in layers)):
            raise ValueError(
                "Qwen3Config.mlp_only_layers must be distinct layer indices in "
                f"[0, num_hidden_layers = {self.num_hidden_layers}), got {self.mlp_only_layers!r}")

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer ``i`` has the sparse MoE block (HF ``Qwen3MoeDecoderLayer``'s rule: ``num_experts > 0``, ``i``
        not in ``mlp_only_layers`` and ``(i+1) % decoder_sparse_step == 0``)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer carries the sparse MoE block."""
        return self.num_experts > 0 and any(self.is_sparse_layer(i)
                                            for i in range(self.num_hidden_layers))

    @property
    def is_mixed(self) -> bool:
        """Whether a MoE model also has dense-MLP layers (``decoder_sparse_step`` > 1 or ``mlp_only_layers``): the model
        then holds two layer stacks (``layer_plan``)."""
        return self.is_moe and not all(self.is_sparse_layer(i)
                                       for i in range(self.num_hidden_layers))

    @property
    def layer_plan(self) -> tuple[tuple[int, int], ...]:
        """``layer_plan[i] = (stack, row)`` of decoder layer i: stack 0 = ``Qwen3ForCausalLM.layers`` (every layer
        unless ``is_mixed``, then the sparse ones), 1 = ``dense_layers``."""
        plan, rows = [], [0, 0]
        for i in range(self.num_hidden_layers):
            stack = int(self.is_mixed and not self.is_sparse_layer(i))
            plan.append((stack, rows[stack]))
            rows[stack] += 1
        return tuple(plan)

    def stack_layer_ids(self, stack: int) -> tuple[int, ...]:
        """The layer indices (HF ``model.layers.{i}``) held by ``stack``'s rows, in order."""
        return tuple(i for i, (s, _) in enumerate(self.layer_plan) if s == stack)

    @property
    def num_query_groups(self) -> int:
        """G = num_attention_heads // num_key_value_heads."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Qwen3Config":
        """Builds a config from an HF ``config.json`` dict (transformers 4.x or 5.x layout; ``model_type`` "qwen3" or
        "qwen3_moe", absent MoE fields at ``Qwen3MoeConfig``'s defaults).

        Raises:
          ValueError: naming the field for anything not implemented: another ``model_type``, ``hidden_act`` !=
            "silu", ``attention_bias`` or ``use_sliding_window`` true, a ``rope_type`` other than "default", a
            ``layer_types`` entry other than "full_attention", ``num_experts`` > 0 with "qwen3", bad MoE fields, or a
            missing required field."""
        if not isinstance(d, dict):
            raise ValueError(f"HF config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type", "qwen3")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"model_type={model_type!r} is not supported (only 'qwen3' and "
                             "'qwen3_moe')")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("attention_bias", False):
            raise ValueError(f"attention_bias={d['attention_bias']!r} is not supported")
        if d.get("use_sliding_window", False):
            raise ValueError(f"use_sliding_window={d['use_sliding_window']!r} is not supported")
        moe_kwargs = {}
        if model_type == "qwen3_moe":
            moe_kwargs = cls._moe_kwargs_from_hf(d)
        elif d.get("num_experts", 0) or d.get("num_local_experts", 0):
            raise ValueError(f"num_experts={d.get('num_experts', d.get('num_local_experts'))!r} "
                             "with model_type='qwen3' (MoE configs have model_type 'qwen3_moe')")
        layer_types = d.get("layer_types")
        if layer_types is not None:
            bad = sorted({t for t in layer_types if t != "full_attention"})
            if bad:
                raise ValueError(f"layer_types contains {bad} (only 'full_attention' supported)")
        rope_theta = d.get("rope_theta")
        for key in ("rope_scaling", "rope_parameters"):
            rope = d.get(key)
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise ValueError(f"{key}={rope!r} must be a dict or null")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"{key}.rope_type={rope_type!r} is not supported (only 'default')")
            if "rope_theta" in rope:
                rope_theta = rope["rope_theta"]
            extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
            if extra:
                raise ValueError(f"{key} has unsupported entries {extra}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        for name in required:
            if name not in d:
                raise ValueError(f"HF config is missing required field {name!r}")
        for name in ("hidden_size", "num_attention_heads"):
            if not isinstance(d[name], int) or isinstance(d[name], bool) or d[name] < 1:
                raise ValueError(f"HF config field {name!r} must be a positive integer, got {d[name]!r}")
        num_kv = d.get("num_key_value_heads") or d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ValueError(f"HF config field 'tie_word_embeddings' must be a JSON boolean, got {tie!r}")
        kwargs: dict[str, Any] = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=num_kv,
            head_dim=head_dim,
            tie_word_embeddings=tie)
        if "rms_norm_eps" in d:
            kwargs["rms_norm_eps"] = float(d["rms_norm_eps"])
        if rope_theta is not None:
            kwargs["rope_theta"] = float(rope_theta)
        if d.get("max_position_embeddings") is not None:
            kwargs["max_position_embeddings"] = d["max_position_embeddings"]
        return cls(**kwargs, **moe_kwargs)

    @staticmethod
    def _moe_kwargs_from_hf(d: dict) -> dict:
        """The MoE fields of a ``qwen3_moe`` config dict, with ``Qwen3MoeConfig``'s defaults.

        The hub's files name the expert count ``num_experts``; transformers 5 writes it as ``num_local_experts`` (its
        ``attribute_map``); either is read (equal if both).
        """
        hf_defaults = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                           router_aux_loss_coef=0.001)
        if ("num_experts" in d and "num_local_experts" in d
                and d["num_experts"] != d["num_local_experts"]):
            raise ValueError(f"HF config has num_experts={d['num_experts']!r} and "
                             f"num_local_experts={d['num_local_experts']!r}; they must agree")
        out = {}
        for name, default in hf_defaults.items():
            value = d.get(name)
            if value is None and name == "num_experts":
                value = d.get("num_local_experts")
            out[name] = default if value is None else value
        if not isinstance(out["mlp_only_layers"], (list, tuple)):
            raise ValueError(f"HF config field 'mlp_only_layers' must be a list of layer "
                             f"indices, got {out['mlp_only_layers']!r}")
        out["mlp_only_layers"] = tuple(out["mlp_only_layers"])
        return out

    def to_hf_dict(self) -> dict:
        """An HF ``Qwen3Config``-compatible dict (loads with transformers 4.51+ and 5.x); ``Qwen3MoeConfig``'s
        (model_type "qwen3_moe", expert count as the hub's ``num_experts``) when ``num_experts`` > 0."""
        d = self._dense_hf_dict()
        if self.num_experts:
            d.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
        return d

    def _dense_hf_dict(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": _INIT_STD,
            "use_cache": True,
            "torch_dtype": "float32",
        }


# ---- KV cache --------------------------------------------------------------------------------------------


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value cache, a pytree with one pair of arrays per layer (model dtype unless given).

    Attributes:
      k: tuple of L arrays [B, K, H, S] of rotated keys (head-dim-major: a decode query's ``q @ k`` is a plain
        matmul).
      v: tuple of L arrays [B, K, S, H] of values.

    Slot ``s`` of row ``b`` is valid iff the caller's ``kv_mask[b, s]`` (the sampler owns ``cache_index`` and
    ``kv_mask``). Separate per-layer arrays are updated in place without copies; one stacked array made XLA:CPU copy
    and transpose a layer's slice every step (1.7 ms vs 0.23 ms per attention step; ``bench/bench_sampler.py``)."""

    k: tuple
    v: tuple

    @property
    def max_length(self) -> int:
        """S, the number of slots."""
        return self.k[0].shape[-1]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def grow(self, extra: int) -> "KVCache":
        """The same cache with ``extra`` zero slots appended (slots S .. S+extra-1)."""
        if isinstance(extra, bool) or not isinstance(extra, numbers.Integral) or extra < 0:
            raise ValueError(f"KVCache.grow: extra must be a static int >= 0, got {extra!r}")
        pad_k = ((0, 0), (0, 0), (0, 0), (0, extra))
        pad_v = ((0, 0), (0, 0), (0, extra), (0, 0))
        return KVCache(k=tuple(jnp.pad(k, pad_k) for k in self.k),
                       v=tuple(jnp.pad(v, pad_v) for v in self.v))


# ---- Building blocks -------------------------------------------------------------------------------------


class KeySeq:
    """Deterministic key stream ``fold_in(key, 0), fold_in(key, 1), ...`` for initialisation.

    Drawing every parameter's key from ``nnx.Rngs`` costs a state update per parameter (slow under ``nnx.eval_shape``
    for 64-layer models); the model draws one key from its ``rngs`` and hands this stream to its submodules.
    """

    def __init__(self, key: Array, start: int | Array = 0):
        self.key = key
        self.count = start

    def next(self) -> Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count - 1)


def _next_key(rngs: nnx.Rngs | KeySeq) -> Array:
    return rngs.next() if isinstance(rngs, KeySeq) else rngs.params()


def _param(rngs: nnx.Rngs | KeySeq, shape, logical_axes, param_dtype,
           init="normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, param_dtype)
    else:
        value = (_INIT_STD * jax.random.normal(_next_key(rngs), shape, jnp.float32)
                 ).astype(param_dtype)
    # eager_sharding=False: logical names are resolved by pdm_jax.sharding, not at creation.
    return nnx.Param(value, out_sharding=tuple(logical_axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps), normalised in f32 (HF ``Qwen3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, *, logical_axis: str, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.scale = _param(rngs, (dim,), (logical_axis,), param_dtype, init="ones")
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x_BxTx_: Array) -> Array:
        x32 = x_BxTx_.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.scale.get_value().astype(self.dtype) * normed


class Embed(nnx.Module):
    """Token embedding table ``embedding`` [V, D]; ``attend`` gives tied-head logits."""

    def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.embedding = _param(rngs, (vocab_size, hidden_size), ("vocab", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, ids_BxT: Array) -> Array:
        # Gather from a replicated view of the table (all-gathered like every kernel): a sharded table makes the SPMD
        # partitioner fall back to full rematerialisation.
        table_VxD = shd.constrain(self.embedding.get_value(), (None, None))
        ids_BxT = shd.constrain(ids_BxT, ("batch", "length"))
        # mode="clip": out-of-range ids (e.g. -1 padding) read a real row instead of the NaN that jnp.take's default
        # "fill" mode returns, which would leak through the zero-weighted attention values (0 * NaN = NaN).
        return jnp.take(table_VxD, ids_BxT, axis=0, mode="clip").astype(self.dtype)

    def attend(self, x_BxTxD: Array) -> Array:
        return jnp.einsum("btd,vd->btv", x_BxTxD, self.embedding.get_value().astype(self.dtype),
                          preferred_element_type=jnp.float32)


class Proj(nnx.Module):
    """A bias-free projection ``y = einsum(eqn, x, kernel)`` with an arbitrary kernel shape."""

    def __init__(self, eqn: str, shape, logical_axes, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.kernel = _param(rngs, tuple(shape), logical_axes, param_dtype)
        self.eqn = eqn
        self.dtype = dtype

    def __call__(self, x: Array, preferred_element_type=None) -> Array:
        return jnp.einsum(self.eqn, x.astype(self.dtype), self.kernel.get_value().astype(self.dtype),
                          preferred_element_type=preferred_element_type)


def rope_inv_freq(head_dim: int, theta: float) -> Array:
    """inv_freq[j] = theta^(-2j/H), j < H/2, f32 (RoFormer, Su et al. 2021, eq. 15)."""
    exponent_J = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (jnp.float32(theta) ** exponent_J)


def apply_rope(x_BxTxNxH: Array, positions_BxT: Array, theta: float) -> Array:
    """Rotate-half RoPE as in HF Llama/Qwen3: x*cos + rotate_half(x)*sin, computed in f32."""
    head_dim = x_BxTxNxH.shape[-1]
    freqs_BxTxJ = positions_BxT.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta)
    angles_BxTxH = jnp.concatenate([freqs_BxTxJ, freqs_BxTxJ], axis=-1)
    cos_BxTx1xH = jnp.cos(angles_BxTxH)[:, :, None, :]
    sin_BxTx1xH = jnp.sin(angles_BxTxH)[:, :, None, :]
    x32 = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos_BxTx1xH + rotated * sin_BxTx1xH).astype(x_BxTxNxH.dtype)


class Attention(nnx.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        c = config
        D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Proj("btd,dnh->btnh", (D, N, H), ("embed", "heads", "head_dim"), **kw)
        self.k_proj = Proj("btd,dkh->btkh", (D, K, H), ("embed", "kv_heads", "head_dim"), **kw)
        self.v_proj = Proj("btd,dkh->btkh", (D, K, H), ("embed", "kv_heads", "head_dim"), **kw)
        self.o_proj = Proj("btnh,nhd->btd", (N, H, D), ("heads", "head_dim", "embed"), **kw)
        self.q_norm = RMSNorm(H, c.rms_norm_eps, logical_axis="norm", **kw)
        self.k_norm = RMSNorm(H, c.rms_norm_eps, logical_axis="norm", **kw)
        self.num_kv_heads = K
        self.num_groups = c.num_query_groups
        self.head_dim = H
        self.rope_theta = c.rope_theta
        self.dtype = dtype

    def __call__(self, x_BxTxD: Array, positions_BxT: Array,
                 mask: attn_lib.SelfAttentionMask | Array,
                 kv: tuple[Array, Array] | None = None,
                 cache_index: Array | None = None,
                 attention: attn_lib.AttentionOptions | None = None,
                 kv_window: tuple[Array, tuple[int, ...]] | None = None,
                 ) -> tuple[Array, tuple[Array, Array] | None]:
        """Attends the T queries to S keys; returns (out [B,T,D], updated ``(k, v)`` or None).

        Without ``kv``, keys are the T current tokens and ``mask`` is a ``SelfAttentionMask`` (the selected kernel)
        or a ``[B,T,S]`` bool array (dense). With ``kv`` = this layer's cache ``(k [B,K,H,S], v [B,K,S,H])``, the
        current keys and values are written at slots ``cache_index ..`` (in place under donation), the queries attend
        densely to all S slots under the ``[B,T,S]`` ``mask``, and ``kv_window = (index, widths)`` restricts the read
        to the first ``widths[index]`` slots (static widths, one ``lax.switch`` branch each; later slots must be
        masked). ValueError for ``kv_window`` without ``kv``."""
        B, T, _ = x_BxTxD.shape
        if kv_window is not None and kv is None:
            raise ValueError("Attention: kv_window needs a KV cache (kv); it selects how many cache slots are read")
        q_BxTxNxH = self.q_norm(self.q_proj(x_BxTxD))
        k_BxTxKxH = self.k_norm(self.k_proj(x_BxTxD))
        v_BxTxKxH = self.v_proj(x_BxTxD)
        q_BxTxNxH = apply_rope(q_BxTxNxH, positions_BxT, self.rope_theta)
        k_BxTxKxH = apply_rope(k_BxTxKxH, positions_BxT, self.rope_theta)
        q_BxTxNxH = shd.constrain(q_BxTxNxH, ("batch", "length", "heads", "head_dim"))
        K, G, H = self.num_kv_heads, self.num_groups, self.head_dim
        q_BxTxKxGxH = q_BxTxNxH.reshape(B, T, K, G, H)
        if kv is None and isinstance(mask, attn_lib.SelfAttentionMask):
            out_BxTxKxGxH = attn_lib.self_attention(
                q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask,
                attn_lib.AttentionOptions() if attention is None else attention, dtype=self.dtype)
        elif kv is None:
            out_BxTxKxGxH = attn_lib.dense_attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask,
                                                     dtype=self.dtype)
        else:
            mask_BxTxS = mask
            k_BxKxHxS, v_BxKxSxH = kv
            zero = jnp.zeros((), jnp.int32)
            new_k = k_BxTxKxH.transpose(0, 2, 3, 1).astype(k_BxKxHxS.dtype)
            new_v = v_BxTxKxH.transpose(0, 2, 1, 3).astype(v_BxKxSxH.dtype)
            if jnp.ndim(cache_index) == 1:  # per-row first slot [B] (continuous batching): a scatter
                k_BxKxHxS = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (zero, zero, i)))(
                    k_BxKxHxS, new_k, cache_index)
                v_BxKxSxH = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (zero, i, zero)))(
                    v_BxKxSxH, new_v, cache_index)
            else:
                k_BxKxHxS = jax.lax.dynamic_update_slice(k_BxKxHxS, new_k, (zero, zero, zero, cache_index))
                v_BxKxSxH = jax.lax.dynamic_update_slice(v_BxKxSxH, new_v, (zero, zero, cache_index, zero))
            kv = (k_BxKxHxS, v_BxKxSxH)
            # Queries as [B, K, T*G, H] rows: with the cache layouts both products are plain batched matmuls ([TG,H] x
            # [H,S], then [TG,S] x [S,H]) with no cache transpose (for T = 1 the query/output transposes are free).
            q_BxKxTGxH = q_BxTxKxGxH.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
            attend = functools.partial(self._cached_attention, T=T, G=G)
            if kv_window is None:
                out_BxKxTGxH = attend(q_BxKxTGxH, k_BxKxHxS, v_BxKxSxH, mask_BxTxS)
            else:  # read only the first widths[index] slots (one branch per static width)
                index, widths = kv_window
                out_BxKxTGxH = jax.lax.switch(
                    index, [functools.partial(attend, width=w) for w in widths],
                    q_BxKxTGxH, k_BxKxHxS, v_BxKxSxH, mask_BxTxS)
            out_BxTxKxGxH = out_BxKxTGxH.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)
        out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, -1, self.head_dim)
        return self.o_proj(out_BxTxNxH), kv

    def _cached_attention(self, q_BxKxTGxH: Array, k_BxKxHxS: Array, v_BxKxSxH: Array, mask_BxTxS: Array, *,
                          T: int, G: int, width: int | None = None) -> Array:
        """Dense attention of the [B, K, T*G, H] queries over the first ``width`` (default all S) cache slots under
        ``mask_BxTxS``; returns [B, K, T*G, H] in the compute dtype."""
        if width is not None:
            k_BxKxHxS, v_BxKxSxH, mask_BxTxS = k_BxKxHxS[..., :width], v_BxKxSxH[:, :, :width], mask_BxTxS[..., :width]
        B, K, _, H = q_BxKxTGxH.shape
        S = k_BxKxHxS.shape[-1]
        fill = jnp.finfo(jnp.float32).min  # a finite fill keeps fully masked rows (pure padding queries) NaN-free
        scores_BxKxTGxS = jnp.einsum("bkqh,bkhs->bkqs", q_BxKxTGxH, k_BxKxHxS.astype(self.dtype),
                                     preferred_element_type=jnp.float32) * H ** -0.5
        scores_BxKxTxGxS = jnp.where(mask_BxTxS[:, None, :, None, :], scores_BxKxTGxS.reshape(B, K, T, G, S), fill)
        probs_BxKxTGxS = jax.nn.softmax(scores_BxKxTxGxS, axis=-1).astype(self.dtype).reshape(B, K, T * G, S)
        return jnp.einsum("bkqs,bksh->bkqh", probs_BxKxTGxS, v_BxKxSxH.astype(self.dtype))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (HF ``Qwen3MLP``)."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        D, F = config.hidden_size, config.intermediate_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Proj("btd,df->btf", (D, F), ("embed", "mlp"), **kw)
        self.up_proj = Proj("btd,df->btf", (D, F), ("embed", "mlp"), **kw)
        self.down_proj = Proj("btf,fd->btd", (F, D), ("mlp", "embed"), **kw)

    def __call__(self, x_BxTxD: Array) -> Array:
        h_BxTxF = jax.nn.silu(self.gate_proj(x_BxTxD)) * self.up_proj(x_BxTxD)
        h_BxTxF = shd.constrain(h_BxTxF, ("batch", "length", "mlp"))
        return self.down_proj(h_BxTxF)


class Experts(nnx.Module):
    """E SwiGLU experts' kernels, stacked over the expert axis (HF ``mlp.experts``)."""

    def __init__(self, num_experts: int, hidden_size: int, width: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        E, D, I = num_experts, hidden_size, width  # noqa: E741 (I: the MLP's intermediate size)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Proj("nd,edi->nei", (E, D, I), ("expert", "embed", "mlp"), **kw)
        self.up_proj = Proj("nd,edi->nei", (E, D, I), ("expert", "embed", "mlp"), **kw)
        self.down_proj = Proj("nei,eid->ned", (E, I, D), ("expert", "mlp", "embed"), **kw)


class SparseMoeBlock(nnx.Module):
    """Qwen3-MoE sparse MLP (HF ``Qwen3MoeSparseMoeBlock``): a linear router over E experts, each token to its
    top-``num_experts_per_tok`` (``pdm_jax.models.moe``); router logits with f32 accumulation, softmax in f32.

    Parameters (HF ``mlp.gate.weight`` [E, D] and ``mlp.experts.{e}.{gate,up,down}_proj.weight`` stacked over e)::

        gate.kernel               [D, E]     logical ("embed", None)
        experts.gate_proj.kernel  [E, D, I]  logical ("expert", "embed", "mlp")
        experts.up_proj.kernel    [E, D, I]  logical ("expert", "embed", "mlp")
        experts.down_proj.kernel  [E, I, D]  logical ("expert", "mlp", "embed")"""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        D, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size  # noqa: E741
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate = Proj("nd,de->ne", (D, E), ("embed", None), **kw)
        self.experts = Experts(E, D, I, **kw)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dtype = dtype

    def __call__(self, x_BxTxD: Array, implementation: str = "ragged_dot",
                 token_weight_BxT: Array | None = None,
                 routed_experts_BxTxK: Array | None = None) -> tuple[Array, tuple]:
        """[B,T,D] -> ([B,T,D], (load-balancing sums of ``moe.load_balancing_stats``..., the experts used [B,T,K]
        int32)).

        ``token_weight_BxT`` (e.g. the attention mask) weights the rows of those sums only. ``routed_experts_BxTxK``
        (routing replay): run these experts instead of this router's top-k, weighted by this router's probabilities over
        them (``moe.route_replayed``).
        """
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D).astype(self.dtype)
        logits_NxE = self.gate(x_NxD, preferred_element_type=jnp.float32)
        if routed_experts_BxTxK is None:
            weights_NxK, experts_NxK, probs_NxE = moe_lib.route(logits_NxE, self.top_k,
                                                                self.norm_topk_prob)
        else:
            if routed_experts_BxTxK.shape != (B, T, self.top_k):
                raise ValueError(f"routed_experts must be [B, T, L, num_experts_per_tok] with "
                                 f"[B, T, k] = {(B, T, self.top_k)} per layer, got "
                                 f"{routed_experts_BxTxK.shape} for a layer")
            weights_NxK, experts_NxK, probs_NxE = moe_lib.route_replayed(
                logits_NxE, routed_experts_BxTxK.reshape(B * T, self.top_k), self.norm_topk_prob)
        e = self.experts
        y_NxD = moe_lib.experts(
            x_NxD, weights_NxK, experts_NxK, e.gate_proj.kernel.get_value(),
            e.up_proj.kernel.get_value(), e.down_proj.kernel.get_value(),
            dtype=self.dtype, implementation=implementation)
        stats = moe_lib.load_balancing_stats(
            probs_NxE, experts_NxK,
            None if token_weight_BxT is None else token_weight_BxT.reshape(B * T))
        return y_NxD.reshape(B, T, D), tuple(stats) + (experts_NxK.reshape(B, T, self.top_k),)


def make_mlp(config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
             param_dtype=jnp.float32, sparse: bool | None = None) -> nnx.Module:
    """The feed-forward submodule of a block: ``SparseMoeBlock`` when ``sparse`` (default ``config.is_moe``), else the
    dense ``MLP`` (width ``intermediate_size``)."""
    if config.is_moe if sparse is None else sparse:
        return SparseMoeBlock(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    return MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, sparse: bool | None = None):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, logical_axis="norm", **kw)
        self.self_attn = Attention(config, **kw)
        self.post_attention_layernorm = RMSNorm(D, eps, logical_axis="norm", **kw)
        self.mlp = make_mlp(config, sparse=sparse, **kw)

    def __call__(self, x_BxTxD, positions_BxT, mask, kv=None, cache_index=None, attention=None,
                 moe_implementation="ragged_dot", token_weight_BxT=None, routed_experts_BxTxK=None,
                 kv_window=None):
        """[B,T,D] -> ([B,T,D], kv, router sums); see ``Attention.__call__`` for the attention arguments (``kv_window``
        too). The router sums (``moe.load_balancing_stats``, rows weighted by ``token_weight_BxT``) are None for a dense
        MLP."""
        attn_BxTxD, kv = self.self_attn(self.input_layernorm(x_BxTxD), positions_BxT,
                                        mask, kv, cache_index, attention, kv_window)
        x_BxTxD = x_BxTxD + attn_BxTxD
        h_BxTxD = self.post_attention_layernorm(x_BxTxD)
        if isinstance(self.mlp, SparseMoeBlock):
            mlp_BxTxD, stats = self.mlp(h_BxTxD, moe_implementation, token_weight_BxT,
                                        routed_experts_BxTxK)
        else:
            mlp_BxTxD, stats = self.mlp(h_BxTxD), None
        x_BxTxD = x_BxTxD + mlp_BxTxD
        return shd.constrain(x_BxTxD, ("batch", "length", "embed")), kv, stats


# ---- Model -----------------------------------------------------------------------------------------------


def default_positions(input_ids_BxT: Array, attention_mask_BxT: Array | None = None,
                      segment_ids_BxT: Array | None = None) -> Array:
    """[B,T] int32 rotary positions: the number of real tokens before t, counted from the start of t's segment.

    Without ``segment_ids`` (one segment per row): cumsum(mask)-1 clipped at 0 (left padding friendly), or arange(T)
    without a mask. With ``segment_ids`` [B,T] (packed rows; each segment a contiguous run of equal ids), the count
    restarts where the id changes, so a packed segment gets the positions it would have alone.
    """
    B, T = input_ids_BxT.shape
    if segment_ids_BxT is None:
        if attention_mask_BxT is None:
            return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
    real_BxT = (jnp.ones((B, T), jnp.int32) if attention_mask_BxT is None
                else jnp.asarray(attention_mask_BxT).astype(jnp.int32))
    count_BxT = jnp.cumsum(real_BxT, axis=-1)
    seg_BxT = jnp.asarray(segment_ids_BxT)
    starts_BxT = jnp.concatenate([jnp.ones((B, 1), bool), seg_BxT[:, 1:] != seg_BxT[:, :-1]], axis=1)
    # Real tokens before each segment's start (non-decreasing along the row: a running max).
    base_BxT = jax.lax.cummax(jnp.where(starts_BxT, count_BxT - real_BxT, 0), axis=1)
    return jnp.maximum(count_BxT - base_BxT - 1, 0)


# Per-layer rematerialisation of the training forward (``Qwen3ForCausalLM(remat=...)``): the policy names are those of
# ``jax.checkpoint_policies``; "full" saves nothing.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def stacked_layers(config: Qwen3Config, keys: KeySeq, *, dtype=jnp.float32,
                   param_dtype=jnp.float32, stack: int = 0) -> DecoderLayer:
    """The decoder layers of ``stack`` (``config.layer_plan``) as one ``DecoderLayer`` with parameters stacked [L, ...],
    initialised from the same keys as L layers built one after the other (``keys`` advances past all); logical axes
    gain a leading "layers"."""
    L = len(config.stack_layer_ids(stack))
    make = functools.partial(DecoderLayer, config, dtype=dtype, param_dtype=param_dtype,
                             sparse=config.is_moe and stack == 0)
    probe = KeySeq(keys.key)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(rngs=probe)))
    per_layer = probe.count
    starts = keys.count + per_layer * jnp.arange(L, dtype=jnp.int32)
    state = jax.vmap(lambda start: nnx.state(make(rngs=KeySeq(keys.key, start))))(starts)
    keys.count += per_layer * L
    state = jax.tree.map(
        lambda v: v.replace(out_sharding=("layers",) + tuple(v.get_metadata()["out_sharding"])),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def layer_slice(layers_state: Any, i: int) -> Any:
    """Layer ``i``'s parameters (a static slice of every leaf of the stacked state)."""
    return jax.tree.map(lambda a: a[i], layers_state)


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 causal LM, dense (HF ``Qwen3ForCausalLM``) or mixture-of-experts (HF ``Qwen3MoeForCausalLM`` when
    ``config.num_experts`` > 0), holding only ``nnx.Param`` state; a mixed MoE model keeps its dense-MLP layers in
    ``dense_layers`` (``config.layer_plan``) and always unrolls.

    Args:
      config: a validated ``Qwen3Config``.
      rngs: used only at construction for the N(0, 0.02) init (norms start at 1).
      dtype: computation dtype; softmax, RMSNorm statistics and RoPE run in f32; logits are always f32.
      param_dtype: storage dtype of the parameters.
      attention: the training forward's kernel, one of ``pdm_jax.models.attention.IMPLEMENTATIONS``.
      remat: per-layer rematerialisation, a key of ``REMAT_POLICIES``.
      scan_layers: run the stacked layers under ``jax.lax.scan`` (program size independent of L; default) or
        unrolled.
      attention_block_q, attention_block_kv: tile lengths of "blockwise" and "splash".
      moe_implementation: one of ``pdm_jax.models.moe.IMPLEMENTATIONS``, for training and ``decode``.
    Raises:
      ValueError: naming the option and the value for an unknown ``attention`` or ``remat`` or a non-positive block
        size.

    The compute options are static (part of the graph definition); ``set_compute_options`` changes them."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, attention: str = "dense", remat: str = "none",
                 attention_block_q: int = 512, attention_block_kv: int = 512,
                 scan_layers: bool = True, moe_implementation: str = "ragged_dot"):
        self.config = config
        self.dtype = dtype
        self.attention_options = attn_lib.AttentionOptions(attention, attention_block_q,
                                                           attention_block_kv)
        self.remat = "none"
        self.scan_layers = True
        self.moe_implementation = "ragged_dot"
        self.set_compute_options(remat=remat, scan_layers=scan_layers,
                                 moe_implementation=moe_implementation)
        keys = KeySeq(_next_key(rngs))
        kw = dict(rngs=keys, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, **kw)
        self.layers = stacked_layers(config, keys, dtype=dtype, param_dtype=param_dtype)
        # A mixed MoE model's dense-MLP layers (``config.layer_plan``); None otherwise.
        self.dense_layers = (stacked_layers(config, keys, dtype=dtype, param_dtype=param_dtype,
                                            stack=1) if config.is_mixed else None)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, logical_axis="norm", **kw)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Proj("btd,dv->btv", (config.hidden_size, config.vocab_size),
                                ("embed", "vocab"), **kw)

    # ------------------------------------------------------------------ options
    def set_compute_options(self, *, attention: str | None = None, remat: str | None = None,
                            attention_block_q: int | None = None,
                            attention_block_kv: int | None = None,
                            scan_layers: bool | None = None,
                            moe_implementation: str | None = None) -> Qwen3ForCausalLM:
        """Sets the training forward's attention kernel / remat policy / tiles / layer scan in place (None keeps the
        current value); returns the model. Same values and errors as the constructor's arguments."""
        if remat is not None:
            if remat not in REMAT_POLICIES:
                raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
            self.remat = remat
        if scan_layers is not None:
            if not isinstance(scan_layers, (bool, np.bool_)):
                raise ValueError(f"scan_layers must be a bool, got {scan_layers!r}")
            if scan_layers and self.config.is_mixed:
                logging.getLogger(__name__).info(
                    "scan_layers=True: this MoE model mixes sparse and dense layers "
                    "(decoder_sparse_step = %d, mlp_only_layers = %s), so its forward unrolls "
                    "the layers instead", self.config.decoder_sparse_step,
                    list(self.config.mlp_only_layers))
            self.scan_layers = bool(scan_layers)
        opts = self.attention_options
        self.attention_options = attn_lib.AttentionOptions(
            opts.implementation if attention is None else attention,
            opts.block_q if attention_block_q is None else attention_block_q,
            opts.block_kv if attention_block_kv is None else attention_block_kv)
        if moe_implementation is not None:
            if moe_implementation not in moe_lib.IMPLEMENTATIONS:
                raise ValueError(f"moe_implementation must be one of {moe_lib.IMPLEMENTATIONS}, "
                                 f"got {moe_implementation!r}")
            self.moe_implementation = moe_implementation
        return self

    # ------------------------------------------------------------------ helpers
    def _logits(self, x_BxTxD: Array) -> Array:
        return self.logits_from_hidden(self.norm(x_BxTxD))

    def logits_from_hidden(self, h_BxTxD: Array) -> Array:
        """The LM head alone: final hidden states [B,T,D] (after ``norm``) -> logits [B,T,V] f32.

        Tied (``embed_tokens.attend``) or untied (``lm_head``) projection. Lets a loss project a few positions at a time
        (``pdm_jax.rl.chunked_loss``) instead of materialising all [B,T,V] logits.
        """
        if self.lm_head is None:
            logits_BxTxV = self.embed_tokens.attend(h_BxTxD)
        else:
            logits_BxTxV = self.lm_head(h_BxTxD, preferred_element_type=jnp.float32)
        return shd.constrain(logits_BxTxV.astype(jnp.float32), ("batch", "length", "vocab"))

    def _embed(self, input_ids_BxT: Array) -> Array:
        x_BxTxD = self.embed_tokens(input_ids_BxT.astype(jnp.int32))
        return shd.constrain(x_BxTxD, ("batch", "length", "embed"))

    # ------------------------------------------------------------------ full forward
    def __call__(self, input_ids: Array, positions: Array | None = None,
                 attention_mask: Array | None = None, segment_ids: Array | None = None,
                 *, return_aux: bool = False, routed_experts: Array | None = None,
                 return_routing: bool = False) -> Array | tuple:
        """Full causal forward.

        Args:
          input_ids: [B, T] int32 token ids (clipped into [0, V), so any pad id is safe).
          positions: [B, T] int32 rotary positions; default ``default_positions``.
          attention_mask: [B, T] bool/int, 1 = real token; padded keys are never attended, padded queries' logits are
            finite but meaningless.
          segment_ids: [B, T] int packed sequences (attend within the same id), or None.
          return_aux, routed_experts, return_routing: see ``hidden_states``.
        Returns:
          logits: [B, T, V] float32; with ``return_aux`` and/or ``return_routing`` a tuple (logits, router_aux_loss?,
          routed_experts [B, T, L, k]?)."""
        out = self.hidden_states(input_ids, positions, attention_mask, segment_ids,
                                 return_aux=return_aux, routed_experts=routed_experts,
                                 return_routing=return_routing)
        if return_aux or return_routing:
            return (self.logits_from_hidden(out[0]),) + tuple(out[1:])
        return self.logits_from_hidden(out)

    def hidden_states(self, input_ids: Array, positions: Array | None = None,
                      attention_mask: Array | None = None,
                      segment_ids: Array | None = None, *,
                      return_aux: bool = False, routed_experts: Array | None = None,
                      return_routing: bool = False) -> Array | tuple:
        """Final hidden states [B,T,D] (compute dtype) after the final RMSNorm: ``logits_from_hidden(hidden_states(...))
        == self(...)``, same arguments as ``__call__``.

        ``return_aux``: also the load-balancing loss of transformers' ``load_balancing_loss_func`` over the MoE
        layers (rows weighted by ``attention_mask``; unscaled scalar f32, 0.0 when dense). Routing replay (MoE only):
        ``routed_experts`` [B, T, L, k] int runs those experts at each layer and position, weighted by the router's
        softmax over them (``moe.route_replayed``; a negative id runs the router's own top-k); ``return_routing``
        also returns the experts each layer ran, [B, T, L, k] int32 (-1 for a mixed model's dense layers).

        Raises:
          ValueError: naming the argument: a shape that is not [B, T], non-integer ``segment_ids``,
            ``routed_experts`` / ``return_routing`` on a dense model, or ``routed_experts`` not [B, T, L, k]."""
        if (routed_experts is not None or return_routing) and not self.config.is_moe:
            raise ValueError("routed_experts / return_routing need a MoE model (num_experts > 0)")
        input_ids_BxT = jnp.asarray(input_ids, jnp.int32)
        if input_ids_BxT.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids_BxT.shape}")
        B, T = input_ids_BxT.shape
        if attention_mask is not None and jnp.shape(attention_mask) != (B, T):
            raise ValueError(
                f"attention_mask must have shape {(B, T)}, got {jnp.shape(attention_mask)}")
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
            if segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
                raise ValueError(f"segment_ids must be an integer array of shape {(B, T)}, got "
                                 f"{segment_ids.dtype} {segment_ids.shape}")
        if positions is None:
            positions_BxT = default_positions(input_ids_BxT, attention_mask, segment_ids)
        else:
            positions_BxT = jnp.asarray(positions, jnp.int32)
        if positions_BxT.shape != (B, T):
            raise ValueError(f"positions must have shape {(B, T)}, got {positions_BxT.shape}")
        mask = attn_lib.SelfAttentionMask(
            key_valid=None if attention_mask is None else jnp.asarray(attention_mask),
            segment_ids=segment_ids)
        x_BxTxD = self._embed(input_ids_BxT)
        token_weight_BxT = (None if attention_mask is None
                            else jnp.asarray(attention_mask).astype(jnp.float32))

        L = self.config.num_hidden_layers
        replay_LxBxTxK = None
        if routed_experts is not None:
            routed_experts = jnp.asarray(routed_experts)
            want = (B, T, L, self.config.num_experts_per_tok)
            if routed_experts.shape != want or not jnp.issubdtype(routed_experts.dtype, jnp.integer):
                raise ValueError(f"routed_experts must be an integer array of shape [B, T, L, k] = "
                                 f"{want}, got {routed_experts.dtype} {routed_experts.shape}")
            replay_LxBxTxK = jnp.moveaxis(routed_experts.astype(jnp.int32), 2, 0)

        x_BxTxD, stats, routing_LxBxTxK = self._run_layers(
            x_BxTxD, positions_BxT, mask, token_weight_BxT, replay_LxBxTxK)
        h_BxTxD = shd.constrain(self.norm(x_BxTxD), ("batch", "length", "embed"))
        if not (return_aux or return_routing):
            return h_BxTxD
        out = (h_BxTxD,)
        if return_aux:
            if stats is None:
                out += (jnp.zeros((), jnp.float32),)
            else:
                assignments_LxE, prob_sum_LxE, rows_L = stats[:3]
                out += (moe_lib.load_balancing_loss(
                    assignments_LxE.sum(0), prob_sum_LxE.sum(0), rows_L.sum()),)
        if return_routing:
            out += (jnp.moveaxis(routing_LxBxTxK, 0, 2),)  # [L, B, T, k] -> [B, T, L, k]
        return out

    def _stack_states(self) -> list:
        """(graphdef, state) of ``layers`` and, in a mixed model, ``dense_layers``."""
        return [nnx.split(m) for m in (self.layers, self.dense_layers) if m is not None]

    def _run_layers(self, x_BxTxD, positions_BxT, mask, token_weight_BxT, replay_LxBxTxK):
        """The training forward's decoder layers (scanned or unrolled, each under ``self.remat``). Returns (x [B,T,D],
        the sparse layers' router sums stacked over them (``moe.load_balancing_stats`` + experts [Ls,B,T,k]) or None for
        a dense model, the experts every layer ran [L,B,T,k] int32 (-1 rows for dense-MLP layers) or None).
        """
        attention, moe_implementation = self.attention_options, self.moe_implementation

        def runner(graphdef):
            def run_layer(layer_state, x_BxTxD, replay_BxTxK=None):
                x_BxTxD, _, stats = nnx.merge(graphdef, layer_state)(
                    x_BxTxD, positions_BxT, mask, attention=attention,
                    moe_implementation=moe_implementation, token_weight_BxT=token_weight_BxT,
                    routed_experts_BxTxK=replay_BxTxK)
                return x_BxTxD, stats
            if self.remat != "none":
                return jax.checkpoint(run_layer, policy=REMAT_POLICIES[self.remat])
            return run_layer

        stacks = self._stack_states()
        runs = [runner(graphdef) for graphdef, _ in stacks]
        if self.scan_layers and len(stacks) == 1:
            x_BxTxD, stats = jax.lax.scan(lambda x, xs: runs[0](xs[0], x, xs[1]),
                                          x_BxTxD, (stacks[0][1], replay_LxBxTxK))
            return x_BxTxD, stats, None if stats is None else stats[3]
        per_layer = []
        for i, (stack, row) in enumerate(self.config.layer_plan):
            x_BxTxD, layer_stats = runs[stack](
                layer_slice(stacks[stack][1], row), x_BxTxD,
                None if replay_LxBxTxK is None else replay_LxBxTxK[i])
            per_layer.append(layer_stats)
        return (x_BxTxD,) + self._stack_layer_stats(per_layer, x_BxTxD.shape[:2])

    def _stack_layer_stats(self, per_layer: list, batch_shape) -> tuple:
        """(sparse layers' stats stacked, routing [L, B, T, k] with -1 for dense-MLP layers) from the per-layer stats
        list (None entries for dense-MLP layers); (None, None) for a dense model."""
        sparse = [st for st in per_layer if st is not None]
        if not sparse:
            return None, None
        stats = jax.tree.map(lambda *a: jnp.stack(a), *sparse)
        if len(sparse) == len(per_layer):
            return stats, stats[3]
        none = jnp.full(tuple(batch_shape) + (self.config.num_experts_per_tok,), -1, jnp.int32)
        return stats, jnp.stack([none if st is None else st[3] for st in per_layer])

    # ------------------------------------------------------------------ KV cache path
    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """Zero ``KVCache``: per layer k [B, K, H, max_length], v [B, K, max_length, H] (dtype default: model dtype)."""
        c = self.config
        B, K, H, S = batch_size, c.num_key_value_heads, c.head_dim, max_length
        dtype = self.dtype if dtype is None else dtype
        L = c.num_hidden_layers
        return KVCache(k=tuple(jnp.zeros((B, K, H, S), dtype) for _ in range(L)),
                       v=tuple(jnp.zeros((B, K, S, H), dtype) for _ in range(L)))

    def decode_layers(self) -> tuple:
        """The decoder layers in order, one module per layer (static slices of the stacked parameters), to build once
        outside a decode loop (sliced inside, XLA:CPU copies the weights every step; `engine.hoist_layer_slices`
        decides)."""
        stacks = self._stack_states()
        return tuple(nnx.merge(stacks[stack][0], layer_slice(stacks[stack][1], row))
                     for stack, row in self.config.layer_plan)

    def decode(self, input_ids: Array, positions: Array, cache: KVCache, cache_index: Array,
               kv_mask: Array, *, return_routing: bool = False, last_logits_only: bool = False,
               layers: tuple | None = None, kv_window: tuple[Array, tuple[int, ...]] | None = None) -> tuple:
        """Incremental forward through the KV cache (prefill or one-token decode); layers unrolled (one cache array per
        layer, updated in place).

        Args:
          input_ids: [B, T] int32, written into cache slots cache_index .. cache_index+T-1.
          positions: [B, T] int32 rotary positions of those tokens.
          cache: ``KVCache`` from ``init_cache``.
          cache_index: int32 scalar (may be traced), or [B] int32 per row (continuous batching; a scatter).
          kv_mask: [B, S] bool, slots holding real tokens, those written now included.
          last_logits_only: static; logits of the last position only, [B, 1, V].
          layers: `decode_layers()` built once outside a decode loop (default: sliced here).
          kv_window: ``(index, widths)``: read only the first ``widths[index]`` slots (static ints in [T, S];
            ``index`` checked when concrete, clamped by ``lax.switch`` when traced); later slots must be masked.
        Query t attends to slot s iff kv_mask[b, s] and s <= cache_index + t.
        Returns:
          (logits [B, T, V] float32, updated KVCache); with ``return_routing`` (MoE) also the experts each layer ran,
          [B, T, L, k] int32.
        Raises:
          ValueError: shapes of the arguments or the cache that disagree with each other or the model, or a concrete
            ``cache_index`` leaving the cache (0 <= cache_index, cache_index + T <= S)."""
        input_ids_BxT = jnp.asarray(input_ids, jnp.int32)
        positions_BxT = jnp.asarray(positions, jnp.int32)
        B, T = input_ids_BxT.shape
        c = self.config
        L, K, H = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        if len(cache.k) != L or len(cache.v) != L:
            raise ValueError(f"decode: the cache has {len(cache.k)} key and {len(cache.v)} value arrays, "
                             f"the model {L} layers")
        S = cache.max_length
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            if k.shape != (B, K, H, S) or v.shape != (B, K, S, H):
                raise ValueError(f"decode: cache layer {i} has k {k.shape} and v {v.shape}; expected k "
                                 f"[B,K,H,S] = {(B, K, H, S)} and v [B,K,S,H] = {(B, K, S, H)}")
        if positions_BxT.shape != (B, T) or kv_mask.shape != (B, S) or not 1 <= T <= S:
            raise ValueError(
                f"decode shapes disagree: input_ids {input_ids_BxT.shape} (need 1 <= T <= S), positions "
                f"{positions_BxT.shape}, cache batch {B} / length {S}, kv_mask {kv_mask.shape}")
        if jnp.ndim(cache_index) not in (0, 1) or (jnp.ndim(cache_index) == 1 and jnp.shape(cache_index) != (B,)):
            raise ValueError(f"decode: cache_index must be a scalar or one index per row [B] = [{B}], "
                             f"got shape {jnp.shape(cache_index)}")
        if not isinstance(cache_index, jax.core.Tracer):
            index = np.asarray(cache_index)
            if index.size and not (0 <= index.min() and index.max() <= S - T):
                raise ValueError(f"decode: cache_index {index.tolist()} with T = {T} new tokens leaves the cache of "
                                 f"S = {S} slots (need 0 <= cache_index <= S - T = {S - T})")
        cache_index = jnp.asarray(cache_index, jnp.int32)
        arange_T = jnp.arange(T, dtype=jnp.int32)
        slot_BxT = (cache_index[:, None] if cache_index.ndim else cache_index) + arange_T  # [B or 1, T]
        causal_BxTxS = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= jnp.atleast_2d(slot_BxT)[:, :, None]
        mask_BxTxS = causal_BxTxS & kv_mask.astype(bool)[:, None, :]
        x_BxTxD = self._embed(input_ids_BxT)
        if return_routing and not c.is_moe:
            raise ValueError("decode: return_routing needs a MoE model (num_experts > 0)")
        if kv_window is not None:
            widths = tuple(kv_window[1])
            if not widths or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and T <= w <= S
                                     for w in widths):
                raise ValueError(f"decode: kv_window widths must be static ints in [T, S] = [{T}, {S}], "
                                 f"got {kv_window[1]!r}")
            if not isinstance(kv_window[0], jax.core.Tracer):
                index = np.asarray(kv_window[0])
                if index.shape != () or not 0 <= int(index) < len(widths):
                    raise ValueError(f"decode: kv_window index must be a scalar in [0, {len(widths)}), "
                                     f"got {kv_window[0]!r}")
            kv_window = (jnp.asarray(kv_window[0], jnp.int32), widths)
        layers = self.decode_layers() if layers is None else tuple(layers)
        if len(layers) != L:
            raise ValueError(f"decode: {len(layers)} layers given (decode_layers()), the model has {L}")
        ks, vs, per_layer = [], [], []
        for layer, k, v in zip(layers, cache.k, cache.v, strict=True):
            x_BxTxD, (k, v), stats = layer(x_BxTxD, positions_BxT, mask_BxTxS, (k, v), cache_index,
                                           moe_implementation=self.moe_implementation, kv_window=kv_window)
            ks.append(k)
            vs.append(v)
            per_layer.append(stats)
        out = (self._logits(x_BxTxD[:, -1:] if last_logits_only else x_BxTxD), KVCache(k=tuple(ks), v=tuple(vs)))
        if not return_routing:
            return out
        return out + (jnp.moveaxis(self._stack_layer_stats(per_layer, (B, T))[1], 0, 2),)


def init_model(config: Qwen3Config, *, seed: int = 0, dtype=jnp.float32,
               param_dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
               rules: shd.Rules | None = None, **compute_options) -> Qwen3ForCausalLM:
    """Randomly initialised ``Qwen3ForCausalLM`` from one compiled program, cached per (config, dtypes, mesh, rules)
    with the seed as argument: ``Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))`` up to rounding. With ``mesh`` every
    parameter is created on its ``NamedSharding``; ``compute_options`` go to ``set_compute_options``."""
    rules = shd.DEFAULT_RULES if rules is None else tuple(rules)
    graphdef, init_fn = _compiled_init(config, jnp.dtype(dtype), jnp.dtype(param_dtype), mesh,
                                       rules)
    model = nnx.merge(graphdef, init_fn(jnp.int32(seed)))
    return model.set_compute_options(**compute_options)


@functools.lru_cache(maxsize=16)
def _compiled_init(config, dtype, param_dtype, mesh, rules):
    def create(seed):
        return Qwen3ForCausalLM(config, rngs=nnx.Rngs(jax.random.key(seed)), dtype=dtype,
                                param_dtype=param_dtype)

    graphdef, abs_state = nnx.split(nnx.eval_shape(create, jnp.int32(0)))
    out_shardings = None if mesh is None else shd.param_shardings(abs_state, mesh, rules)
    return graphdef, jax.jit(lambda seed: nnx.state(create(seed)), out_shardings=out_shardings)


# The MoE model is the same class (the config decides the MLP); the HF name, for readers.
Qwen3MoeForCausalLM = Qwen3ForCausalLM
