"""pdm_jax.sampler.wire_codec: body decoding statuses, JSON non-finite values and packed arrays (the hostile
bodies are in tests/test_sampler_hostile.py)."""
import msgpack
import numpy as np
import pytest

from pdm_jax.sampler import wire_codec


def test_decode_body_statuses():
    assert wire_codec.decode_body(b'{"a": 1}', None) == {"a": 1}
    assert wire_codec.decode_body(msgpack.packb({"a": 1}), "application/x-msgpack") == {"a": 1}
    for body, ctype, status, words in ((b"a=1", "text/plain", 415, "Content-Type"), (b"{", "application/json", 400,
                                       "malformed JSON"), (b"\xc1", wire_codec.MSGPACK, 400, "malformed msgpack"),
                                       (b"[1]", "application/json", 400, "object (map)")):
        with pytest.raises(wire_codec.BodyError) as e:
            wire_codec.decode_body(body, ctype)
        assert e.value.status == status and words in str(e.value)
    assert wire_codec.response_is_msgpack("application/msgpack", None)
    assert wire_codec.response_is_msgpack("*/*", wire_codec.MSGPACK) and wire_codec.response_is_msgpack(None,
                                                                                                        wire_codec.MSGPACK)
    assert not wire_codec.response_is_msgpack("application/json", wire_codec.MSGPACK)


def test_wire_json_nonfinite_and_array_roundtrip():
    a = np.array([[0.5, -np.inf], [1.0, 2.0]], np.float32)
    j = wire_codec.loads(wire_codec.dumps({"x": a}, msgpack=False), msgpack=False)
    assert j["x"] == [[0.5, None], [1.0, 2.0]]
    np.testing.assert_array_equal(wire_codec.float_list(j["x"]), a)
    m = wire_codec.loads(wire_codec.dumps({"x": a, "i": np.arange(3, dtype=np.int32)}, msgpack=True), msgpack=True)
    np.testing.assert_array_equal(m["x"], a) and np.testing.assert_array_equal(m["i"], [0, 1, 2])
    with pytest.raises(ValueError, match="malformed"):
        wire_codec.loads(b"{", msgpack=False)
