"""rl.pack_sequences: the packing plan places every token once, and the packed step is the padded step.

The padded step (`pdm_jax.rl.train_step.make_rl_train_step` without packing) is the reference: the packed
step's loss, every metric and its gradient (one SGD step) must equal it to 1e-5 in f32.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import assert_same_step
from pdm_jax.models import Qwen3Config
from pdm_jax.models.qwen3 import init_model
from pdm_jax.rl import objectives, packing, train_step as ts, trust_region
from pdm_jax.rl.loss import PolicyLossConfig
from pdm_jax.rl.step_batch import StepBatch

CFG = Qwen3Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
TAU = 0.7
PROMPT_LENS = np.array([4, 2, 3, 1, 2, 4])
COMPLETION_LENS = np.array([5, 3, 1, 4, 0, 2])  # row 4 has no valid token: it carries no loss and is not packed
P, T, K = 4, 5, 3


def _masks():
    prompt_mask = np.arange(P)[None, :] >= (P - PROMPT_LENS)[:, None]
    completion_mask = np.arange(T)[None, :] < COMPLETION_LENS[:, None]
    return prompt_mask, completion_mask


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(init_model(CFG, seed=0))  # one compiled init, not dozens of eager programs
    rng = np.random.default_rng(0)
    B = len(PROMPT_LENS)
    prompt_mask, completion_mask = _masks()
    batch = StepBatch(
        prompt_ids=np.where(prompt_mask, rng.integers(0, 12, (B, P)), 0).astype(np.int32),
        prompt_mask=prompt_mask,
        completion_ids=np.where(completion_mask, rng.integers(0, 12, (B, T)), 0).astype(np.int32),
        completion_mask=completion_mask,
        advantages=np.array([1.0, -0.5, 0.25, -1.0, 0.5, 0.75], np.float32),
    )

    @jax.jit  # one program (op by op, the forward built a hundred)
    def behavior_and_top_k(params, prompt_ids, prompt_mask, completion_ids, completion_mask):
        logits = ts.completion_logits(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask) / TAU
        logp = jax.nn.log_softmax(logits, -1)
        top_lp, top_ids = jax.lax.top_k(logp, K)
        return jnp.take_along_axis(logp, completion_ids[..., None], -1)[..., 0], top_lp, top_ids

    behavior, top_lp, top_ids = behavior_and_top_k(params, batch.prompt_ids, batch.prompt_mask,
                                                   batch.completion_ids, batch.completion_mask)
    behavior = np.asarray(behavior)
    # Off-policy (some tokens out of the region, so the mask matters) and a reference policy for the KL term.
    batch = batch.replace(behavior_logprobs=behavior - 0.7, topk_ids=np.asarray(top_ids),
                          topk_logprobs=np.asarray(top_lp) - 0.7, ref_logprobs=behavior - 0.3)
    return graphdef, params, batch


def test_the_plan_places_every_valid_token_once_in_order_and_segments_restart():
    prompt_mask, completion_mask = _masks()
    plan = packing.plan_packing(prompt_mask, completion_mask, row_length=P + T)
    n_tokens = int((PROMPT_LENS + COMPLETION_LENS)[COMPLETION_LENS > 0].sum())
    assert int(plan.token_mask.sum()) == n_tokens  # every real token of the packed sequences, no other
    rows = plan.token_mask.shape[0]
    assert rows & (rows - 1) == 0 and rows * (P + T) >= n_tokens  # one micro-batch: a power of two rows
    assert plan.token_mask.shape[0] < len(PROMPT_LENS)  # it packs: fewer rows than sequences
    # Each packed sequence: one contiguous run of its own segment id holding its columns in order.
    for b in np.flatnonzero(COMPLETION_LENS > 0):
        where = np.argwhere(plan.token_mask & (plan.src_row == b))
        r = set(where[:, 0])
        assert len(r) == 1
        cols = plan.src_col[plan.token_mask & (plan.src_row == b)]
        want = np.concatenate([np.arange(P - PROMPT_LENS[b], P), P + np.arange(COMPLETION_LENS[b])])
        np.testing.assert_array_equal(cols, want)
        seg = plan.segment_ids[plan.token_mask & (plan.src_row == b)]
        assert len(set(seg)) == 1 and seg[0] >= 1
    assert not np.any(plan.src_row[plan.token_mask] == 4)  # the empty completion is left out
    # unpack_index: completion token t of b is predicted by the position holding its previous token.
    flat_col, flat_tgt = plan.src_col.reshape(-1), plan.target_col.reshape(-1)
    for b in range(len(PROMPT_LENS)):
        for t in range(COMPLETION_LENS[b]):
            i = plan.unpack_index[b, t]
            assert plan.target_mask.reshape(-1)[i] and flat_tgt[i] == t
            assert flat_col[i] == P + t - 1  # the last prompt token (column P - 1) predicts token 0
    assert int(plan.target_mask.sum()) == int(COMPLETION_LENS.sum())


def test_micro_batches_hold_the_rows_round_robin_and_the_count_is_what_the_batch_needs():
    prompt_mask, completion_mask = _masks()
    plan = packing.plan_packing(prompt_mask, completion_mask, row_length=P + T, rows_per_micro_batch=1)
    assert plan.num_micro_batches == plan.token_mask.shape[0] == int(np.any(plan.token_mask, axis=1).sum())
    fills = plan.token_mask.sum(axis=1)
    assert list(fills) == sorted(fills, reverse=True)  # fullest first
    with pytest.raises(ValueError, match="rl.micro_batch_size = 3 .* multiple of the 2 batch shards"):
        packing.plan_packing(prompt_mask, completion_mask, row_length=P + T, rows_per_micro_batch=3, row_multiple=2)
    plan = packing.plan_packing(prompt_mask, completion_mask, row_length=P + T, row_multiple=8)
    assert plan.token_mask.shape[0] == 8  # the power of two, rounded up to the batch shards


def test_bad_plans_are_refused_naming_the_field():
    prompt_mask, completion_mask = _masks()
    with pytest.raises(ValueError, match=r"rl.packed_length = 8 is shorter than sequence 0 \(4 prompt \+ 5"):
        packing.plan_packing(prompt_mask, completion_mask, row_length=8)
    holes = completion_mask.copy()
    holes[0, 1] = False
    with pytest.raises(ValueError, match="completion_mask of row 0 is not right-padded"):
        packing.plan_packing(prompt_mask, holes, row_length=16)
    right = prompt_mask[:, ::-1]
    with pytest.raises(ValueError, match="prompt_mask of row 1 is not left-padded"):
        packing.plan_packing(right, completion_mask, row_length=16)
    empty = prompt_mask.copy()
    empty[3] = False
    with pytest.raises(ValueError, match="sequence 3 has completion tokens but an empty prompt_mask"):
        packing.plan_packing(empty, completion_mask, row_length=16)
    with pytest.raises(ValueError, match="completion_mask must be a bool .* got dtype float64"):
        packing.plan_packing(prompt_mask, np.where(completion_mask, 1.0, np.nan), row_length=16)
    assert packing.plan_packing(prompt_mask.astype(np.int32), completion_mask.astype(np.int8),
                                row_length=16).token_mask.sum() > 0  # 0 / 1 masks are masks
    for bad in (dict(row_length=True), dict(row_length=16, rows_per_micro_batch=True),
                dict(row_length=16, row_multiple=0), dict(row_length=16, rows_per_micro_batch=2.0)):
        with pytest.raises(ValueError, match="rl.packed_length|row_multiple|rl.micro_batch_size"):
            packing.plan_packing(prompt_mask, completion_mask, **bad)
    with pytest.raises(ValueError, match="overflow the plan's int32 indices"):
        packing.plan_packing(prompt_mask, completion_mask, row_length=2 ** 31)


def _packed_step_and_state(graphdef, params):
    tx = optax.sgd(1.0)
    step = ts.make_rl_train_step(graphdef, tx, trust_region.TrustRegionConfig(),
                                 PolicyLossConfig(temperature=TAU, pack_sequences=True))
    return step, ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


@pytest.mark.slow
def test_a_plan_made_for_other_rows_is_refused_by_the_step(setup):
    graphdef, params, batch = setup
    step, state = _packed_step_and_state(graphdef, params)
    wide = batch.replace(prompt_ids=np.pad(batch.prompt_ids, ((0, 0), (2, 0))),
                         prompt_mask=np.pad(batch.prompt_mask, ((0, 0), (2, 0))))
    plan = packing.plan_packing(batch.prompt_mask, batch.completion_mask, row_length=P + T)
    with pytest.raises(ValueError, match=r"planned for 6 sequences of 4 prompt \+ 5 completion columns; the batch "
                                         r"has 6 of 6 \+ 5"):
        jax.eval_shape(step, state, wide.replace(packing=plan))
    short = batch.replace(behavior_logprobs=batch.behavior_logprobs[:, :-1], packing=plan)
    with pytest.raises(ValueError, match=r"behavior_logprobs must have shape \(6, 5\), got \(6, 4\)"):
        jax.eval_shape(step, state, short)


@pytest.mark.parametrize("mode", objectives.AGGREGATION_MODES)
def test_token_loss_weights_give_the_aggregated_loss(mode):
    rng = np.random.default_rng(1)
    valid = rng.random((5, 7)) < 0.6
    valid[2] = False
    loss = rng.normal(size=(5, 7)).astype(np.float32)
    s, d = objectives.aggregate_loss(loss, valid, mode, max_response_length=9)
    w = objectives.token_loss_weights(valid, mode, max_response_length=9)
    np.testing.assert_allclose(float(jnp.sum(w * loss)), float(s / d), rtol=1e-6)
    assert float(jnp.sum(objectives.token_loss_weights(np.zeros((2, 3), bool), mode))) == 0.0


@pytest.mark.parametrize("loss_kw,rows_per_micro,row_length", [
    (dict(), 0, P + T),
    pytest.param(dict(loss_aggregation="seq_mean_token_mean", kl_beta=0.1, logits_chunk_size=2), 1, P + T,
                 marks=pytest.mark.slow),
    pytest.param(dict(loss_aggregation="seq_mean_token_sum_norm", max_response_length=8, logits_chunk_size=3), 2,
                 12, marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_the_packed_step_is_the_padded_step(setup, loss_kw, rows_per_micro, row_length):
    """Loss, every metric and the gradient (one SGD step) of the packed step equal the padded step's."""
    graphdef, params, batch = setup
    tr = trust_region.TrustRegionConfig(mask="pdm", delta=0.05)
    tx = optax.sgd(1.0)  # params_after = params - grad
    plan = packing.plan_packing(batch.prompt_mask, batch.completion_mask, row_length=row_length,
                                rows_per_micro_batch=rows_per_micro)
    assert plan.token_mask.shape[0] < batch.num_sequences

    def run(pack):
        lc = PolicyLossConfig(temperature=TAU, pack_sequences=pack, **loss_kw)
        step = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, lc))
        state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
        new_state, metrics = step(state, jax.tree.map(jnp.asarray, batch.replace(packing=plan if pack else None)))
        return jax.device_get(metrics), jax.device_get(new_state.params)

    m0, p0 = run(False)
    m1, p1 = run(True)
    assert 0.0 < m0["frac_masked"] < 1.0
    assert set(m1) == set(m0) | {"packed_fill"}
    np.testing.assert_allclose(m1["packed_fill"], plan.fill, rtol=1e-6)
    assert_same_step(m1, p1, m0, p0, params)


def test_a_packed_step_without_a_plan_is_refused(setup):
    graphdef, params, batch = setup
    step, state = _packed_step_and_state(graphdef, params)
    with pytest.raises(ValueError, match="carries no packing plan"):
        jax.eval_shape(step, state, batch)


@pytest.mark.slow
def test_the_packed_step_on_a_mesh_is_the_padded_step(setup):
    """The trainer's path on 2 x 2 fake devices (data x fsdp): the plan sharded by rows
    (`distributed.with_packing`), parameters FSDP-sharded, the step traced under the activation constraints."""
    from pdm_jax.distributed import put_global_batch, with_packing
    from pdm_jax.sharding import activation_sharding, make_mesh, param_shardings

    graphdef, params, batch = setup
    mesh = make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:4])
    tr = trust_region.TrustRegionConfig(mask="pdm", delta=0.05)
    tx = optax.sgd(1.0)
    sharded = jax.device_put(params, param_shardings(params, mesh))
    host = batch.select(np.r_[0:6, 0:2])  # 8 rows: a multiple of the 4 batch shards
    dev = put_global_batch(host, mesh)

    def run(pack):
        lc = PolicyLossConfig(temperature=TAU, pack_sequences=pack, logits_chunk_size=2)
        b = with_packing(dev, mesh, row_length=P + T, rows_per_micro_batch=4, host_batch=host) if pack else dev
        if pack:
            assert b.packing.src_row.sharding.spec[0] == ("data", "fsdp") and b.packing.num_micro_batches == 2
        state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=sharded, opt_state=tx.init(sharded))
        with activation_sharding(mesh):
            new_state, metrics = jax.jit(ts.make_rl_train_step(graphdef, tx, tr, lc))(state, b)
        return jax.device_get(metrics), jax.device_get(new_state.params)

    m0, p0 = run(False)
    m1, p1 = run(True)
    assert_same_step(m1, p1, m0, p0, params)
