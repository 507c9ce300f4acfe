"""Qwen3-MoE sparse MLP math: top-k routing, grouped expert matmuls, load-balancing loss.

Pure functions on arrays (the NNX block is ``pdm_jax.models.qwen3.SparseMoeBlock``), checked against ``transformers``
5.24 ``models/qwen3_moe/modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``, ``Qwen3MoeExperts``,
``load_balancing_loss_func``) in tests/test_models_moe.py. Axes: N tokens, D hidden, E experts, I expert width, K
experts per token, M = N*K assignments; expert kernels are stacked: gate/up ``[E, D, I]``, down ``[E, I, D]``.

``IMPLEMENTATIONS`` of the expert computation (docs/models.md; memory in docs/benchmarks.md): ``"ragged_dot"``
(default; assignments sorted by expert, ``jax.lax.ragged_dot``; XLA:CPU and XLA:GPU lower it over an E-fold expanded
input), ``"megablox"`` (the Pallas TPU ``gmm`` kernel; interpret mode elsewhere; D and I multiples of 128 on TPU),
``"blocked"`` (`blocked_gmm`: MegaBlocks' row blocks, arXiv 2211.15841, in plain XLA ops, for XLA:GPU), ``"auto"``
(megablox for TPU devices with D, I multiples of 128, blocked for GPUs, else ragged_dot) and ``"dense"`` (every
expert on every token: the reference). Under a mesh the grouped implementations run per shard (`experts_grouped`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pdm_jax import sharding as shd

Array = jax.Array

IMPLEMENTATIONS = ("ragged_dot", "megablox", "blocked", "dense", "auto")
GROUPED = ("ragged_dot", "megablox", "blocked")


def resolve_implementation(implementation: str, *, hidden_size: int, moe_intermediate_size: int) -> str:
    """``implementation`` with ``"auto"`` resolved for the devices being compiled for; ValueError naming
    ``moe_implementation`` for an unknown name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"moe_implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    if shd.target_platform() == "tpu" and hidden_size % 128 == 0 and moe_intermediate_size % 128 == 0:
        return "megablox"
    if shd.target_platform() == "gpu":
        return "blocked"
    return "ragged_dot"


def route(router_logits_NxE: Array, top_k: int, norm_topk_prob: bool
          ) -> tuple[Array, Array, Array]:
    """Top-k routing as HF ``Qwen3MoeTopKRouter``: f32 softmax over experts, the k most probable, their probabilities
    (renormalised to sum 1 when ``norm_topk_prob``).

    Args:
      router_logits_NxE: [N, E] router logits (any float dtype).
      top_k: K, experts per token.
      norm_topk_prob: divide the K weights by their sum.
    Returns:
      (weights [N, K] f32, experts [N, K] int32 in descending probability order (ties: lower index first, as
      ``torch.topk`` on CPU), probs [N, E] f32)."""
    probs_NxE = jax.nn.softmax(router_logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, top_k)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK.astype(jnp.int32), probs_NxE


def route_replayed(router_logits_NxE: Array, experts_NxK: Array, norm_topk_prob: bool
                   ) -> tuple[Array, Array, Array]:
    """Routing replay: the given experts weighted by this router's f32 softmax over them (renormalised when
    ``norm_topk_prob``), as ``route`` weights its own; gradients reach the router through the weights. A row with a
    negative id (no recorded routing: padding, the last completion token) gets ``route``'s own experts and weights.

    Args:
      router_logits_NxE: [N, E] router logits.
      experts_NxK: [N, K] int expert ids in [0, E) (ids >= E clipped; a negative id: the router's own top-k).
      norm_topk_prob: divide the K weights by their sum.
    Returns:
      (weights [N, K] f32, experts [N, K] int32, probs [N, E] f32), as ``route``."""
    probs_NxE = jax.nn.softmax(router_logits_NxE.astype(jnp.float32), axis=-1)
    experts_NxK = experts_NxK.astype(jnp.int32)
    own_NxK = jax.lax.top_k(probs_NxE, experts_NxK.shape[-1])[1].astype(jnp.int32)
    experts_NxK = jnp.where(jnp.any(experts_NxK < 0, axis=-1, keepdims=True), own_NxK, experts_NxK)
    experts_NxK = jnp.clip(experts_NxK, 0, probs_NxE.shape[-1] - 1)
    weights_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
    if norm_topk_prob:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK, probs_NxE


def _swiglu(gate: Array, up: Array) -> Array:
    return jax.nn.silu(gate) * up


def experts_dense(x_NxD: Array, weights_NxK: Array, experts_NxK: Array, gate_ExDxI: Array,
                  up_ExDxI: Array, down_ExIxD: Array, *, dtype) -> Array:
    """Reference: every expert on every token, y[n] = sum_e c[n, e] * down_e(silu(gate_e(x[n])) * up_e(x[n])), c the
    routing weights (0 outside the top-k). Matmuls in ``dtype``, the sum in f32; returns [N, D] in ``dtype``."""
    E = gate_ExDxI.shape[0]
    x = x_NxD.astype(dtype)
    h_NxExI = _swiglu(jnp.einsum("nd,edi->nei", x, gate_ExDxI.astype(dtype)),
                      jnp.einsum("nd,edi->nei", x, up_ExDxI.astype(dtype)))
    out_NxExD = jnp.einsum("nei,eid->ned", h_NxExI, down_ExIxD.astype(dtype))
    combine_NxE = jnp.sum(jax.nn.one_hot(experts_NxK, E, dtype=jnp.float32)
                          * weights_NxK[..., None], axis=1)
    return jnp.einsum("ned,ne->nd", out_NxExD.astype(jnp.float32), combine_NxE).astype(dtype)


def _megablox_gmm(lhs_MxA: Array, rhs_ExAxC: Array, group_sizes_E: Array, dtype) -> Array:
    """``megablox.gmm`` with M padded to its row tile (padded rows are in no group)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # TPU kernel (Pallas)

    M, A = lhs_MxA.shape
    C = rhs_ExAxC.shape[-1]
    interpret = shd.target_platform() != "tpu"
    if not interpret and (A % 128 or C % 128):  # Mosaic's lane width; the backward swaps A and C
        raise ValueError(f"moe_implementation 'megablox' on TPU needs hidden_size and moe_intermediate_size "
                         f"that are multiples of 128, got a [{A}, {C}] expert matmul; use 'ragged_dot'")
    tm = 128 if M >= 128 else max(8, -(-M // 8) * 8)
    pad = -M % tm
    lhs = jnp.pad(lhs_MxA, ((0, pad), (0, 0)))

    def tile(n):  # largest of 128, n itself (small test shapes) that divides n
        return 128 if n % 128 == 0 else n

    out = gmm(lhs, rhs_ExAxC.astype(dtype), group_sizes_E, preferred_element_type=dtype,
              tiling=(tm, tile(A), tile(C)), interpret=interpret)
    return out[:M]


def fresh_zeros(shape, dtype, anchor) -> Array:
    """Zeros of ``shape`` / ``dtype`` that XLA neither shares between call sites nor creates before ``anchor``.

    ``jnp.zeros`` is a broadcast of a constant: XLA merges equal ones (CSE), so the zero-initialised buffers of every
    unrolled layer (`Qwen3ForCausalLM.decode`) become copies of one broadcast, which XLA:GPU fuses into one
    multi-output fusion: all of them live at once, before the first layer runs (the rollout engine's prefill
    temporaries grew by 3.3 GiB per layer for the 30B-A3B on H100, docs/scaling.md). Broadcasting a scalar zero that
    passes through ``jax.lax.optimization_barrier`` beside ``anchor`` (any array of this call site, e.g. its input)
    makes each site's buffer its own, created where ``anchor`` is. Values: exactly zero."""
    zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), anchor))
    return jnp.broadcast_to(zero, shape)


def blocked_gmm(lhs_MxA: Array, rhs_ExAxC: Array, group_sizes_E: Array, *, block_rows: int = 128,
                blocks_per_step: int = 8) -> Array:
    """Grouped matmul over row blocks, equal to ``jax.lax.ragged_dot(lhs_MxA, rhs_ExAxC, group_sizes_E)``.

    Args:
      lhs_MxA: [M, A] rows sorted by group.
      rhs_ExAxC: [E, A, C] one kernel per group, in the dtype of ``lhs_MxA``.
      group_sizes_E: [E] int32 rows per group; rows past their sum give zeros (as in ``ragged_dot``).
      block_rows: rows per block (at most 128).
      blocks_per_step: blocks multiplied per loop step.

    Returns [M, C] in the dtype of ``lhs_MxA``. Each group is padded to whole blocks (at most ``ceil(M / b) + E``;
    the padded rows gathered from ``lhs``, zeros past a group's rows), a loop multiplies ``blocks_per_step`` blocks
    per step by their gathered kernels (recomputed in the backward) into an output buffer of the padded rows, and the
    rows are gathered back: memory and FLOPs of the padded rows, never E-fold (MegaBlocks, Gale et al. 2022, arXiv
    2211.15841). The output buffer is `fresh_zeros`: with unrolled layers XLA:GPU would otherwise create every
    layer's at once. Checked against ``ragged_dot`` (values and gradients) in tests/test_models_moe.py."""
    M, A = lhs_MxA.shape
    E, _, C = rhs_ExAxC.shape
    b = int(min(block_rows, max(8, 1 << max(0, -(-M // max(E, 1)) - 1).bit_length())))
    G = int(blocks_per_step)
    num_blocks = -(-(-(-M // b) + E) // G) * G  # static bound, rounded up to whole steps
    sizes_E = group_sizes_E.astype(jnp.int32)
    blocks_E = (sizes_E + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    row_end_E = jnp.cumsum(sizes_E)
    rows_M = jnp.arange(M, dtype=jnp.int32)
    group_M = jnp.searchsorted(row_end_E, rows_M, side="right")  # E for rows in no group
    g = jnp.minimum(group_M, E - 1)
    dest_M = (block_end_E[g] - blocks_E[g]) * b + rows_M - (row_end_E[g] - sizes_E[g])
    dest_M = jnp.where(group_M < E, dest_M, num_blocks * b)  # out of range: dropped / zero
    block_group = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(num_blocks, dtype=jnp.int32),
                                               side="right"), E - 1).astype(jnp.int32)
    # the source row of each padded row (M, out of range, for padding and for blocks past the last group's)
    padded_R = jnp.arange(num_blocks * b, dtype=jnp.int32)
    group_R = jnp.repeat(block_group, b, total_repeat_length=num_blocks * b)
    offset_R = padded_R - (block_end_E[group_R] - blocks_E[group_R]) * b
    source_R = jnp.where((offset_R < sizes_E[group_R]) & (padded_R < block_end_E[-1] * b),
                         row_end_E[group_R] - sizes_E[group_R] + offset_R, M)
    blocks_SxGxbxA = lhs_MxA.at[source_R].get(mode="fill", fill_value=0).reshape(num_blocks // G, G, b, A)
    groups_SxG = block_group.reshape(-1, G)

    @jax.checkpoint
    def step(rhs, blocks_GxbxA, groups_G):
        return jnp.einsum("gba,gac->gbc", blocks_GxbxA, rhs[groups_G])

    def body(i, out_SxGxbxC):
        return jax.lax.dynamic_update_index_in_dim(out_SxGxbxC, step(rhs_ExAxC, blocks_SxGxbxA[i], groups_SxG[i]), i, 0)

    out = jax.lax.fori_loop(0, num_blocks // G, body,
                            fresh_zeros((num_blocks // G, G, b, C), lhs_MxA.dtype, lhs_MxA))
    return out.reshape(num_blocks * b, C).at[dest_M].get(mode="fill", fill_value=0)


def experts_grouped(x_NxD: Array, weights_NxK: Array, experts_NxK: Array, gate_ExDxI: Array,
                    up_ExDxI: Array, down_ExIxD: Array, *, dtype,
                    implementation: str = "ragged_dot") -> Array:
    """The routed experts as grouped matmuls over the N*K assignments, [N, D] in ``dtype``.

    Assignments are sorted by expert (stable), each expert's rows multiplied by its kernels (``ragged_dot``, megablox
    ``gmm`` or `blocked_gmm`) and the outputs weighted and summed per token in f32: ``experts_dense`` up to rounding
    (1e-5 in f32, values and gradients). Under an active mesh the dispatch runs under ``jax.shard_map``, tokens
    sharded as ``batch`` and the kernels gathered whole in ``dtype``: each shard handles its own ``N/shards * K``
    assignments (one global sort needed 175.7 GiB of temporaries for the 30B-A3B step on 64 v5p, 16.1 GiB sharded;
    docs/scaling.md). ``blocked`` keeps the kernels' split of the expert width I over mesh axes that do not split the
    tokens (the rollout engine's ``tensor`` axis; `_split_width_axes`): each device multiplies its slice of I and the
    partial outputs are summed (``psum``, f32), as Megatron-LM splits an MLP (Shoeybi et al. 2019, arXiv 1909.08053):
    no device gathers the kernels whole or repeats another's work. Each partial output is rounded to ``dtype``
    before the sum."""
    if implementation not in GROUPED:
        raise ValueError(f"moe implementation must be one of {GROUPED} here, "
                         f"got {implementation!r}")
    kernels = tuple(w.astype(dtype) for w in (gate_ExDxI, up_ExDxI, down_ExIxD))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return _experts_grouped_local(x_NxD, weights_NxK, experts_NxK, *kernels, dtype=dtype,
                                      implementation=implementation)
    rules = shd.active_rules()
    rows = shd.logical_to_spec(("batch", None), rules, mesh, x_NxD.shape)
    width = _split_width_axes(rows, rules, mesh, gate_ExDxI.shape) if implementation == "blocked" else ()

    def local(x_NxD, weights_NxK, experts_NxK, gate_ExDxI, up_ExDxI, down_ExIxD):
        return _experts_grouped_local(x_NxD, weights_NxK, experts_NxK, gate_ExDxI, up_ExDxI,
                                      down_ExIxD, dtype=dtype, implementation=implementation, sum_axes=width)

    P = jax.sharding.PartitionSpec
    axis = width if len(width) != 1 else width[0]
    kernel_specs = (P(None, None, axis),) * 2 + (P(None, axis, None),) if width else (P(),) * 3
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows) + kernel_specs,
                            out_specs=rows, check_vma=False)
    return sharded(x_NxD, weights_NxK, experts_NxK, *kernels)


def _split_width_axes(rows, rules, mesh, gate_shape) -> tuple:
    """The mesh axes (of size > 1) that split the experts' width ``I`` (logical ``mlp``) and not the tokens (``rows``):
    the rollout engine's ``tensor`` axis. Empty where there are none (the trainer's FSDP mesh)."""
    used = {a for part in rows if part is not None for a in ((part,) if isinstance(part, str) else part)}
    spec = shd.logical_to_spec(("expert", "embed", "mlp"), rules, mesh, gate_shape)[2]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return tuple(a for a in axes if a not in used and mesh.shape[a] > 1)


def _experts_grouped_local(x_NxD: Array, weights_NxK: Array, experts_NxK: Array, gate_ExDxI: Array,
                           up_ExDxI: Array, down_ExIxD: Array, *, dtype, implementation: str,
                           sum_axes: tuple = ()) -> Array:
    """`experts_grouped` on the rows at hand (one shard's, or all of them without a mesh); with ``sum_axes`` (mesh
    axes inside ``shard_map``) the kernels hold a slice of the expert width I, and the partial outputs are summed
    over those axes in f32."""
    N, D = x_NxD.shape
    E = gate_ExDxI.shape[0]
    K = experts_NxK.shape[1]
    flat_experts_M = experts_NxK.reshape(-1)
    order_M = jnp.argsort(flat_experts_M, stable=True)
    token_M = order_M // K  # the token of each sorted assignment
    group_sizes_E = jnp.bincount(flat_experts_M, length=E).astype(jnp.int32)
    x_MxD = x_NxD.astype(dtype)[token_M]
    if implementation == "megablox":
        def gmm(lhs, rhs):
            return _megablox_gmm(lhs, rhs, group_sizes_E, dtype)
    elif implementation == "blocked":
        def gmm(lhs, rhs):
            return blocked_gmm(lhs, rhs.astype(dtype), group_sizes_E)
    else:
        def gmm(lhs, rhs):
            return jax.lax.ragged_dot(lhs, rhs.astype(dtype), group_sizes_E)
    h_MxI = _swiglu(gmm(x_MxD, gate_ExDxI), gmm(x_MxD, up_ExDxI))
    out_MxD = gmm(h_MxI, down_ExIxD).astype(jnp.float32)
    weighted_MxD = out_MxD * weights_NxK.reshape(-1)[order_M][:, None]
    # blocked (XLA:GPU, unrolled decode layers): its own zeros per layer (`fresh_zeros`); the sum is the same
    zeros_NxD = (fresh_zeros((N, D), jnp.float32, x_NxD) if implementation == "blocked"
                 else jnp.zeros((N, D), jnp.float32))
    y_NxD = zeros_NxD.at[token_M].add(weighted_MxD)
    if sum_axes:
        y_NxD = jax.lax.psum(y_NxD, sum_axes)
    return y_NxD.astype(dtype)


def experts(x_NxD: Array, weights_NxK: Array, experts_NxK: Array, gate_ExDxI: Array,
            up_ExDxI: Array, down_ExIxD: Array, *, dtype, implementation: str) -> Array:
    """Dispatches to ``experts_dense`` or ``experts_grouped`` by ``implementation`` (``"auto"`` resolved by
    `resolve_implementation`); ValueError naming ``implementation`` when it is not in ``IMPLEMENTATIONS``."""
    implementation = resolve_implementation(implementation, hidden_size=x_NxD.shape[-1],
                                            moe_intermediate_size=gate_ExDxI.shape[-1])
    args = (x_NxD, weights_NxK, experts_NxK, gate_ExDxI, up_ExDxI, down_ExIxD)
    if implementation == "dense":
        return experts_dense(*args, dtype=dtype)
    return experts_grouped(*args, dtype=dtype, implementation=implementation)


def load_balancing_stats(probs_NxE: Array, experts_NxK: Array,
                         token_weight_N: Array | None = None) -> tuple[Array, Array, Array]:
    """One layer's sums for ``load_balancing_loss``.

    Args:
      probs_NxE: [N, E] f32 router softmax.
      experts_NxK: [N, K] int selected experts.
      token_weight_N: [N] row weights (HF: the attention mask), or None (every row counts 1).
    Returns:
      (assignments [E] f32 weighted top-k selections per expert, prob_sum [E] f32 weighted router probabilities per
      expert, rows: scalar f32 weighted row count)."""
    N, E = probs_NxE.shape
    w_N = jnp.ones((N,), jnp.float32) if token_weight_N is None else \
        jnp.asarray(token_weight_N, jnp.float32).reshape(N)
    one_hot_NxKxE = jax.nn.one_hot(experts_NxK, E, dtype=jnp.float32)
    assignments_E = jnp.einsum("nke,n->e", one_hot_NxKxE, w_N)
    prob_sum_E = jnp.einsum("ne,n->e", probs_NxE.astype(jnp.float32), w_N)
    return assignments_E, prob_sum_E, jnp.sum(w_N)


def load_balancing_loss(assignments_E: Array, prob_sum_E: Array, rows: Array) -> Array:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6) as transformers'
    ``load_balancing_loss_func`` (Qwen3-MoE), a scalar f32 (unscaled; the loss adds ``router_aux_loss_coef`` times
    it).

    With ``load_balancing_stats`` summed over the MoE layers: ``E * sum_e (assignments[e] / rows) * (prob_sum[e] /
    rows)``; not divided by K (HF's convention), so a balanced router gives K."""
    E = assignments_E.shape[-1]
    rows = jnp.maximum(rows, 1e-9)  # all-padding batch: 0 instead of NaN
    return E * jnp.sum((assignments_E / rows) * (prob_sum_E / rows))


__all__ = ["IMPLEMENTATIONS", "experts", "experts_dense", "experts_grouped",
           "load_balancing_loss", "load_balancing_stats", "route"]
