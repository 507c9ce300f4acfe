"""One process of the per-host rollout test (tests/test_per_host.py): a few RL steps of the tiny task.

Run as ``python tests/per_host_worker.py WORKDIR OUT.npz [--config.field=value ...]`` with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` in the environment (a single
process when JAX_NUM_PROCESSES is 1 or unset). It runs `pdm_jax.trainer.Trainer` on
configs/tiny.py with the overrides, with a callback that gathers every optimizer step's
global `StepBatch` (the rollouts as the train step sees them) to the host; process 0 writes
them to OUT.npz.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(workdir: str, out_path: str, overrides) -> None:
    import logging

    sys.path.insert(0, ROOT)
    from configs.tiny import get_config
    from pdm_jax import distributed
    from pdm_jax.run_spec import initialize_distributed

    config = get_config()
    for arg in overrides:  # --config.a.b=value, typed like the default
        path, value = arg[len("--config."):].split("=", 1)
        *parents, leaf = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        old = node[leaf]
        node[leaf] = (value == "True") if isinstance(old, bool) else type(old)(value)
    config.distributed = int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1
    initialize_distributed(config)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pdm_jax").setLevel(logging.INFO)

    import jax
    import numpy as np

    from pdm_jax.callbacks import TrainerCallback
    from pdm_jax.trainer import Trainer

    batches = []

    class Record(TrainerCallback):
        def before_update(self, trainer, rl_step, batch, state):
            batches.append(distributed.to_host(batch))

    trainer = Trainer(config, workdir, callbacks=[Record()])
    summary = trainer.run()
    print(f"process {jax.process_index()}/{jax.process_count()} sampled {trainer.rollout_counts['prompts']} prompts "
          f"{trainer.rollout_counts['rows']} rows; summary steps {summary['steps']}", flush=True)
    if distributed.is_primary():
        flat = {}
        for i, b in enumerate(batches):
            for name, value in vars(b).items():
                if value is not None:
                    flat[f"batch{i}/{name}"] = np.asarray(value)
        np.savez(out_path, **flat)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
