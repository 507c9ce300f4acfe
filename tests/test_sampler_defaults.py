"""`pdm_jax.sampler.defaults`: the one set of batching defaults of engine, server, launcher and schema."""


def test_every_batching_default_is_the_schemas():
    """The engine's spec (which the engine and the launcher take), the server's flags and the run config take one
    set of batching defaults (`pdm_jax.sampler.defaults`): a server started by hand batches as the trainer's does."""
    import inspect

    from pdm_jax.config import get_base_config
    from pdm_jax.rollouts.launcher import start_sampler_server
    from pdm_jax.sampler import defaults
    from pdm_jax.sampler.engine import SamplingEngine
    from pdm_jax.sampler.server import parse_args
    from pdm_jax.sampler.spec import EngineSpec

    want = dict(batching=defaults.BATCHING, max_batch_size=defaults.MAX_BATCH_SIZE, park_rows=defaults.PARK_ROWS)
    assert defaults.BATCHING == "continuous" and defaults.BATCHING in defaults.BATCHING_MODES
    sc = get_base_config().sampler
    assert {k: sc[k] for k in want} == want and sc.max_slots == defaults.MAX_SLOTS
    args = vars(parse_args(["--model_config=x", "--checkpoint_root=/tmp"]))
    assert {k: args[k] for k in want} == want and args["max_slots"] == defaults.MAX_SLOTS
    spec = EngineSpec()  # what the engine and the launcher take (start_sampler_server's spec: fp8 weights)
    assert {k: getattr(spec, k) for k in want} == want and spec.max_slots is None
    for fn in (SamplingEngine.__init__, start_sampler_server):
        assert "spec" in inspect.signature(fn).parameters, fn
