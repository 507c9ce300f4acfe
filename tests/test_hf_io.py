"""HF safetensors I/O: key map, bit-exact round trips, sharded loading, and bad checkpoints."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from pdm_jax import sharding as shd
from pdm_jax.models import hf_io
from pdm_jax.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=10_000.0)
TIED = Qwen3Config(**{**CFG.__dict__, "tie_word_embeddings": True})


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(1))


def _flat(m):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def _assert_bit_equal(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        assert fa[k].tobytes() == fb[k].tobytes(), k


def test_key_map_is_a_bijection_with_hf_shapes(model):
    tensors = hf_io.hf_state_dict(model)
    flat = _flat(model)
    paths = [".".join(map(str, p)) for p in flat]
    assert len(paths) == 3 + 11  # embedding, final norm, lm_head + the 11 stacked layer params
    entries = [e for p, v in flat.items() for e in hf_io.tensor_entries(".".join(map(str, p)), v.shape)]
    assert len(tensors) == len(entries) == 2 + 1 + 11 * CFG.num_hidden_layers
    for e in entries:  # every HF tensor is one row of one stacked parameter (or a whole one)
        path, num_in = hf_io.hf_to_nnx(e.name)
        assert num_in == e.num_in_axes and hf_io.nnx_to_hf(path) == (e.name, num_in)
        assert (e.layer is None) == (not path.startswith("layers."))
        if e.layer is not None:
            assert path.startswith(f"layers.{e.layer}.")
    N, K, H, D, F, V = 4, 2, 8, 32, 48, 64
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (N * H, D)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (K * H, D)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (D, N * H)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (D, F)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (H,)
    assert tensors["lm_head.weight"].shape == (V, D)
    # HF Linear: y = x @ W.T. Our q kernel [D, N, H]: y[n, h] = x @ kernel[:, n, h].
    x = np.random.RandomState(0).randn(D).astype(np.float32)
    q_kernel = np.asarray(model.layers.self_attn.q_proj.kernel.get_value()[0])
    np.testing.assert_allclose(tensors["model.layers.0.self_attn.q_proj.weight"] @ x,
                               np.einsum("d,dnh->nh", x, q_kernel).reshape(-1), rtol=1e-5)
    o_kernel = np.asarray(model.layers.self_attn.o_proj.kernel.get_value()[0])
    z = np.random.RandomState(1).randn(N, H).astype(np.float32)
    np.testing.assert_allclose(tensors["model.layers.0.self_attn.o_proj.weight"] @ z.reshape(-1),
                               np.einsum("nh,nhd->d", z, o_kernel), rtol=1e-5, atol=1e-6)
    assert hf_io.hf_to_nnx("model.layers.0.self_attn.q_proj.bias") is None
    with pytest.raises(ValueError, match="no HF key rule"):
        hf_io.nnx_to_hf("layers.0.mlp.experts.kernel")


def test_round_trip_single_file_f32(model, tmp_path):
    files = hf_io.save_pretrained(model, str(tmp_path))
    assert files == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    with open(tmp_path / "config.json") as f:
        assert Qwen3Config.from_hf_dict(json.load(f)) == CFG
    _assert_bit_equal(model, hf_io.from_pretrained(str(tmp_path)))


def test_round_trip_sharded_bf16_with_index(tmp_path):
    m = Qwen3ForCausalLM(TIED, rngs=nnx.Rngs(2), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    files = hf_io.save_pretrained(m, str(tmp_path), max_shard_size="6KB")
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    tensors = {}
    for fname in files:
        part = load_file(str(tmp_path / fname))
        assert all(index["weight_map"][k] == fname for k in part)
        tensors.update(part)
    assert set(index["weight_map"]) == set(tensors) and "lm_head.weight" not in tensors
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].dtype == jnp.bfloat16
    back = hf_io.from_pretrained(str(tmp_path), dtype=jnp.bfloat16)
    _assert_bit_equal(m, back)
    # Saving again into the same directory as a single file removes the stale index.
    hf_io.save_pretrained(back, str(tmp_path / "again"))
    _assert_bit_equal(m, hf_io.from_pretrained(str(tmp_path / "again"), dtype=jnp.bfloat16))


def test_load_with_mesh_places_each_param_on_its_sharding(model, tmp_path):
    hf_io.save_pretrained(model, str(tmp_path), max_shard_size="20KB")
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    loaded = hf_io.from_pretrained(str(tmp_path), mesh=mesh)
    _assert_bit_equal(model, loaded)
    q = loaded.layers.self_attn.q_proj.kernel.get_value()
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)  # the layer axis is never sharded
    assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    assert loaded.lm_head.kernel.get_value().sharding.spec == P("fsdp", "tensor")
    assert loaded.layers.mlp.down_proj.kernel.get_value().sharding.spec == P(None, "tensor", "fsdp")
    # Rules that split inner (flattened) axes: head_dim over tensor, heads replicated.
    rules = tuple((k, "tensor") if k == "head_dim" else (k, None) if k in ("heads", "kv_heads")
                  else (k, v) for k, v in shd.DEFAULT_RULES)
    loaded2 = hf_io.from_pretrained(str(tmp_path), mesh=mesh, rules=rules)
    _assert_bit_equal(model, loaded2)
    o = loaded2.layers.self_attn.o_proj.kernel.get_value()
    assert o.sharding.spec == P(None, None, "tensor", "fsdp")
    assert o.addressable_shards[0].data.shape == (2, 4, 4, 16)
    # Saving a sharded model gathers each tensor: same bytes as the unsharded save.
    hf_io.save_pretrained(loaded2, str(tmp_path / "from_sharded"))
    _assert_bit_equal(model, hf_io.from_pretrained(str(tmp_path / "from_sharded")))


def test_tied_checkpoint_with_lm_head_alias_is_accepted(tmp_path):
    m = Qwen3ForCausalLM(TIED, rngs=nnx.Rngs(3))
    hf_io.save_pretrained(m, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _assert_bit_equal(m, hf_io.from_pretrained(str(tmp_path)))


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit,pattern", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
     r"unexpected tensors: \['model.layers.0.self_attn.q_proj.bias'\]"),
    (lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(32, np.float32)}),
     "model.layers.2.input_layernorm.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 32),
                                                                            np.float32)}),
     r"'model.layers.0.self_attn.k_proj.weight' has shape \(32, 32\), expected \(16, 32\)"),
])
def test_bad_checkpoints_name_the_tensor(model, tmp_path, edit, pattern):
    hf_io.save_pretrained(model, str(tmp_path))
    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=pattern):
        hf_io.from_pretrained(str(tmp_path))


def test_bad_config_and_layout_errors(model, tmp_path):
    hf_io.save_pretrained(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, f)
    with pytest.raises(ValueError, match="rope_scaling"):
        hf_io.from_pretrained(str(tmp_path))
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "attention_bias": True}, f)
    with pytest.raises(ValueError, match="attention_bias"):
        hf_io.from_pretrained(str(tmp_path))
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.from_pretrained(str(tmp_path))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf_io.from_pretrained(str(tmp_path))


def test_layer_count_mismatch_names_num_hidden_layers(model, tmp_path):
    hf_io.save_pretrained(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:  # a typo: 360 for 2 layers
        json.dump({**cfg, "num_hidden_layers": 360}, f)
    with pytest.raises(ValueError, match=r"num_hidden_layers = 360 in config.json, but the "
                                         r"tensors hold layers 0-1 \(2 layers\)") as e:
        hf_io.from_pretrained(str(tmp_path))
    assert len(str(e.value)) < 3000, len(str(e.value))  # 358 x 11 names are not all listed
    assert "and 3926 more" in str(e.value)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    _rewrite(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.0.")])
    with pytest.raises(ValueError, match=r"num_hidden_layers = 2 in config.json, but the tensors "
                                         r"hold layers 1 \(1 layer\).*missing tensors: "
                                         r"\['model.layers.0.input_layernorm.weight'"):
        hf_io.from_pretrained(str(tmp_path))


def test_index_pointing_to_missing_shard(model, tmp_path):
    files = hf_io.save_pretrained(model, str(tmp_path), max_shard_size="20KB")
    assert len(files) >= 2
    os.remove(tmp_path / files[1])
    with pytest.raises(ValueError, match=f"shard file '{files[1]}'.*does not exist"):
        hf_io.from_pretrained(str(tmp_path))


def test_parse_size():
    assert hf_io.parse_size("5GB") == 5 * 10**9
    assert hf_io.parse_size("500MiB") == 500 * 2**20
    assert hf_io.parse_size(123) == 123
    for bad in ("lots", 0, -5, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            hf_io.parse_size(bad)


def test_load_hf_state_dict_round_trip(model):
    tensors = hf_io.hf_state_dict(model)
    other = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(9))
    hf_io.load_hf_state_dict(other, tensors)
    _assert_bit_equal(model, other)
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="model.extra.weight"):
        hf_io.load_hf_state_dict(other, tensors)


def test_failed_load_hf_state_dict_leaves_the_model_unchanged(model):
    other = Qwen3ForCausalLM(CFG, rngs=nnx.Rngs(9))
    before = _flat(other)
    for edit in ({"model.extra.weight": np.zeros(3, np.float32)},
                 {"model.layers.1.mlp.up_proj.weight": np.zeros((48, 33), np.float32)}):
        tensors = {**hf_io.hf_state_dict(model), **edit}
        with pytest.raises(ValueError, match=next(iter(edit))):
            hf_io.load_hf_state_dict(other, tensors)
        after = _flat(other)
        for k in before:  # nothing written, not even the tensors read before the bad one
            assert before[k].tobytes() == after[k].tobytes(), k
