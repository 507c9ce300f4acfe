"""pdm_jax.rl: the pure policy update (docs/DESIGN.md §3).

trust_region  the masks: proximity (binary / top-K TV / KL vs delta) and direction (ratio, PDM estimators)
objectives    per-token policy-gradient objectives and their aggregation
loss          token_terms (mask, ratios, per-token loss) and loss_and_metrics
chunked_loss  the same terms over chunks of sequence positions (never all [B, T, V] logits)
forward       the one forward of the update (prompt + completion; packed rows)
packing       sequence packing: the host plan (plan_packing) and the in-step gathers
step_batch    StepBatch, the train step's input pytree
train_step    make_rl_train_step / make_sft_train_step: jitted, sharded, functional

These modules import jax, optax, flax, the models and each other, and
``pdm_jax.rollout`` (the numpy contract) only: no I/O, HTTP, orbax or config module (tests/test_structure.py).
"""
