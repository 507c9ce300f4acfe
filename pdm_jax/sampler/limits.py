"""The sampler's bounds that the run config checks without loading the engine: stop-id capacity, temperature,
seed, int32 and path limits, the bearer-token character set, and the engine's mesh check."""

from __future__ import annotations

import string
from typing import Optional


#: Stop ids a request may carry (the engine's default per-row stop table, ``SamplingEngine(max_stop_tokens=)``).
MAX_STOP_TOKEN_IDS = 8
MIN_TEMPERATURE = 1e-3  # smallest positive sampling temperature (z / tau must stay finite in f32)
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1  # largest top_k and weights version (both travel as int32)
MAX_PATH_LENGTH = 4096  # longest accepted /v1/weights path (PATH_MAX on Linux)


#: The characters of a bearer token (RFC 6750 ``b64token``), which an ``Authorization`` header carries as is.
TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~+/=")


def token_problem(token: str) -> Optional[str]:
    """Why ``token`` cannot serve as a shared bearer token, or None when it can.

    A token with a space, a control or a non-ASCII character would be accepted by a server at start-up
    and then match no client's ``Authorization: Bearer <token>`` header (HTTP strips the spaces, and
    clients encode headers as Latin-1 or refuse): every request would get 401. The message never
    repeats the token itself.
    """
    if not isinstance(token, str) or not token:
        return "must be a non-empty string"
    bad = sorted({c for c in token if c not in TOKEN_CHARS})
    if bad:
        return (f"holds {len(bad)} character(s) outside RFC 6750's token set (ASCII letters, digits and -._~+/=), "
                f"e.g. {ascii(bad[0])}: no client could send it, every request would be refused")
    return None


def check_engine_mesh(config, mesh, *, max_batch_size: int, max_slots: int) -> int:
    """Refuses a mesh the engine cannot split evenly; returns the row shards (data x fsdp).

    The tensor axis must divide the attention heads, the kv heads (the KV cache's sharded axis)
    and the MLP widths (``intermediate_size``; MoE also ``moe_intermediate_size``); the row shards must divide
    ``max_batch_size`` and ``max_slots`` (rows are split over them).  ``pdm_jax.sharding`` would
    silently replicate a non-dividing axis; a sampler that was asked to shard says so instead.
    Raises:
      ValueError: naming the model field or limit, its value and the axis size.
    """
    from pdm_jax.sharding import MESH_AXES  # imports JAX: only when a mesh is checked (the server's --help)

    sizes = dict(mesh.shape)
    missing = [a for a in MESH_AXES if a not in sizes]
    if missing:
        raise ValueError(f"SamplingEngine: mesh axes {tuple(sizes)} lack {missing} (use make_sampler_mesh)")
    t, rows = sizes["tensor"], sizes["data"] * sizes["fsdp"]
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size"]
    fields += ["moe_intermediate_size"] if getattr(config, "num_experts", 0) else []
    for field, v in ((f, getattr(config, f)) for f in fields):
        if v % t:
            raise ValueError(f"SamplingEngine: model {field} = {v} is not divisible by the mesh's tensor axis "
                             f"({t}); pick sampler.mesh.tensor dividing it")
    for field, v in (("max_batch_size", max_batch_size), ("max_slots", max_slots)):
        if v % rows:
            raise ValueError(f"SamplingEngine: {field} = {v} is not divisible by the mesh's row shards "
                             f"(data x fsdp = {rows}); rows are split over them")
    return rows
