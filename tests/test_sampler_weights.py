"""Weight-sync format (safetensors + meta JSON; older orbax directories still read) and the engine's version rules."""
import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from pdm_jax.sampler import weights as wts
from pdm_jax.rollouts.in_process import InProcessSampler
from pdm_jax.sampler.engine import SamplingEngine, StaleWeightsError
from conftest import TINY_DENSE

CFG = TINY_DENSE


def test_save_load_roundtrip_exact(tmp_path):
    model = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1))
    path = wts.save_weights(model, str(tmp_path / "weights" / "7"), version=7)
    meta = json.load(open(os.path.join(path, wts.META_FILE)))
    assert meta["version"] == 7 and meta["format"] == wts.FORMAT
    assert meta["num_params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    restored = wts.load_weights(path, CFG, version=7)
    ref = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(restored) == jax.tree.structure(ref)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, ref)


def test_missing_incomplete_and_wrong_version(tmp_path):
    with pytest.raises(wts.WeightsError, match="does not exist"):
        wts.load_weights(str(tmp_path / "nope"), CFG)
    os.makedirs(tmp_path / "half")
    with pytest.raises(wts.WeightsError, match="incomplete"):
        wts.load_weights(str(tmp_path / "half"), CFG)
    path = wts.save_weights(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)), str(tmp_path / "w1"), version=1)
    with pytest.raises(wts.WeightsError, match="holds version 1"):
        wts.load_weights(path, CFG, version=2)
    other = Qwen3Config(**{**CFG.__dict__, "intermediate_size": 48})
    with pytest.raises(wts.WeightsError, match="does not match"):
        wts.load_weights(path, other)
    with pytest.raises(ValueError, match="version"):
        wts.save_weights({"a": np.zeros(2)}, str(tmp_path / "neg"), version=-1)
    with pytest.raises(ValueError, match="not an integer"):
        wts.save_weights({"a": np.zeros(2)}, str(tmp_path / "latest"))
    # the trainer's call: save_weights(model, f"{root}/weights/{version}") infers the version
    inferred = wts.save_weights({"a": np.arange(3.0)}, str(tmp_path / "weights" / "12"))
    assert wts.read_meta(inferred)["version"] == 12


def test_engine_version_rules(tmp_path):
    m0, m1 = (Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(s)) for s in (0, 1))
    p0 = wts.save_weights(m0, str(tmp_path / "weights" / "0"), version=0)
    p1 = wts.save_weights(m1, str(tmp_path / "weights" / "1"), version=1)
    eng = SamplingEngine(CFG, wts.load_weights(p0, CFG), version=0, weights_path=p0,
                         max_prompt_length=16, max_new_tokens=16)
    s = InProcessSampler(eng, checkpoint_root=str(tmp_path))
    info = s.load_weights("weights/1", 1)  # relative to the root
    assert info["version"] == 1 and not info["reloaded"] and eng.version == 1
    ref = nnx.to_pure_dict(nnx.state(m1, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), eng.params, ref)
    assert s.load_weights(p1, 1)["reloaded"]  # same version, same path: idempotent
    with pytest.raises(StaleWeightsError, match="stale"):
        s.load_weights(p0, 0)
    with pytest.raises(StaleWeightsError):
        s.load_weights(p0, 1)  # same version, other path
    with pytest.raises(wts.WeightsError, match="does not exist"):
        s.load_weights("weights/2", 2)
    with pytest.raises(wts.WeightsError, match="holds version 0"):
        s.load_weights(p0, 5)
    with pytest.raises(wts.WeightsError, match=r"'\.\.'"):
        s.load_weights("weights/../weights/1", 3)
    with pytest.raises(wts.WeightsError, match="outside"):
        s.load_weights("/tmp", 3)
    assert eng.version == 1


# ---- the checkpoint root is a boundary: no link followed, no FIFO, sizes checked before a byte is read ----------

def _root_with_versions(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    m0, m1 = (Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(s)) for s in (0, 1))
    p0 = wts.save_weights(m0, str(root / "weights" / "0"), version=0)
    wts.save_weights(m1, str(outside / "1"), version=1)
    eng = SamplingEngine(CFG, wts.load_weights(p0, CFG), version=0, weights_path=p0, max_prompt_length=16,
                         max_new_tokens=16)
    return root, outside, eng, InProcessSampler(eng, checkpoint_root=str(root))


def test_a_symlinked_file_or_directory_under_the_root_is_refused(tmp_path):
    root, outside, eng, s = _root_with_versions(tmp_path)
    # a version directory whose tensor file is a link to a file outside the root
    linked = root / "weights" / "1"
    os.makedirs(linked)
    for name in (wts.META_FILE, wts.TENSORS_FILE):
        os.symlink(outside / "1" / name, linked / name)
    with pytest.raises(wts.WeightsError, match="symbolic link"):
        s.load_weights("weights/1", 1)
    # only the tensor file a link, beside the version's own, real meta file
    os.unlink(linked / wts.META_FILE)
    shutil.copy(outside / "1" / wts.META_FILE, linked / wts.META_FILE)
    with pytest.raises(wts.WeightsError, match=r"'params.safetensors' is a symbolic link"):
        s.load_weights("weights/1", 1)
    # an older orbax directory under the root with one file of its tree a link: refused, never handed to orbax
    from test_sampler_integrity import _orbax_dir

    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)), nnx.Param))
    legacy = _orbax_dir(str(root / "weights" / "orbax"), params, wts.ORBAX_FORMAT)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    back = wts.load_weights(legacy, abstract=abstract, version=3, root=str(root))  # read from a private copy
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), back, params)
    victim = next(os.path.join(d, f) for d, _, fs in os.walk(legacy) for f in fs if f != wts.META_FILE)
    os.replace(victim, str(outside / "moved"))
    os.symlink(outside / "moved", victim)
    with pytest.raises(wts.WeightsError, match="is a symbolic link; refused"):
        wts.load_weights(legacy, abstract=abstract, version=3, root=str(root))
    # a link to a directory inside the root is followed by no reader either (its real path is checked, then walked)
    os.symlink(root / "weights" / "0", root / "weights" / "alias")
    assert wts.ConfinedDir(str(root), os.path.realpath(root / "weights" / "alias")).fd is not None
    # the same through load_weights with a root directly: the directory path itself may not pass through a link
    os.symlink(outside, root / "ext")
    with pytest.raises(wts.WeightsError, match="symbolic link"):
        wts.load_weights(str(root / "ext" / "1"), CFG, root=str(root))
    assert eng.version == 0  # nothing was loaded


def test_a_directory_swapped_for_a_link_during_loads_is_never_read(tmp_path):
    """The race the path check alone loses: between the check and the open, the real version directory becomes a
    link to outside the root (and back). Every try loads the inside version or is refused; none reads outside."""
    import threading

    root, outside, eng, s = _root_with_versions(tmp_path)
    real = root / "weights" / "v"
    parked = root / "weights" / "v.parked"
    # the same version inside and outside, so that only where the bytes came from tells the two apart
    wts.save_weights(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(2)), str(real), version=1)
    inside_params = wts.load_weights(str(real), CFG)
    stop, swaps, errs = threading.Event(), [0], []

    def swapper():
        while not stop.is_set():
            try:
                os.replace(real, parked)  # the real directory out, a link to outside in its place
                os.symlink(outside / "1", real)
            except OSError as e:
                errs.append(repr(e))
            finally:  # and back, whatever failed
                if os.path.islink(real):
                    os.unlink(real)
                if os.path.isdir(parked) and not os.path.exists(real):
                    os.replace(parked, real)
            swaps[0] += 1

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    outcomes = []
    try:
        for _ in range(60):
            try:
                outcomes.append(("loaded", wts.load_weights(str(real), CFG, version=1, root=str(root))))
            except wts.WeightsError as e:
                outcomes.append((type(e).__name__, str(e)))
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 0 and errs == [], errs
    for kind, got in outcomes:
        if kind == "loaded":  # what was loaded is the inside version's bytes, never the outside one's
            jax.tree.map(np.testing.assert_array_equal, got, inside_params)
        else:
            assert "symbolic link" in got or "does not exist" in got or "not a directory" in got, got
    assert any(kind != "loaded" for kind, _ in outcomes), "no try met the race"


def test_fifo_sparse_file_and_deep_meta_are_refused_unread(tmp_path):
    root, outside, eng, s = _root_with_versions(tmp_path)
    good = wts.save_weights(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(3)), str(root / "weights" / "3"), version=3)
    # a FIFO in place of the tensor file: refused at once, never a blocked read
    fifo_dir = root / "weights" / "4"
    os.makedirs(fifo_dir)
    os.link(os.path.join(good, wts.META_FILE), fifo_dir / wts.META_FILE)
    os.mkfifo(fifo_dir / wts.TENSORS_FILE)
    meta4 = wts.read_meta(str(fifo_dir))
    with pytest.raises(wts.WeightsError, match="not a regular file"):
        wts.load_weights(str(fifo_dir), CFG, version=meta4["version"], root=str(root))
    # a tensor file grown to a 1 GiB sparse file: its size is refused before a byte is read
    with open(os.path.join(good, wts.TENSORS_FILE), "r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(wts.CorruptWeightsError, match=r"has 1073741824 bytes, the manifest records \d+ .*not read"):
        wts.load_weights(good, CFG, root=str(root))
    with pytest.raises(wts.CorruptWeightsError, match="not read"):
        wts.load_weights(good, CFG)  # without a root too
    # a meta file nested 100,000 deep: a named CorruptWeightsError, not a RecursionError (an HTTP 500)
    deep = root / "weights" / "5"
    os.makedirs(deep)
    (deep / wts.META_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(wts.CorruptWeightsError, match="cannot be read as JSON"):
        wts.load_weights(str(deep), CFG, root=str(root))
    with pytest.raises(wts.CorruptWeightsError, match="cannot be read as JSON"):
        wts.read_meta(str(deep))
    assert eng.version == 0


@pytest.mark.slow
def test_generation_goes_on_while_a_load_reads_its_files(tmp_path, monkeypatch):
    """A load stuck in its read (a slow mount) holds neither the engine's lock nor /health: generate runs, and
    health says a load of which version has been running how long."""
    import threading

    root, outside, eng, s = _root_with_versions(tmp_path)
    p1 = wts.save_weights(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)), str(root / "weights" / "1"), version=1)
    release, entered = threading.Event(), threading.Event()
    real_read = wts.ConfinedDir.read

    def slow_read(self, name, **kw):
        if name == wts.TENSORS_FILE:
            entered.set()
            release.wait(60)
        return real_read(self, name, **kw)

    monkeypatch.setattr(wts.ConfinedDir, "read", slow_read)
    t = threading.Thread(target=s.load_weights, args=(p1, 1), daemon=True)
    t.start()
    assert entered.wait(60)
    rb = eng.generate([[1, 2, 3]], max_new_tokens=2, top_k_logprobs=0, seed=0)  # not blocked by the load
    assert rb.weights_version[0] == 0 and eng.health()["loading"]["version"] == 1
    release.set()
    t.join(60)
    assert eng.version == 1 and eng.health()["loading"] is None


def test_an_orbax_directory_under_a_root_is_copied_within_bounds(tmp_path, monkeypatch):
    """The private copy of an older orbax directory: each file checked against its manifest size before it is
    read (a sparse file grown to 256 MiB is refused unread), a tree too deep or a file deleted mid-copy refused
    by name, and no message naming the copy instead of the version directory."""
    import tempfile

    from test_sampler_integrity import _orbax_dir

    root = tmp_path / "root"
    params = nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1)), nnx.Param))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    load = functools.partial(wts.load_weights, abstract=abstract, version=3, root=str(root))
    v2 = _orbax_dir(str(root / "v2"), params, wts.ORBAX_FORMAT)
    victim = sorted(wts.read_meta(v2)[wts.FILES_KEY])[0]
    with open(os.path.join(v2, victim), "r+b") as f:
        f.truncate(256 << 20)  # sparse: nothing is allocated, a reader of the whole file would hold 256 MiB
    with pytest.raises(wts.CorruptWeightsError, match=r"has 268435456 bytes, the manifest records .*not read"):
        load(v2)
    v1 = _orbax_dir(str(root / "v1"), params, wts.LEGACY_FORMAT)  # no manifest: bounded by the model's size
    with open(os.path.join(v1, victim), "r+b") as f:
        f.truncate(256 << 20)
    with pytest.raises(wts.CorruptWeightsError, match=r"more than the .* a reader accepts; not read"):
        load(v1)
    deep = _orbax_dir(str(root / "deep"), params, wts.LEGACY_FORMAT)
    os.makedirs(os.path.join(deep, *(["z"] * (wts.MAX_TREE_DEPTH + 1))))
    with pytest.raises(wts.WeightsError, match=r"more than 32 directories deep; refused"):
        load(deep)
    gone = _orbax_dir(str(root / "gone"), params, wts.ORBAX_FORMAT)
    read_at = wts.ConfinedDir._read_at

    def deleting(self, fd, name, **kw):  # the version is deleted while the copy reads it
        if name != wts.META_FILE:
            os.unlink(os.path.basename(name), dir_fd=fd)
        return read_at(self, fd, name, **kw)

    monkeypatch.setattr(wts.ConfinedDir, "_read_at", deleting)
    with pytest.raises(wts.WeightsError, match=r"vanished while it was read") as e:
        load(gone)
    monkeypatch.undo()
    no_params = _orbax_dir(str(root / "no_params"), params, wts.LEGACY_FORMAT)
    shutil.rmtree(os.path.join(no_params, wts.PARAMS_DIR))
    with pytest.raises(wts.WeightsError) as e:
        load(no_params)
    assert "pdm_weights_" not in str(e.value) and f"Checkpoint at {no_params}/params not found" in str(e.value)
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("pdm_weights_")]  # copies removed
