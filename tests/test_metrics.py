"""`pdm_jax.metrics`: what the run summary and the logs say about the run."""

from pdm_jax.config import get_base_config
from pdm_jax.metrics import sampler_weights_format


def test_the_weights_format_names_vllm_where_our_quantization_does_not_apply():
    c = get_base_config()
    assert sampler_weights_format(c) == c.sampler.quantization == "fp8"
    c.sampler.backend = "vllm"
    assert sampler_weights_format(c) == "vllm-managed"  # the vLLM server quantizes (or not) by its own flags
