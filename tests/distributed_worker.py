"""One process of the multi-host test (tests/test_distributed.py): RL loss and gradients on a global mesh.

Run as ``python tests/distributed_worker.py OUT.npz`` with ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` in the environment (a
single process when JAX_NUM_PROCESSES is 1 or unset). Every process builds the
same global batch on the host, feeds its own rows through
``pdm_jax.distributed.put_global_batch``, and computes the jitted PDM loss and
its gradient on a (data=2, fsdp=2, tensor=2) mesh of the 8 global devices;
process 0 writes the loss, the statistics and the gathered gradients to OUT.npz, and the same loss and
gradients of the packed step (``rl.pack_sequences``, the plan made from masks gathered off the devices).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(out_path: str) -> None:
    from pdm_jax import distributed
    from pdm_jax.config import get_base_config
    from pdm_jax.run_spec import initialize_distributed

    config = get_base_config()
    config.distributed = int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1
    initialize_distributed(config)

    import jax
    import numpy as np
    from flax import nnx

    from pdm_jax.rl import train_step as ts, trust_region
    from pdm_jax.rl.loss import PolicyLossConfig
    from pdm_jax.rl.step_batch import StepBatch
    from pdm_jax.models.qwen3 import Qwen3Config, init_model
    from pdm_jax.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, params = nnx.split(init_model(cfg, seed=0, mesh=mesh))

    rng = np.random.default_rng(0)
    b, p, t, k, v = 8, 4, 6, 4, cfg.vocab_size
    logmu = rng.standard_normal((b, t, v)) * 2.0
    logmu = logmu - np.log(np.exp(logmu).sum(-1, keepdims=True))
    completion_ids = rng.integers(0, v, (b, t)).astype(np.int32)
    topk_ids = np.argsort(-logmu, -1)[..., :k].astype(np.int32)
    batch = StepBatch(
        prompt_ids=rng.integers(0, v, (b, p)).astype(np.int32),
        prompt_mask=np.ones((b, p), bool),
        completion_ids=completion_ids,
        completion_mask=np.arange(t)[None, :] < rng.integers(1, t + 1, (b, 1)),
        behavior_logprobs=np.take_along_axis(logmu, completion_ids[..., None], -1)[..., 0].astype(np.float32),
        topk_ids=topk_ids,
        topk_logprobs=np.take_along_axis(logmu, topk_ids, -1).astype(np.float32),
        advantages=rng.standard_normal(b).astype(np.float32),
    )
    rows = distributed.local_batch_rows(b, mesh)
    device_batch = distributed.put_global_batch(batch, mesh)

    tr_config = trust_region.TrustRegionConfig(mask="pdm", estimator="bucket_exact", delta=0.5)
    loss_fn = ts.make_rl_loss(graphdef, tr_config, PolicyLossConfig(max_response_length=t))
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, aux), grads = step(params, device_batch)
    # rl.pack_sequences as per-host rollouts run it: the plan made from masks gathered off the devices
    # (no host batch), its rows split over the mesh; the packed step's gradient must be the padded one's.
    lc = PolicyLossConfig(max_response_length=t, pack_sequences=True)
    packed_batch = distributed.with_packing(device_batch, mesh, row_length=p + t, rows_per_micro_batch=4)
    # The trainer's global mode: every process plans from its own copy of the host batch; the same plan.
    from_host = distributed.with_packing(device_batch, mesh, row_length=p + t, rows_per_micro_batch=4, host_batch=batch)
    for got, want in zip(jax.tree.leaves(distributed.to_host(from_host.packing)),
                         jax.tree.leaves(distributed.to_host(packed_batch.packing))):
        assert got.shape == want.shape and (got == want).all(), (got.shape, want.shape)
    packed_terms = ts.make_packed_rl_terms(graphdef, tr_config, lc)
    packed_step = jax.jit(lambda prm, bt: ts.packed_grads(packed_terms, prm, bt, lc))
    p_grads, p_loss, p_aux = packed_step(params, packed_batch)
    host = distributed.to_host(dict(loss=loss, aux=aux, grads=nnx.to_pure_dict(grads), packed_loss=p_loss,
                                    packed_fill=p_aux["packed_fill"], packed_grads=nnx.to_pure_dict(p_grads)))
    if distributed.is_primary():
        flat = {"loss": np.asarray(host["loss"]), "rows": np.array([rows.start, rows.stop]),
                "process_count": np.array(jax.process_count()), "packed_loss": np.asarray(host["packed_loss"]),
                "packed_fill": np.asarray(host["packed_fill"])}
        flat.update({f"aux/{name}": np.asarray(val) for name, val in host["aux"].items()})
        for key in ("grads", "packed_grads"):
            for path, leaf in jax.tree_util.tree_flatten_with_path(host[key])[0]:
                name = "/".join(str(getattr(q, "key", getattr(q, "idx", q))) for q in path)
                flat[("grad/" if key == "grads" else "packed_grad/") + name] = np.asarray(leaf)
        np.savez(out_path, **flat)
    print(f"process {jax.process_index()}/{jax.process_count()} rows {rows.start}:{rows.stop} "
          f"loss {float(host['loss']):.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
