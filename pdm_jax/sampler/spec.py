"""`EngineSpec`: the rollout engine's settings, one frozen record built once and passed down.

The server's flags (`add_flags` / `from_flags`), the launcher's argv (`to_argv`), the in-process, colocated and
served engines (`SamplingEngine`) and the trainer's side (`pdm_jax.rollouts.spec.SamplerSpec.engine_spec`) all
read these fields, so a new setting is a field here and its one consumer. Imports no JAX (the server's ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from typing import Optional

from pdm_jax.sampler import defaults
from pdm_jax.sampler.limits import MAX_STOP_TOKEN_IDS

_COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def _flag(default, help: str, **kw):
    """A field that is also a server flag (``--<name>``) and a launcher argument."""
    return dataclasses.field(default=default, metadata=dict(flag=True, help=help, **kw))


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The settings of a `SamplingEngine` (units: tokens, rows, devices). Validated at construction.

    Fields that are server flags carry ``metadata["flag"]``; the rest (buckets, table sizes) are engine-only
    knobs that tests and benchmarks change.

    Attributes:
      quantization: ``"none"`` (f32, bit-compatible with the trainer), ``"bf16"``,
        ``"fp8"`` (e4m3 weight-only, per-output-channel) or ``"int8"`` / ``"int4"`` / ``"int2"`` (weight-only, per
        channel; int2 a stress lever only; see quantize.py).
      weight_noise: relative std of the fixed Gaussian perturbation of the sampler's copy
        (`quant.prepare_sampler_params`' ``weight_noise``; ``sampler.weight_noise``, the dialable
        behaviour/trainer mismatch lever), in [0, 1]; 0 = none.
      weight_noise_seed: its seed, an integer in [0, 2**32); the same draws for every version.
      compute_dtype: activations/weights/KV-cache dtype of the sampler forward:
        ``None``/``"auto"`` (`engine.resolve_compute_dtype`, which refuses other values: f32 for none, and for
        bf16/fp8/int8/int4 f32 on the CPU backend, bf16 on TPU/GPU), ``"float32"`` or ``"bfloat16"``.
        The bf16/fp8/int8/int4 weights are rounded / quantized-dequantized once per version
        and then held in this dtype, so f32 keeps their values exactly; logits are
        always f32.
      max_prompt_length: longest accepted prompt (tokens); also the largest prompt bucket.
      max_new_tokens: largest accepted ``max_new_tokens``; the largest decode bucket.
      max_batch_size: largest batch bucket; bigger requests run in chunks.
      min_prompt_bucket: smallest prompt bucket (fewer compiles for short prompts).
      min_new_tokens_bucket: smallest decode bucket (the loop still stops at the
        requested max_new_tokens; a larger bucket costs cache memory and attention
        over masked slots).
      first_cache_segment: the KV cache starts with ``P + first_cache_segment``
        slots and doubles while decoding (`cache_segments`); each extra segment
        adds one copy of the decode loop to the compiled program.
      max_stop_tokens: capacity of the per-row stop-id table.
      max_sequences: most sequences (prompts x n) one request may ask for.
      batching: ``"static"`` (chunks of up to ``max_batch_size`` rows, each run until its longest
        row stops, `static_batching`) or ``"continuous"`` (the default, `pdm_jax.sampler.defaults`;
        `continuous_batching`: the whole request queued into ``max_slots`` slots of one static cache; a slot whose row
        stops takes the next pending row; same tokens and log mu as static, tests).
      max_slots: slots of the continuous cache (None: ``max_batch_size``; rounded up to a power
        of two); every continuous request runs in this many slots, or max_slots / 4 for a request of at most
        that many rows (when the row shards divide it; few shapes: bounded compiles).
      share_prefill: prefill each prompt once for its n samples and repeat its KV cache
        (`_generate_program`'s ``group``) when a batch chunk holds whole groups of n rows
        and its bucket is a multiple of n (n a power of two, ``max_batch_size`` a multiple
        of n); otherwise every row is prefilled. Same numbers either way (tests).
      park_rows: continuous batching parks up to ``park_rows x max_slots`` rows that outgrow the first
        cache phase while rows are pending (`_continuous_program`; 0: never), so the short first-phase
        cache serves the queue; the same tokens either way (tests), fewer attention reads with mixed
        lengths (bench/bench_continuous_batching.py), ``park_rows x slots x (P + T/4)`` more cache entries.
      prefill_chunk: continuous batching prefills its prompt store this many prompts at a time (a loop over
        chunks; 0: the whole request at once), which bounds the prefill's attention: four f32
        ``[prompts, heads, P, P]`` buffers per layer (16 GiB per device for 64 prompts of 2,048 tokens, 4 heads a
        device).

    Raises:
      ValueError: naming the field and its value: an unknown quantization or batching mode, a
        weight noise outside [0, ``defaults.MAX_WEIGHT_NOISE``] or seed outside [0, 2**32), a size that is not an
        integer >= 1 (``park_rows``, ``prefill_chunk``: >= 0; ``max_slots`` None: as ``max_batch_size``).
    """

    quantization: str = _flag("none", "weight precision of the sampler's copy (pdm_jax.sampler.quantize)",
                              options=defaults.QUANTIZATIONS)
    compute_dtype: str = _flag("auto", "dtype the engine computes in (auto: f32 for none and on CPU, bf16 for the "
                                       "quantized copies on TPU/GPU)", options=_COMPUTE_DTYPES)
    weight_noise: float = _flag(0.0, "relative std of a fixed Gaussian perturbation of the sampler's weights, the "
                                     f"same draws for every version (in [0, {defaults.MAX_WEIGHT_NOISE}]; 0 = none; "
                                     "pdm_jax.sampler.quantize)")
    weight_noise_seed: int = _flag(0, "seed of --weight_noise's draws, in [0, 2**32)")
    max_prompt_length: int = _flag(512, "longest accepted prompt (tokens); the largest prompt bucket")
    max_new_tokens: int = _flag(256, "largest accepted max_tokens (tokens); the largest decode bucket")
    max_batch_size: int = _flag(defaults.MAX_BATCH_SIZE, "largest batch bucket (rows); bigger static requests run "
                                                         "in chunks")
    batching: str = _flag(defaults.BATCHING, "static: chunks of --max_batch_size rows run to their longest row; "
                                             "continuous: --max_slots slots refilled as rows stop",
                          options=defaults.BATCHING_MODES)
    max_slots: Optional[int] = _flag(None, "continuous batching's slots (0 = --max_batch_size)", type=int,
                                     none_as=defaults.MAX_SLOTS)
    park_rows: int = _flag(defaults.PARK_ROWS, "continuous batching: park up to this many x max_slots rows that "
                                               "outgrow the first cache phase (0 = never)", config=(
        "Continuous batching parks up to park_rows x slots rows that outgrow the first cache phase (P + T/4 slots) "
        "while rows are pending and refills their slots, so the queue runs in the short cache: same tokens, "
        "1.11-1.24x useful tokens/s on mixed lengths, park_rows x slots x (P + T/4) more cache entries (the dry run "
        "counts them); 0 = never (docs/benchmarks.md, bench/bench_continuous_batching.py --modes "
        "continuous_nopark,continuous). park_rows counts rows per slot (unit: x slots)."))
    prefill_chunk: int = _flag(defaults.PREFILL_CHUNK, "continuous batching: prompts prefilled at once into the "
                                                       "prompt store (0 = the whole request)", config=(
        "Continuous batching prefills the prompt store this many prompts at a time (0 = the whole request at once; "
        "rounded to a divisor of the store that the engine's data axis divides): the prefill's attention holds four "
        "f32 [prompts, heads, P, P] buffers per layer, so this bounds the engine's largest temporary (the dry run "
        "counts it); the same rollouts either way (bit for bit in f32 on one device, else within float rounding; "
        "tests) (unit: prompts)."))
    mesh_data: int = _flag(1, "the sharded engine's data axis (rows); with --mesh_tensor, the first data x tensor "
                              "of this process's devices (make_sampler_mesh); 1 x 1 = one device")
    mesh_tensor: int = _flag(1, "the sharded engine's tensor axis (heads / MLP)")
    min_prompt_bucket: int = 8
    min_new_tokens_bucket: int = 16
    first_cache_segment: int = 64
    max_stop_tokens: int = MAX_STOP_TOKEN_IDS
    max_sequences: int = 4096
    share_prefill: bool = True

    def __post_init__(self):
        if self.compute_dtype is None:
            object.__setattr__(self, "compute_dtype", "auto")
        for name, choices in (("quantization", defaults.QUANTIZATIONS), ("batching", defaults.BATCHING_MODES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"EngineSpec: {name} must be one of {choices}, got {getattr(self, name)!r}")
        noise = self.weight_noise
        if isinstance(noise, bool) or not isinstance(noise, numbers.Real) \
                or not 0.0 <= noise <= defaults.MAX_WEIGHT_NOISE:
            raise ValueError(f"EngineSpec: weight_noise must be a number in [0, {defaults.MAX_WEIGHT_NOISE}], "
                             f"got {noise!r}")
        if not _is_int(self.weight_noise_seed) or not 0 <= self.weight_noise_seed < 2**32:
            raise ValueError(f"EngineSpec: weight_noise_seed must be an integer in [0, 2**32), "
                             f"got {self.weight_noise_seed!r}")
        for name in ("max_prompt_length", "max_new_tokens", "max_batch_size", "mesh_data", "mesh_tensor",
                     "min_prompt_bucket", "min_new_tokens_bucket", "first_cache_segment", "max_stop_tokens",
                     "max_sequences", "max_slots", "park_rows", "prefill_chunk"):
            v, lo = getattr(self, name), 0 if name in ("park_rows", "prefill_chunk") else 1
            if name == "max_slots" and v is None:  # as max_batch_size
                continue
            if not _is_int(v) or v < lo:
                raise ValueError(f"EngineSpec: {name} must be an integer >= {lo}, got {v!r}")

    @classmethod
    def config_fields(cls) -> tuple:
        """The fields that are also run-config fields ``sampler.<name>`` (``metadata["config"]``: their description
        in docs/configuration.md): the schema, its validation and `SamplerSpec` take them from here by name."""
        return tuple(f for f in dataclasses.fields(cls) if "config" in f.metadata)

    @classmethod
    def of_config_fields(cls, section) -> "EngineSpec":
        """The spec (other fields at their defaults) of the `config_fields` values in ``section`` (a run config's
        ``sampler`` section, or anything with those fields). Raises ValueError naming a refused field."""
        return cls(**{f.name: getattr(section, f.name) for f in cls.config_fields()})

    @classmethod
    def flag_fields(cls) -> tuple:
        """The fields that are server flags and launcher arguments."""
        return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("flag"))

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, defaults_: Optional[dict] = None) -> None:
        """One ``--<field>`` per flag field (type, default, choices and help from the field); ``defaults_``
        overrides defaults (the server serves fp8 unless told otherwise)."""
        for f in cls.flag_fields():
            default = (defaults_ or {}).get(f.name, f.default)
            kw = dict(type=f.metadata.get("type", type(f.default)), help=f.metadata["help"],
                      default=f.metadata["none_as"] if default is None else default)
            if "options" in f.metadata:
                kw.update(choices=f.metadata["options"])
            parser.add_argument(f"--{f.name}", **kw)

    @classmethod
    def from_flags(cls, args: argparse.Namespace, **engine_only) -> "EngineSpec":
        """The spec of parsed flags (`add_flags`), plus engine-only fields."""
        values = {f.name: getattr(args, f.name) for f in cls.flag_fields()}
        values.update({f.name: None for f in cls.flag_fields() if "none_as" in f.metadata
                       and values[f.name] == f.metadata["none_as"]})
        return cls(**values, **engine_only)

    def to_argv(self) -> list:
        """The server flags that rebuild this spec there (``--<field>=<value>``, floats by ``repr``)."""
        argv = []
        for f in self.flag_fields():
            v = getattr(self, f.name)
            v = f.metadata["none_as"] if v is None and "none_as" in f.metadata else v
            argv.append(f"--{f.name}={v!r}" if isinstance(v, float) else f"--{f.name}={v}")
        return argv

    def engine_only(self) -> dict:
        """The fields that are not flags (a server builds them at their defaults)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("flag")}


def _is_int(v) -> bool:
    """An integer (Python or numpy), never a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)

