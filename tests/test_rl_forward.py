"""`pdm_jax.rl.forward`: the update's one forward pass keeps exactly the positions whose next-token outputs score
the completion tokens (P-1 .. P+T-2 of prompt + completion), as logits or as hidden states plus the LM head."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3ForCausalLM
from pdm_jax.rl import forward
from conftest import TINY_DENSE, jit_method


def _host_drawn_model(rng):
    """The tiny dense model's graphdef and weights drawn on the host (an eager model init compiles dozens of small
    programs; a compiled one, a program as costly as the test's forward)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(TINY_DENSE, rngs=nnx.Rngs(0))))
    return graphdef, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), abstract)


def test_completion_positions_are_the_ones_that_score_the_completion_tokens():
    rng = np.random.default_rng(0)
    graphdef, params = _host_drawn_model(rng)
    prompt_ids = rng.integers(1, 32, (2, 3)).astype(np.int32)
    prompt_mask = np.array([[True, True, True], [False, True, True]])  # row 1 left-padded
    completion_ids = rng.integers(1, 32, (2, 4)).astype(np.int32)
    completion_mask = np.array([[True] * 4, [True, True, True, False]])  # row 1 ended early
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    full = jax.jit(lambda p: nnx.merge(graphdef, p)(jnp.concatenate([prompt_ids, completion_ids], 1),
                                                    attention_mask=jnp.concatenate([prompt_mask, completion_mask], 1))
                   )(params)
    logits = jax.jit(lambda p: forward.completion_logits(graphdef, p, *batch))(params)
    assert logits.shape == (2, 4, TINY_DENSE.vocab_size) and logits.dtype == jnp.float32
    full = np.asarray(full)  # sliced on the host (a device array's slices are programs of their own)
    np.testing.assert_allclose(logits, full[:, 2:6], rtol=0, atol=1e-6)  # position 2 predicts completion token 0
    assert not np.allclose(logits, full[:, 3:7], atol=1e-3)  # one position later is another distribution

    def through_the_head(p):
        h, head = forward.completion_hidden_states(graphdef, p, *batch)
        return h, head(h)

    h, head_logits = jax.jit(through_the_head)(params)
    assert h.shape == (2, 4, TINY_DENSE.hidden_size)
    np.testing.assert_allclose(head_logits, logits, rtol=0, atol=1e-5)
    aux = jax.jit(lambda p: forward.completion_logits(graphdef, p, *batch, return_aux=True)[1])(params)
    assert aux is None  # a dense model has no router loss


def test_packed_rows_give_each_sequence_its_own_logits():
    """Two sequences and two padding positions in one packed row: each sequence's logits are those of the model on
    it alone (segments apart, positions restarting)."""
    import types

    graphdef, params = _host_drawn_model(np.random.default_rng(3))
    model = nnx.merge(graphdef, params)
    a, b = [4, 5, 6, 7, 8], [9, 10, 11]
    segments = np.array([[1] * len(a) + [2] * len(b) + [0, 0]], np.int32)
    rows = types.SimpleNamespace(input_ids=jnp.asarray([a + b + [0, 0]], jnp.int32),
                                 token_mask=jnp.asarray(segments > 0), segment_ids=jnp.asarray(segments))
    out, _, aux = jax.jit(lambda p: forward.packed_forward(graphdef, p, rows, head=True))(params)
    assert out.shape == (1, 10, TINY_DENSE.vocab_size) and aux is None

    forward_alone = jit_method(model)

    def alone(ids):
        return np.asarray(forward_alone(jnp.asarray([ids], jnp.int32), attention_mask=jnp.ones((1, len(ids)), bool))[0])
    out = np.asarray(out)
    np.testing.assert_allclose(out[0, :len(a)], alone(a), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[0, len(a):len(a) + len(b)], alone(b), atol=1e-5, rtol=1e-5)
