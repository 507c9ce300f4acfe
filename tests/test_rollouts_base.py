"""`pdm_jax.rollouts.base.Sampler`: the protocol every sampler backend the supervisor holds implements."""


def test_every_sampler_implements_the_protocol():
    """Each backend the supervisor can hold has every method of `pdm_jax.rollouts.base.Sampler`."""
    import inspect

    from pdm_jax.rollouts import base
    from pdm_jax.rollouts.client import SamplerClient
    from pdm_jax.rollouts.in_process import InProcessSampler
    from pdm_jax.rollouts.vllm_client import VLLMSampler

    members = [m for m in ("generate", "load_weights", "health", "version") if hasattr(base.Sampler, m)]
    assert len(members) == 4
    for cls in (SamplerClient, VLLMSampler, InProcessSampler):
        for m in members:
            assert hasattr(cls, m), f"{cls.__name__} lacks {m}"
        want = list(inspect.signature(base.Sampler.generate).parameters)
        assert list(inspect.signature(cls.generate).parameters) == want == ["self", "prompts", "params", "fields"]
    assert hasattr(InProcessSampler, "set_params")
