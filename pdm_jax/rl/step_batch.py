"""`StepBatch`: the input of a jitted train step, a JAX pytree of named, shaped fields.

The same per-token fields as `pdm_jax.rollout.RolloutBatch` padded to static lengths, plus advantages (and reference
logprobs for a KL penalty), built once from a `RolloutBatch` by :meth:`StepBatch.from_rollouts`. A ``flax.struct``
dataclass, so it is jitted, sharded and ``device_get`` as a whole, and chunking and micro-batching map over one pytree.
"""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from pdm_jax.rollout import ROUTING_PAD, RolloutBatch, pad_axis


@flax.struct.dataclass
class StepBatch:
    """The input of a jitted train step (``pdm_jax.rl.train_step``): named, shaped fields, a JAX pytree.

    B sequences, P prompt length, T completion length, K top-K. Host (numpy) or device (``jax.Array``) leaves; RL-only
    fields are None in a supervised (SFT) batch.

    =================  ============  ========  ==========================================
    field              shape         dtype     meaning
    =================  ============  ========  ==========================================
    prompt_ids         [B, P]        int32     left-padded prompts
    prompt_mask        [B, P]        bool      True on real prompt tokens
    completion_ids     [B, T]        int32     right-padded completions (the tokens y_t)
    completion_mask    [B, T]        bool      valid completion tokens (stop token included)
    behavior_logprobs  [B, T]        float32   log mu(y_t) from the sampler (RL)
    topk_ids           [B, T, K]     int32     the sampler's top-K ids (RL)
    topk_logprobs      [B, T, K]     float32   their log mu (RL)
    advantages         [B]           float32   group-relative advantages (RL)
    weights_version    [B]           int32     sampler version of each row; the step ignores it,
                                               callbacks (the token-level analysis) read it
    ref_logprobs       [B, T]        float32   log pi_ref(y_t), only when rl.kl_beta > 0
    routed_experts     [B, P+T,      int8/16/  the sampler's experts per token and layer, only
                       L, k]         32        with model.moe_routing_replay (-1: own top-k)
    packing            PackingPlan   int32/    with rl.pack_sequences: where each token goes in
                       ([N, L])      bool      the packed rows (``pdm_jax.rl.packing``); None: padded
    =================  ============  ========  ==========================================
    """

    prompt_ids: object
    prompt_mask: object
    completion_ids: object
    completion_mask: object
    behavior_logprobs: object = None
    topk_ids: object = None
    topk_logprobs: object = None
    advantages: object = None
    weights_version: object = None
    ref_logprobs: object = None
    routed_experts: object = None
    packing: object = None

    @classmethod
    def from_rollouts(cls, rb: RolloutBatch, advantages, *, prompt_len: int, completion_len: int,
                      routing: bool = False) -> "StepBatch":
        """Host step batch of a (scored) rollout batch, padded to static lengths.

        Args:
          rb: the rollouts (N sequences).
          advantages: ``[N]`` float32 group advantages.
          prompt_len: P >= the rollouts' prompt length (prompts are left-padded).
          completion_len: T >= the rollouts' completion length (right-padded).
          routing: carry ``rb.routed_experts`` (routing replay), its prompt columns left-padded
            to P and completion columns right-padded to T with `ROUTING_PAD`.

        Raises:
          ValueError: a length shorter than the rollouts', advantages not ``[N]``, or ``routing``
            with rollouts that have no ``routed_experts``.
        """
        advantages = np.asarray(advantages, np.float32)
        if advantages.shape != (rb.num_sequences,):
            raise ValueError(f"advantages has shape {advantages.shape}, expected ({rb.num_sequences},)")
        t = completion_len
        routed = None
        if routing:
            if rb.routed_experts is None:
                raise ValueError("routing replay needs rollouts with routed_experts (sampled with return_routing)")
            pb = rb.prompt_ids.shape[1]
            routed = np.concatenate([pad_axis(rb.routed_experts[:, :pb], prompt_len, 1, left=True, value=ROUTING_PAD),
                                     pad_axis(rb.routed_experts[:, pb:], t, 1, value=ROUTING_PAD)], axis=1)
        return cls(
            prompt_ids=pad_axis(rb.prompt_ids, prompt_len, 1, left=True),
            prompt_mask=pad_axis(rb.prompt_mask, prompt_len, 1, left=True, value=False),
            completion_ids=pad_axis(rb.completion_ids, t, 1),
            completion_mask=pad_axis(rb.completion_mask, t, 1, value=False),
            behavior_logprobs=pad_axis(rb.behavior_logprobs, t, 1),
            topk_ids=pad_axis(rb.topk_ids, t, 1),
            topk_logprobs=pad_axis(rb.topk_logprobs, t, 1),
            advantages=advantages,
            weights_version=np.asarray(rb.weights_version, np.int32),
            routed_experts=routed,
        )

    @property
    def num_sequences(self) -> int:
        """B, the number of rows."""
        return int(self.completion_ids.shape[0])

    def select(self, rows) -> "StepBatch":
        """The rows ``rows`` (an index array or slice) of every field (host arrays) of an unpacked batch.

        Raises:
          ValueError: the batch carries a packing plan (it indexes the rows it was planned for).
        """
        if self.packing is not None:
            raise ValueError("StepBatch.select on a packed batch: plan the packing of the selected rows instead")
        return jax.tree.map(lambda x: x[rows], self)
