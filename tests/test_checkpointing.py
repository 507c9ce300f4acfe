"""Checkpoint integrity: every damaged file is refused by name or falls back, logged, to the older intact one.

Each case corrupts a copy of a two-checkpoint directory (steps 1 and 2 hold
different states) and checks the right outcome: a `CheckpointError` naming the
checkpoint and the file, or a restore of exactly step 1's state with the
fallback logged and recorded in the meta.
"""

import glob
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from pdm_jax.checkpointing import MANIFEST_NAME, Checkpointer, CheckpointError, abstract_like, nonfinite_leaves


def _state(seed: int, nan_at=None):
    """A TrainState-like pytree: an int step, f32/bf16 params (large enough for a real data file), optimizer moments."""
    embed = jnp.linspace(-1.0, 1.0, 64 * 32, dtype=jnp.float32).reshape(64, 32) + seed
    if nan_at is not None:
        embed = embed.at[nan_at].set(jnp.nan)
    return {"step": jnp.asarray(seed, jnp.int32),
            "params": {"embed": embed, "norm": jnp.full((32,), 1.0 + seed, jnp.bfloat16)},
            "opt_state": {"mu": jnp.full((64, 32), 0.5 * seed, jnp.float32)}}


def _assert_state_equal(got, want):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


ABSTRACT = abstract_like(_state(0))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "checkpoints")
    c = Checkpointer(root, max_to_keep=3)
    c.save(1, _state(1), {"rl_step": 1})
    c.save(2, _state(2), {"rl_step": 2})
    c.close()
    return root


def _copy(src, tmp_path, name="checkpoints"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _files(step_dir):
    return sorted(os.path.relpath(p, step_dir) for p in glob.glob(os.path.join(step_dir, "**"), recursive=True)
                  if os.path.isfile(p))


def _corrupt(path, mode):
    data = open(path, "rb").read()
    if mode == "truncate":
        data = data[: len(data) // 2]
    else:  # flip 16 bytes (all of them in a shorter file) in the middle
        b = bytearray(data)
        start = max(0, len(b) // 2 - 8)
        for i in range(start, min(len(b), start + 16)):
            b[i] ^= 0xFF
        data = bytes(b)
    with open(path, "wb") as f:
        f.write(data)


def test_round_trip_is_exact_and_every_file_is_in_the_manifest(two_checkpoints, tmp_path):
    root = _copy(two_checkpoints, tmp_path)
    c = Checkpointer(root)
    assert c.steps() == [1, 2] and c.latest_step() == 2
    state, meta = c.restore(ABSTRACT)
    _assert_state_equal(state, _state(2))
    assert meta == {"rl_step": 2}
    r = c.restore_latest_intact(ABSTRACT)  # restoring changes no file: it verifies again
    assert (r.step, r.fallbacks, r.meta) == (2, [], {"rl_step": 2})
    manifest = json.load(open(os.path.join(root, "2", MANIFEST_NAME)))
    assert sorted(manifest["files"]) == [f for f in _files(os.path.join(root, "2")) if f != MANIFEST_NAME]
    assert len(manifest["files"]) >= 10  # orbax's metadata, commit markers, OCDBT manifests and data files


def test_flipped_bytes_that_orbax_restores_silently_are_refused(two_checkpoints, tmp_path):
    """The issue's case: orbax alone restores a data file with flipped bytes, values silently changed."""
    root = _copy(two_checkpoints, tmp_path)
    step_dir = os.path.join(root, "2")
    data = max(_files(step_dir), key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
    _corrupt(os.path.join(step_dir, data), "flip")
    raw = ocp.CheckpointManager(root, item_names=("state", "meta")).restore(
        2, args=ocp.args.Composite(state=ocp.args.StandardRestore(ABSTRACT), meta=ocp.args.JsonRestore()))
    changed = int(np.sum(np.asarray(raw["state"]["params"]["embed"]) != np.asarray(_state(2)["params"]["embed"])))
    assert changed > 0  # orbax: silent
    with pytest.raises(CheckpointError, match=f"checkpoint {step_dir}: .*{data} has changed") as e:
        Checkpointer(root).restore(ABSTRACT, 2)
    assert e.value.step == 2 and e.value.path == step_dir


@pytest.mark.parametrize("mode", ["truncate", "flip"])
@pytest.mark.slow
def test_any_damaged_file_of_the_latest_checkpoint_falls_back_to_the_previous(two_checkpoints, tmp_path, caplog, mode):
    """Every file of checkpoint 2 in turn (orbax's files and the manifest): a logged fallback to step 1."""
    files = _files(os.path.join(two_checkpoints, "2"))
    assert MANIFEST_NAME in files and any(f.startswith("state/") for f in files)
    for i, rel in enumerate(files):
        root = _copy(two_checkpoints, tmp_path, f"c{i}")
        _corrupt(os.path.join(root, "2", rel), mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdm_jax.checkpointing"):
            r = Checkpointer(root).restore_latest_intact(ABSTRACT)
        assert r.step == 1, rel
        _assert_state_equal(r.state, _state(1))
        (fb,) = r.fallbacks
        assert (fb["refused_step"], fb["restored_step"]) == (2, 1), rel
        named = MANIFEST_NAME if rel == MANIFEST_NAME else rel
        assert named in fb["reason"], (rel, fb["reason"])
        assert r.meta == {"rl_step": 1, "checkpoint_fallbacks": r.fallbacks}
        assert fb["moved_to"] == root + ".corrupt/2" and os.path.isdir(fb["moved_to"]) and not os.path.exists(
            os.path.join(root, "2"))
        logged = caplog.text
        assert os.path.join(root, "2") in logged and "FALLBACK" in logged and os.path.join(root, "1") in logged, rel


def test_damaged_only_checkpoint_is_a_named_error_and_nothing_is_moved(two_checkpoints, tmp_path):
    root = _copy(two_checkpoints, tmp_path)
    shutil.rmtree(os.path.join(root, "1"))
    _corrupt(os.path.join(root, "2", "meta", "metadata"), "truncate")  # the JSONDecodeError case
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint under {root}: {root}/2: 1 damaged file\(s\): "
                                              r"meta/metadata has 7 bytes, 14 were written") as e:
        Checkpointer(root).restore_latest_intact(ABSTRACT)
    assert e.value.step is None
    assert os.path.isdir(os.path.join(root, "2")) and not os.path.exists(root + ".corrupt")


def test_a_checkpoint_without_its_manifest_is_refused(two_checkpoints, tmp_path):
    """A run killed between orbax's commit and the manifest: checkpoint 2 cannot be trusted."""
    root = _copy(two_checkpoints, tmp_path)
    os.remove(os.path.join(root, "2", MANIFEST_NAME))
    with pytest.raises(CheckpointError, match="no integrity manifest"):
        Checkpointer(root).restore(ABSTRACT, 2)
    r = Checkpointer(root).restore_latest_intact(ABSTRACT)
    assert r.step == 1 and "no integrity manifest" in r.fallbacks[0]["reason"]


def test_unexpected_and_missing_files_are_refused(two_checkpoints, tmp_path):
    root = _copy(two_checkpoints, tmp_path)
    open(os.path.join(root, "2", "state", "extra"), "w").write("x")
    with pytest.raises(CheckpointError, match="state/extra was not written by the save"):
        Checkpointer(root).restore(ABSTRACT, 2)
    os.remove(os.path.join(root, "2", "state", "extra"))
    os.remove(os.path.join(root, "2", "state", "_METADATA"))
    with pytest.raises(CheckpointError, match="state/_METADATA is missing"):
        Checkpointer(root).restore(ABSTRACT, 2)


def test_non_finite_parameters_are_refused(tmp_path):
    root = str(tmp_path / "checkpoints")
    c = Checkpointer(root)
    c.save(1, _state(1), {"rl_step": 1})
    c.save(2, _state(2, nan_at=(3, 5)), {"rl_step": 2})  # intact files, a NaN written by the run itself
    with pytest.raises(CheckpointError, match=r"checkpoint .*/2: non-finite values \(NaN or inf\) in 1 array\(s\): "
                                              r"\['params'\]\['embed'\]"):
        c.restore(ABSTRACT, 2)
    r = c.restore_latest_intact(ABSTRACT)
    assert r.step == 1 and "['params']['embed']" in r.fallbacks[0]["reason"]
    _assert_state_equal(r.state, _state(1))


def test_nonfinite_leaves_names_each_leaf():
    tree = {"a": jnp.array([1.0, jnp.inf]), "b": jnp.array([1, 2]), "c": {"d": jnp.array([jnp.nan], jnp.bfloat16)},
            "e": jnp.zeros(3)}
    assert nonfinite_leaves(tree) == ["['a']", "['c']['d']"]
    assert nonfinite_leaves({"i": jnp.arange(3)}) == []


def test_the_resumed_run_recreates_the_refused_step_and_keeps_the_record(two_checkpoints, tmp_path):
    root = _copy(two_checkpoints, tmp_path)
    _corrupt(os.path.join(root, "2", "_CHECKPOINT_METADATA"), "flip")
    c = Checkpointer(root, max_to_keep=3)
    r = c.restore_latest_intact(ABSTRACT)
    assert r.step == 1
    c.save(2, _state(2), r.meta)  # the step id of the refused checkpoint is free again
    state, meta = Checkpointer(root).restore(ABSTRACT)
    _assert_state_equal(state, _state(2))
    assert meta["checkpoint_fallbacks"][0]["refused_step"] == 2
    c.close()


def test_no_checkpoint_is_file_not_found(tmp_path):
    c = Checkpointer(str(tmp_path / "empty"))
    assert c.latest_step() is None
    with pytest.raises(FileNotFoundError):
        c.restore_latest_intact(ABSTRACT)
    with pytest.raises(FileNotFoundError):
        c.restore(ABSTRACT, 7)


def test_a_per_layer_checkpoint_is_a_layout_error_and_is_neither_skipped_nor_moved(tmp_path):
    """A checkpoint of the pre-scan layout (layers/0/..., layers/1/...) restored into the stacked layout
    ([L, ...] under layers) stops with a message naming the layout; the checkpoint stays where it is."""
    from pdm_jax.checkpointing import CheckpointLayoutError

    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    old = {"params": {"layers": {"0": {"w": w[0]}, "1": {"w": w[1]}}, "norm": jnp.ones(2)}}
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(5, old, {"step": 5})
    stacked = abstract_like({"params": {"layers": {"w": w}, "norm": jnp.ones(2)}})
    with pytest.raises(CheckpointLayoutError, match=r"stores the decoder layers one by one \(params/layers/0/w\)"):
        ckpt.restore_latest_intact(stacked)
    assert ckpt.steps() == [5] and not os.path.exists(str(tmp_path / "ckpt.corrupt"))
    state, _ = ckpt.restore(abstract_like(old))  # the checkpoint itself is intact
    np.testing.assert_array_equal(np.asarray(state["params"]["layers"]["1"]["w"]), [3.0, 4.0, 5.0])
    ckpt.close()


def test_the_layout_error_names_a_parameter_path_and_catches_list_layers(tmp_path):
    """The example path is the parameter's (not an optimizer moment's, which sorts first in a train
    state), and layers stored as a list (layers/[0]/...) are recognised as the per-layer layout too."""
    from pdm_jax.checkpointing import CheckpointLayoutError

    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    old = {"opt_state": ({"mu": {"layers": {"0": {"w": w[0]}, "1": {"w": w[1]}}}},),
           "params": {"layers": {"0": {"w": w[0]}, "1": {"w": w[1]}}}}
    stacked = abstract_like({"opt_state": ({"mu": {"layers": {"w": w}}},), "params": {"layers": {"w": w}}})
    ckpt = Checkpointer(str(tmp_path / "a"))
    ckpt.save(5, old, {"step": 5})
    with pytest.raises(CheckpointLayoutError, match=r"one by one \(params/layers/0/w\)"):
        ckpt.restore_latest_intact(stacked)
    ckpt.close()
    listed = Checkpointer(str(tmp_path / "b"))
    listed.save(3, {"params": {"layers": [{"w": w[0]}, {"w": w[1]}]}}, {"step": 3})
    with pytest.raises(CheckpointLayoutError, match=r"one by one \(params/layers/\[?0\]?/w\)"):
        listed.restore_latest_intact(abstract_like({"params": {"layers": {"w": w}}}))
    assert listed.steps() == [3] and not os.path.exists(str(tmp_path / "b.corrupt"))
    listed.close()
