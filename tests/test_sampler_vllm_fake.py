"""`pdm_jax.sampler.vllm_fake`: the fake vLLM server's own checks. What it serves (vLLM's documented shapes, the
weight reload, the logprobs modes) is checked through the client in tests/test_rollouts_vllm_client.py."""

import pytest

from pdm_jax.sampler import vllm_fake


def test_fake_vllm_refuses_a_public_host_without_a_key_and_a_bad_key(capsys):
    for argv, want in ((["--host=0.0.0.0"], "an --api_key is required"),
                       (["--host=0.0.0.0", "--api_key=key "], "--api_key holds")):
        with pytest.raises(SystemExit) as e:
            vllm_fake.parse_args(["--weights_root=w"] + argv)
        assert e.value.code == 2 and want in capsys.readouterr().err
    assert vllm_fake.parse_args(["--weights_root=w", "--host=0.0.0.0", "--api_key=k1"]).api_key == "k1"
    assert vllm_fake.parse_args(["--weights_root=w"]).host == "127.0.0.1"
