"""Weights versions carry integrity data: any damaged file, or non-finite values, is refused by name.

`save_weights` writes a CRC-32C manifest of every file into ``weights_meta.json``
(itself self-checksummed); `load_weights` verifies it and refuses NaN/inf.
Every file of a version is truncated and bit-flipped in turn; the sampler
server answers a non-finite or damaged version with a 422 and keeps serving
the version it has.
"""
import hashlib
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient

from pdm_jax.models.qwen3 import Qwen3Config
from pdm_jax.sampler import weights as wts
from pdm_jax.sampler.engine import SamplingEngine
from pdm_jax.sampler.server import create_app

PARAMS = {"layer": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7},
          "norm": np.linspace(-1, 1, 5, dtype=np.float32)}
ABSTRACT = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return wts.save_weights(PARAMS, str(tmp_path_factory.mktemp("w") / "v3"), version=3)


def copy_of(pristine, tmp_path):
    return shutil.copytree(pristine, str(tmp_path / "v3"))


def files_of(path):
    return sorted(wts.read_meta(path)[wts.FILES_KEY]) + [wts.META_FILE]


def test_manifest_lists_every_file_and_roundtrip_is_exact(pristine):
    meta = wts.read_meta(pristine)
    assert meta["format"] == wts.FORMAT and meta["version"] == 3
    on_disk = sorted(os.path.relpath(os.path.join(d, f), pristine) for d, _, fs in os.walk(pristine) for f in fs)
    assert sorted(meta[wts.FILES_KEY]) + [wts.META_FILE] == sorted(on_disk)
    assert sorted(meta[wts.FILES_KEY]) == [wts.TENSORS_FILE]
    for rel, info in meta[wts.FILES_KEY].items():
        assert info["bytes"] == os.path.getsize(os.path.join(pristine, rel))
    restored = wts.load_weights(pristine, abstract=ABSTRACT, version=3)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, PARAMS)



def test_crc32c_is_the_castagnoli_check_value_and_matches_the_manifest(pristine):
    """CRC-32C("123456789") = 0xE3069283 (RFC 3720 B.4 check value); the manifest holds the file's."""
    assert wts.crc32c_hex(b"123456789") == "e3069283"
    entry = wts.read_meta(pristine)[wts.FILES_KEY][wts.TENSORS_FILE]
    assert entry["crc32c"] == wts.crc32c_hex(open(os.path.join(pristine, wts.TENSORS_FILE), "rb").read())


def _as_sha256_format(path):
    """Rewrites a /4 directory's meta as format /3 wrote it (sha256 manifest, self-checksummed)."""
    meta_path = os.path.join(path, wts.META_FILE)
    meta = json.load(open(meta_path))
    data = open(os.path.join(path, wts.TENSORS_FILE), "rb").read()
    meta["format"] = wts.SHA256_FORMAT
    meta[wts.FILES_KEY] = {wts.TENSORS_FILE: {"sha256": hashlib.sha256(data).hexdigest(),
                                              "bytes": len(data)}}
    meta[wts.META_HASH_KEY] = wts._meta_digest(meta)
    json.dump(meta, open(meta_path, "w"))


def test_sha256_format_3_is_still_read_and_verified(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)
    _as_sha256_format(path)
    restored = wts.load_weights(path, abstract=ABSTRACT, version=3)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, PARAMS)
    full = os.path.join(path, wts.TENSORS_FILE)
    data = bytearray(open(full, "rb").read())
    data[-1] ^= 0x01
    open(full, "wb").write(bytes(data))
    with pytest.raises(wts.CorruptWeightsError, match="sha256 checksum"):
        wts.load_weights(path, abstract=ABSTRACT, version=3)


def test_one_flipped_bit_fails_the_crc32c(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)
    full = os.path.join(path, wts.TENSORS_FILE)
    data = bytearray(open(full, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(full, "wb").write(bytes(data))
    with pytest.raises(wts.CorruptWeightsError, match="crc32c checksum"):
        wts.load_weights(path, abstract=ABSTRACT, version=3)

def _truncate(full):
    size = os.path.getsize(full)
    with open(full, "r+b") as f:
        f.truncate(size // 2)


def _flip16(full):
    """16 flipped bits spread over the file (the issue's 16 flipped bytes)."""
    data = bytearray(open(full, "rb").read())
    for i in np.linspace(0, len(data) - 1, 16).astype(int):
        data[i] ^= 0x01
    open(full, "wb").write(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip16, os.remove], ids=["truncate", "flip16", "delete"])
def test_damaging_any_file_is_refused_naming_it(pristine, tmp_path, damage):
    names = files_of(pristine)
    assert names == [wts.TENSORS_FILE, wts.META_FILE]
    for i, rel in enumerate(names):
        path = shutil.copytree(pristine, str(tmp_path / f"case{i}" / "v3"))
        damage(os.path.join(path, rel))
        if rel == wts.META_FILE and damage is os.remove:
            expected = wts.WeightsError  # no meta file: an incomplete directory
        else:
            expected = wts.CorruptWeightsError
        with pytest.raises(expected) as e:
            wts.load_weights(path, abstract=ABSTRACT, version=3)
        assert path in str(e.value), rel
        if expected is wts.CorruptWeightsError:
            assert e.value.file == rel and repr(rel) in str(e.value) and e.value.path == path


def test_every_single_byte_change_of_the_meta_file_is_caught(pristine, tmp_path):
    path = copy_of(pristine, tmp_path)
    meta_path = os.path.join(path, wts.META_FILE)
    good = open(meta_path, "rb").read()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        open(meta_path, "wb").write(bytes(bad))
        with pytest.raises(wts.WeightsError):
            wts.read_meta(path)
    open(meta_path, "wb").write(good)
    assert wts.read_meta(path)["version"] == 3


def test_non_finite_parameters_are_refused_at_load(tmp_path):
    bad = {"layer": {"w": PARAMS["layer"]["w"].copy()}, "norm": PARAMS["norm"].copy()}
    bad["layer"]["w"][1, 2] = np.nan
    bad["layer"]["w"][2, 0] = np.inf
    bad["norm"][0] = -np.inf
    path = wts.save_weights(bad, str(tmp_path / "nan"), version=1)  # saving records what the trainer had
    with pytest.raises(wts.WeightsError, match=r"parameter \['layer'\]\['w'\] holds 2 non-finite value\(s\) "
                                               r"\(NaN/inf\) of 12; 1 more parameter\(s\) too") as e:
        wts.load_weights(path, abstract=ABSTRACT)
    assert path in str(e.value)


def _orbax_dir(path, params, fmt):
    """A directory as the orbax-based writer of formats /1 (no manifest) and /2 (sha256 manifest) left it."""
    import orbax.checkpoint as ocp

    os.makedirs(path)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(path, wts.PARAMS_DIR), params)
    ckpt.wait_until_finished()
    meta = {"format": fmt, "version": 3, "num_params": 17, "dtypes": ["float32"]}
    if fmt == wts.ORBAX_FORMAT:
        rels = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
        meta[wts.FILES_KEY] = {r: {"sha256": h, "bytes": n} for r, (h, n) in wts._hash_files(path, rels).items()}
        meta[wts.META_HASH_KEY] = wts._meta_digest(meta)
    json.dump(meta, open(os.path.join(path, wts.META_FILE), "w"))
    return path


def test_older_orbax_directories_still_load(tmp_path, caplog):
    """/2 (orbax + manifest): verified, a flipped file named; /1 (no manifest): unverified, with a warning."""
    v2 = _orbax_dir(str(tmp_path / "v2"), PARAMS, wts.ORBAX_FORMAT)
    restored = wts.load_weights(v2, abstract=ABSTRACT, version=3)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, PARAMS)
    victim = sorted(wts.read_meta(v2)[wts.FILES_KEY])[-1]
    _flip16(os.path.join(v2, victim))
    with pytest.raises(wts.CorruptWeightsError) as e:
        wts.load_weights(v2, abstract=ABSTRACT, version=3)
    assert e.value.file == victim
    v1 = _orbax_dir(str(tmp_path / "v1"), PARAMS, wts.LEGACY_FORMAT)
    with caplog.at_level(logging.WARNING, logger="pdm_jax.sampler.weights"):
        restored = wts.load_weights(v1, abstract=ABSTRACT, version=3)
    assert "no integrity manifest" in caplog.text and v1 in caplog.text
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, PARAMS)


def test_a_legacy_meta_with_a_manifest_is_refused(pristine, tmp_path):
    """A /1 meta that carries a manifest was altered (e.g. a flipped format digit): refused."""
    for fmt in (wts.LEGACY_FORMAT, wts.ORBAX_FORMAT):
        tampered = open(os.path.join(pristine, wts.META_FILE)).read().replace(wts.FORMAT, fmt)
        path = shutil.copytree(pristine, str(tmp_path / fmt.replace("/", "_")))
        open(os.path.join(path, wts.META_FILE), "w").write(tampered)
        with pytest.raises(wts.CorruptWeightsError, match="carries a manifest|meta_sha256"):
            wts.load_weights(path, abstract=ABSTRACT)


def test_bfloat16_and_fp8_leaves_roundtrip_bit_exact(tmp_path):
    """Dtypes numpy's safetensors table lacks travel as uint views with their dtype in the metadata."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
            "b": {"c": rng.standard_normal(7).astype(ml_dtypes.float8_e4m3fn)}, "d": np.arange(4, dtype=np.int32)}
    path = wts.save_weights(tree, str(tmp_path / "w"), version=1)
    assert wts.read_meta(path)["dtypes"] == ["bfloat16", "float8_e4m3fn", "int32"]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    back = wts.load_weights(path, abstract=target, version=1)
    for k in ("a", "d"):
        assert back[k].dtype == tree[k].dtype and back[k].tobytes() == tree[k].tobytes()
    assert back["b"]["c"].dtype == tree["b"]["c"].dtype and back["b"]["c"].tobytes() == tree["b"]["c"].tobytes()
    # an f32 target (the sampler's) gets the bf16 values widened exactly
    wide = wts.load_weights(path, abstract={"a": jax.ShapeDtypeStruct((3, 5), np.float32),
                                            "b": {"c": jax.ShapeDtypeStruct((7,), np.float32)},
                                            "d": jax.ShapeDtypeStruct((4,), np.int32)})
    np.testing.assert_array_equal(wide["a"], tree["a"].astype(np.float32))


def test_names_and_shapes_must_match_the_target(pristine):
    with pytest.raises(wts.WeightsError, match=r"missing \['layer/v'\] unexpected \['layer/w'\]"):
        wts.load_weights(pristine, abstract={"layer": {"v": ABSTRACT["layer"]["w"]}, "norm": ABSTRACT["norm"]})
    with pytest.raises(wts.WeightsError, match=r"layer/w is float32\[3, 4\], the model expects float32\[4, 3\]"):
        wts.load_weights(pristine, abstract={"layer": {"w": jax.ShapeDtypeStruct((4, 3), np.float32)},
                                             "norm": ABSTRACT["norm"]})


def test_version_mismatch_is_its_own_error(pristine):
    with pytest.raises(wts.VersionMismatchError, match="holds version 3, not the requested version 4"):
        wts.load_weights(pristine, abstract=ABSTRACT, version=4)


# ----------------------------------------------------------------------------- through the server
CFG = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def random_params(seed):
    """Model-shaped f32 parameters without initialising a model (no JAX compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.1).astype(np.float32), wts.abstract_params(CFG))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    engine = SamplingEngine(CFG, random_params(0), quantization="fp8", version=0, max_prompt_length=8,
                            max_new_tokens=8)
    with TestClient(create_app(engine, checkpoint_root=str(root))) as client:
        yield client, engine, root


def test_server_refuses_nan_weights_with_422_and_keeps_its_version(served):
    client, engine, root = served
    params = random_params(1)
    params["embed_tokens"]["embedding"][3, 4] = np.nan
    wts.save_weights(params, str(root / "weights" / "1"), version=1)
    before = jax.tree.map(np.asarray, engine.params)
    r = client.post("/v1/weights", json={"path": "weights/1", "version": 1})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "path" and err["type"] == "bad_weights"
    assert "non-finite" in err["message"] and "embed_tokens" in err["message"]
    assert client.get("/health").json()["version"] == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, engine.params), before)
    # a damaged file: 422 naming it; then a good version still loads
    good = wts.save_weights(random_params(2), str(root / "weights" / "2"), version=2)
    victim = sorted(wts.read_meta(good)[wts.FILES_KEY])[-1]
    backup = open(os.path.join(good, victim), "rb").read()
    _flip16(os.path.join(good, victim))
    r = client.post("/v1/weights", json={"path": "weights/2", "version": 2})
    assert r.status_code == 422 and repr(victim) in r.json()["error"]["message"]
    assert client.get("/health").json()["version"] == 0
    open(os.path.join(good, victim), "wb").write(backup)
    r = client.post("/v1/weights", json={"path": "weights/2", "version": 2})
    assert r.status_code == 200 and client.get("/health").json()["version"] == 2


def test_quantizer_refusal_is_a_weights_error(served):
    _, engine, _ = served
    version = engine.version
    params = random_params(3)
    up = [x for k, x in jax.tree_util.tree_flatten_with_path(params)[0] if "up_proj" in wts.leaf_name(k)][0]
    up.flat[0] = np.nan  # any layout (per-layer or stacked): the first layer's MLP up-projection
    with pytest.raises(wts.WeightsError, match="cannot be quantized"):
        engine.set_params(params, version=99)
    assert engine.version == version
