"""Causal self-attention kernels for the Qwen3 training forward: dense reference, blockwise, cuDNN, splash.

Per query head ``n = k * G + g`` (GQA), ``out[b, t] = sum_s softmax_s(q[b, t] . k[b, s] / sqrt(H)) v[b, s]`` over
keys ``s <= t`` that are real tokens (``key_valid``) of the same segment (packed sequences never attend across). A
real query always sees itself, so its row is exact everywhere; a padding query gets a finite, implementation-specific
output that nothing reads. ``AttentionOptions.implementation``:

* ``dense``: the reference; ``[B, K, G, T, S]`` f32 scores per layer.
* ``blockwise``: online-softmax attention in plain JAX (Rabe & Staats 2021, arXiv:2112.05682; FlashAttention-2,
  arXiv:2307.08691, Alg. 1-2), tiles above the diagonal skipped, a ``jax.custom_vjp`` backward from the saved
  log-sum-exp: memory linear in T, every backend.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA, bf16/f16); padding and segments as one
  ``[B, 1, T, S]`` bool mask.
* ``splash``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPU); padding is a segment of its own.
* ``auto``: ``dense`` for ``T <= AUTO_DENSE_MAX_LENGTH``, else ``splash`` on TPU, ``cudnn`` on GPU (bf16/f16, ``H`` a
  multiple of 8 up to 256), else ``blockwise``, by the platform compiled for (`pdm_jax.sharding.target_platform`).

Shapes follow ``pdm_jax.models.qwen3``: q ``[B, T, K, G, H]``, k and v ``[B, T, K, H]``."""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Pallas splash attention (TPU kernel, also runs in interpret mode on CPU for tests).
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from pdm_jax import sharding as shd

Array = jax.Array

IMPLEMENTATIONS = ("dense", "blockwise", "cudnn", "splash", "auto")
AUTO_DENSE_MAX_LENGTH = 512
# The score of a masked pair: finite, so that a row with no allowed key stays NaN-free (same fill as the dense
# reference; exp(_FILL - m) == 0 for any real max m).
_FILL = float(np.finfo(np.float32).min)
_SPLASH_LANES = 128  # splash block sizes must be multiples of the TPU lane width


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Which attention kernel the training forward uses, and its tiles.

    Attributes:
      implementation: one of ``IMPLEMENTATIONS``.
      block_q, block_kv: query / key tile lengths (tokens) of ``blockwise`` and ``splash`` (splash rounds up to a
        multiple of 128); tiles longer than T shrink to T.

    Raises:
      ValueError: naming the field and the value for an unknown implementation or a block size that is not a positive
        int."""

    implementation: str = "dense"
    block_q: int = 512
    block_kv: int = 512

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"attention {name} must be a positive int, got {value!r}")


@flax.struct.dataclass
class SelfAttentionMask:
    """Who may attend to whom in causal self-attention over a ``[B, T]`` batch: query ``t`` attends to key ``s`` iff ``s
    <= t``, ``key_valid[b, s]`` and ``segment_ids[b, t] == segment_ids[b, s]``.

    Attributes:
      key_valid: ``[B, T]`` bool, True for real tokens (the model's ``attention_mask``), or None (all real).
      segment_ids: ``[B, T]`` int segment of each token, or None (one segment per row)."""

    key_valid: Array | None = None
    segment_ids: Array | None = None

    def dense(self, batch: int, length: int) -> Array:
        """The ``[B, T, T]`` bool mask (the dense reference's input)."""
        causal_TxS = jnp.tril(jnp.ones((length, length), dtype=bool))
        if self.key_valid is None:
            mask_BxTxS = jnp.broadcast_to(causal_TxS, (batch, length, length))
        else:
            mask_BxTxS = causal_TxS[None] & self.key_valid.astype(bool)[:, None, :]
        if self.segment_ids is not None:
            seg_BxT = self.segment_ids
            mask_BxTxS = mask_BxTxS & (seg_BxT[:, :, None] == seg_BxT[:, None, :])
        return mask_BxTxS


def resolve_implementation(implementation: str, *, length: int, dtype, head_dim: int) -> str:
    """The concrete kernel for ``implementation`` (``auto`` resolved); ValueError for an unknown name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if implementation != "auto":
        return implementation
    if length <= AUTO_DENSE_MAX_LENGTH:
        return "dense"
    backend = shd.target_platform()
    if backend == "tpu":
        return "splash"
    if (backend == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 8 == 0 and head_dim <= 256):
        return "cudnn"
    return "blockwise"


def self_attention(q_BxTxKxGxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                   mask: SelfAttentionMask, options: AttentionOptions, *, dtype) -> Array:
    """Causal GQA self-attention with the kernel ``options`` selects.

    Args:
      q_BxTxKxGxH: rotated queries; k_BxTxKxH, v_BxTxKxH: rotated keys and values (compute dtype).
      mask: ``SelfAttentionMask`` (padding and segments; causality is implied).
      options: ``AttentionOptions``.
      dtype: compute dtype (probabilities are cast to it before ``probs @ v``).
    Returns:
      ``[B, T, K, G, H]`` in ``dtype``.
    Raises:
      ValueError: a kernel selected on a backend that lacks it, or given a dtype/shape it does not support (naming
        the option and the value)."""
    B, T, _, _, H = q_BxTxKxGxH.shape
    impl = resolve_implementation(options.implementation, length=T, dtype=dtype, head_dim=H)
    if impl == "dense":
        return dense_attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask.dense(B, T), dtype=dtype)
    if impl == "blockwise":
        return blockwise_attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask,
                                   block_q=options.block_q, block_kv=options.block_kv).astype(dtype)
    if impl == "cudnn":
        return cudnn_attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask).astype(dtype)
    return splash_attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, mask, block_q=options.block_q,
                            block_kv=options.block_kv).astype(dtype)


# ---- dense (reference) -----------------------------------------------------------------------------------


def dense_attention(q_BxTxKxGxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, mask_BxTxS: Array,
                    *, dtype) -> Array:
    """The reference: full ``[B, K, G, T, S]`` f32 scores, softmax, ``probs @ v``.

    Args:
      q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH: compute dtype.
      mask_BxTxS: bool, which keys each query may see (causality included).
      dtype: the probabilities are cast to it before ``probs @ v``.
    Returns:
      ``[B, T, K, G, H]`` (dtype of ``probs @ v``); a row with no allowed key averages all values (finite,
      meaningless)."""
    H = q_BxTxKxGxH.shape[-1]
    # A finite fill keeps fully masked rows (pure padding queries) NaN-free.
    fill = jnp.finfo(jnp.float32).min
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                  preferred_element_type=jnp.float32) * H ** -0.5
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None, :, :], scores_BxKxGxTxS, fill)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH)


# ---- blockwise (online softmax, custom VJP) --------------------------------------------------------------


def blockwise_attention(q_BxTxKxGxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                        mask: SelfAttentionMask, *, block_q: int = 512,
                        block_kv: int = 512) -> Array:
    """Online-softmax causal attention whose forward and backward memory grow linearly in T.

    Args:
      q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH: any float dtype (scores, statistics and ``p @ v`` accumulate in f32).
      mask: ``SelfAttentionMask``.
      block_q, block_kv: tile lengths; T is zero-padded to a multiple of each (padded keys masked, padded queries
        dropped); tiles longer than T shrink to T.
    Returns:
      ``[B, T, K, G, H]`` in q's dtype; work on key tiles at or below the diagonal only, one ``[B, K, G, block_q,
      block_kv]`` f32 tile live per step.
    Raises:
      ValueError: non-positive block sizes, or key/value shapes that do not match q."""
    B, T, K, _, H = q_BxTxKxGxH.shape
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"blockwise_attention: {name} must be a positive int, got {value!r}")
    if k_BxTxKxH.shape != (B, T, K, H) or v_BxTxKxH.shape != (B, T, K, H):
        raise ValueError(f"blockwise_attention: k {k_BxTxKxH.shape} and v {v_BxTxKxH.shape} must be "
                         f"[B,T,K,H] = {(B, T, K, H)} for q {q_BxTxKxGxH.shape}")
    bq, bkv = min(block_q, T), min(block_kv, T)
    Tq, Tk = -(-T // bq) * bq, -(-T // bkv) * bkv
    valid_BxT = (jnp.ones((B, T), bool) if mask.key_valid is None
                 else jnp.asarray(mask.key_valid).astype(bool))
    seg_BxT = (jnp.zeros((B, T), jnp.int32) if mask.segment_ids is None
               else jnp.asarray(mask.segment_ids).astype(jnp.int32))

    def pad(x, length):
        return jnp.pad(x, [(0, 0), (0, length - T)] + [(0, 0)] * (x.ndim - 2))

    out = _flash(bq, bkv, pad(q_BxTxKxGxH, Tq), pad(k_BxTxKxH, Tk), pad(v_BxTxKxH, Tk),
                 pad(valid_BxT, Tk), pad(seg_BxT, Tq), pad(seg_BxT, Tk))
    return out[:, :T]


def _tile_scores(q_i, k_j, i, j, bq, bkv, valid, q_seg, k_seg):
    """Masked f32 scores ``[B, K, G, bq, bkv]`` of query tile i against key tile j."""
    H = q_i.shape[-1]
    q_idx = i * bq + jnp.arange(bq)
    k_idx = j * bkv + jnp.arange(bkv)
    valid_j = lax.dynamic_slice_in_dim(valid, j * bkv, bkv, axis=1)
    q_seg_i = lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1)
    k_seg_j = lax.dynamic_slice_in_dim(k_seg, j * bkv, bkv, axis=1)
    allowed_BxQxS = ((q_idx[:, None] >= k_idx[None, :])[None] & valid_j[:, None, :]
                     & (q_seg_i[:, :, None] == k_seg_j[:, None, :]))
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * H ** -0.5
    return jnp.where(allowed_BxQxS[:, None, None], s, _FILL)


def _num_kv_tiles(i, bq, bkv, nk):
    """Key tiles 0 .. n-1 hold every key at or below query tile i's last row."""
    return jnp.minimum(((i + 1) * bq - 1) // bkv + 1, nk)


def _flash_forward(bq, bkv, q, k, v, valid, q_seg, k_seg):
    """(out [B,Tq,K,G,H] in q's dtype, lse [B,K,G,Tq] f32)."""
    B, Tq, K, G, H = q.shape
    nq, nk = Tq // bq, k.shape[1] // bkv

    def q_tile(i):
        q_i = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)

        def kv_step(j, carry):
            m, denom, acc = carry
            k_j = lax.dynamic_slice_in_dim(k, j * bkv, bkv, axis=1)
            v_j = lax.dynamic_slice_in_dim(v, j * bkv, bkv, axis=1)
            s = _tile_scores(q_i, k_j, i, j, bq, bkv, valid, q_seg, k_seg)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            denom = alpha * denom + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, denom, alpha[..., None] * acc + pv

        init = (jnp.full((B, K, G, bq), _FILL, jnp.float32), jnp.zeros((B, K, G, bq), jnp.float32),
                jnp.zeros((B, K, G, bq, H), jnp.float32))
        m, denom, acc = lax.fori_loop(0, _num_kv_tiles(i, bq, bkv, nk), kv_step, init)
        # denom >= 1: the row's maximum contributes exp(0).
        return (acc / denom[..., None]).astype(q.dtype), m + jnp.log(denom)

    out_QxBxKxGxbxH, lse_QxBxKxGxb = lax.map(q_tile, jnp.arange(nq))
    out = out_QxBxKxGxbxH.transpose(1, 0, 4, 2, 3, 5).reshape(B, Tq, K, G, H)
    lse = lse_QxBxKxGxb.transpose(1, 2, 3, 0, 4).reshape(B, K, G, Tq)
    return out, lse


def _flash_backward(bq, bkv, res, dout):
    """FlashAttention-2 backward: key tiles outer (dK, dV), query tiles inner, dQ accumulated."""
    q, k, v, valid, q_seg, k_seg, out, lse = res
    B, Tq, K, _, H = q.shape
    nq, nk = Tq // bq, k.shape[1] // bkv
    scale = H ** -0.5
    delta = jnp.einsum("btkgh,btkgh->bkgt", dout.astype(jnp.float32), out.astype(jnp.float32))

    def kv_tile(dq, j):
        k_j = lax.dynamic_slice_in_dim(k, j * bkv, bkv, axis=1)
        v_j = lax.dynamic_slice_in_dim(v, j * bkv, bkv, axis=1)

        def q_step(i, carry):
            dq, dk_j, dv_j = carry
            q_i = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
            do_i = lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            s = _tile_scores(q_i, k_j, i, j, bq, bkv, valid, q_seg, k_seg)
            p = jnp.exp(s - lse_i[..., None])
            dv_j = dv_j + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(dout.dtype), do_i,
                                     preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * scale
            dk_j = dk_j + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q.dtype), q_i,
                                     preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k.dtype), k_j,
                              preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + dq_i, i * bq, axis=1)
            return dq, dk_j, dv_j

        zeros = jnp.zeros((B, bkv, K, H), jnp.float32)
        # Query tiles from the first one that reaches key tile j (the forward's pairs).
        dq, dk_j, dv_j = lax.fori_loop((j * bkv) // bq, nq, q_step, (dq, zeros, zeros))
        return dq, (dk_j, dv_j)

    dq, (dk_NxBxbxKxH, dv_NxBxbxKxH) = lax.scan(kv_tile, jnp.zeros(q.shape, jnp.float32),
                                                jnp.arange(nk))
    dk = dk_NxBxbxKxH.transpose(1, 0, 2, 3, 4).reshape(k.shape)
    dv = dv_NxBxbxKxH.transpose(1, 0, 2, 3, 4).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(bq, bkv, q, k, v, valid, q_seg, k_seg):
    return _flash_forward(bq, bkv, q, k, v, valid, q_seg, k_seg)[0]


def _flash_fwd_rule(bq, bkv, q, k, v, valid, q_seg, k_seg):
    out, lse = _flash_forward(bq, bkv, q, k, v, valid, q_seg, k_seg)
    return out, (q, k, v, valid, q_seg, k_seg, out, lse)


_flash.defvjp(_flash_fwd_rule, _flash_backward)


# ---- cuDNN (GPU) and splash (TPU) ------------------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _require_backend(implementation: str, backend: str, hardware: str) -> None:
    """Refuses a kernel traced for another platform than its own: the platform of the devices the program is compiled
    for (`pdm_jax.sharding.target_platform`: the active mesh's, else the default backend)."""
    found = shd.target_platform()
    if found != backend:
        raise ValueError(
            f"attention implementation {implementation!r} needs {hardware} (platform {backend!r}), "
            f"but the program is compiled for platform {found!r} (the active mesh's devices, else "
            "jax.default_backend()); use 'blockwise' (every backend) or 'auto'")


def cudnn_attention(q_BxTxKxGxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                    mask: SelfAttentionMask) -> Array:
    """cuDNN flash attention via ``jax.nn.dot_product_attention(implementation="cudnn")``.

    Args:
      q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH: bfloat16 or float16.
      mask: ``SelfAttentionMask``; padding or segments become a ``[B, 1, T, S]`` bool mask, else only the causal
        mask.
    Returns:
      ``[B, T, K, G, H]`` in q's dtype.
    Raises:
      ValueError: not on a GPU backend, or a float32 compute dtype (use bfloat16 or 'blockwise')."""
    _require_backend("cudnn", "gpu", "an NVIDIA GPU with cuDNN")
    if q_BxTxKxGxH.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError("attention implementation 'cudnn' needs a bfloat16 or float16 compute "
                         f"dtype (model dtype), got {q_BxTxKxGxH.dtype}; use 'blockwise' for float32")
    B, T, K, G, H = q_BxTxKxGxH.shape
    mask_Bx1xTxS = None
    if mask.key_valid is not None or mask.segment_ids is not None:
        ones = jnp.ones((B, T), bool)
        valid_BxT = ones if mask.key_valid is None else jnp.asarray(mask.key_valid).astype(bool)
        allowed_BxTxS = jnp.broadcast_to(valid_BxT[:, None, :], (B, T, T))
        if mask.segment_ids is not None:
            seg_BxT = jnp.asarray(mask.segment_ids)
            allowed_BxTxS = allowed_BxTxS & (seg_BxT[:, :, None] == seg_BxT[:, None, :])
        mask_Bx1xTxS = allowed_BxTxS[:, None]
    out_BxTxNxH = jax.nn.dot_product_attention(
        q_BxTxKxGxH.reshape(B, T, K * G, H), k_BxTxKxH, v_BxTxKxH, mask=mask_Bx1xTxS,
        is_causal=True, implementation="cudnn")
    return out_BxTxNxH.reshape(B, T, K, G, H)


def _splash_kernel(num_heads: int, length: int, block_q: int, block_kv: int, interpret: bool):
    """A causal ``splash`` kernel for one row ([N, T, H] queries, [K, T, H] keys), built inside the trace so its
    block-sparsity tables are program constants and the program compiles ahead of time without a TPU (`pdm_jax.aot`)."""
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * num_heads)
    sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                              block_q_dkv=block_q, block_kv_dkv=block_kv,
                              block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                              block_kv_dq=block_kv)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_attention(q_BxTxKxGxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                     mask: SelfAttentionMask, *, block_q: int = 512, block_kv: int = 512,
                     interpret: bool = False) -> Array:
    """Pallas splash attention (TPU): causal block sparsity, segment ids, GQA.

    A real token of segment ``s`` gets id ``2 s``, every padded token ``-1`` (real queries never see padded keys, no
    row is empty); T is padded to the tiles. Under an active mesh the kernel runs under ``jax.shard_map``, batch and
    heads sharded by the logical rules (heads replicated when query and key/value heads would split differently).

    Args:
      q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH: compute dtype.
      mask: ``SelfAttentionMask``.
      block_q, block_kv: tile lengths, rounded up to multiples of 128, at most padded T.
      interpret: Pallas interpret mode (any backend; slow; for tests).
    Returns:
      ``[B, T, K, G, H]`` in q's dtype.
    Raises:
      ValueError: not on a TPU backend (unless ``interpret``)."""
    if not interpret:
        _require_backend("splash", "tpu", "a TPU")
    B, T, K, G, H = q_BxTxKxGxH.shape
    t128 = _round_up(T, _SPLASH_LANES)
    bq = min(_round_up(block_q, _SPLASH_LANES), t128)
    bkv = min(_round_up(block_kv, _SPLASH_LANES), t128)
    Tp = _round_up(T, int(np.lcm(bq, bkv)))
    valid_BxT = (jnp.ones((B, T), bool) if mask.key_valid is None
                 else jnp.asarray(mask.key_valid).astype(bool))
    seg_BxT = (jnp.zeros((B, T), jnp.int32) if mask.segment_ids is None
               else jnp.asarray(mask.segment_ids).astype(jnp.int32))
    seg_BxT = jnp.pad(jnp.where(valid_BxT, 2 * seg_BxT, -1), ((0, 0), (0, Tp - T)),
                      constant_values=-1)
    pad = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
    # splash takes unscaled scores: scale the queries by 1/sqrt(H).
    q_BxNxTxH = jnp.pad((q_BxTxKxGxH * H ** -0.5).astype(q_BxTxKxGxH.dtype)
                        .reshape(B, T, K * G, H).transpose(0, 2, 1, 3), pad)
    k_BxKxTxH = jnp.pad(k_BxTxKxH.transpose(0, 2, 1, 3), pad)
    v_BxKxTxH = jnp.pad(v_BxTxKxH.transpose(0, 2, 1, 3), pad)

    def rows(q, k, v, seg):
        kernel = _splash_kernel(q.shape[1], Tp, bq, bkv, interpret)
        return jax.vmap(kernel)(q, k, v, splash.SegmentIds(q=seg, kv=seg))

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        rules = shd.active_rules()
        q_spec = shd.logical_to_spec(("batch", "heads", None, None), rules, mesh, q_BxNxTxH.shape)
        kv_spec = shd.logical_to_spec(("batch", "kv_heads", None, None), rules, mesh,
                                      k_BxKxTxH.shape)
        if q_spec[1] != kv_spec[1]:  # heads would not split along kv-head groups
            q_spec = jax.sharding.PartitionSpec(q_spec[0], None, None, None)
            kv_spec = jax.sharding.PartitionSpec(q_spec[0], None, None, None)
        seg_spec = jax.sharding.PartitionSpec(q_spec[0], None)
        rows = jax.shard_map(rows, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                             out_specs=q_spec, check_vma=False)
    out_BxNxTxH = rows(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, seg_BxT)
    return out_BxNxTxH[:, :, :T].transpose(0, 2, 1, 3).reshape(B, T, K, G, H)
