"""`SamplerSpec`: the typed piece of the run config that the trainer's side of rollouts takes.

The run config is validated once (`pdm_jax.config.validate_config`); `SamplerSpec.from_config` then reads its
``sampler`` section into this frozen record, field by field, with no fallbacks: every default lives once, in the
schema (`pdm_jax.config.get_base_config`; documented in docs/configuration.md). `SamplerSupervisor` takes a spec,
never the ConfigDict. Tests and tools that need another setting build the spec from the base config and change a
field with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses

from pdm_jax.sampler.spec import EngineSpec


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The sampler settings of a run (docs/configuration.md, section ``sampler``).

    Fields keep the schema's names and units: ``mode`` as configured ("auto" is resolved by the supervisor,
    `config.resolve_sampler_mode`), lengths in tokens, batch sizes in sequences, timeouts and probe intervals in
    seconds, ``mesh_data`` x ``mesh_tensor`` the sampler engine's device mesh (``sampler.mesh``); ``engine`` carries
    the engine settings that `EngineSpec` declares as run-config fields, unnamed here.
    """

    mode: str
    address: str
    token: str
    backend: str
    quantization: str
    weight_noise: float
    weight_noise_seed: int
    compute_dtype: str
    max_prompt_length: int
    max_batch_size: int
    batching: str
    max_slots: int
    mesh_data: int
    mesh_tensor: int
    startup_timeout_s: float
    request_timeout_s: float
    retries: int
    max_restarts: int
    stall_probe_interval_s: float
    stall_probe_timeout_s: float
    stall_probe_misses: int
    vllm_model: str
    vllm_weights_dir: str
    engine: EngineSpec = EngineSpec()  # the run-config fields EngineSpec declares (`EngineSpec.config_fields`)

    def __post_init__(self):
        """Raises ValueError for a non-positive probe interval or timeout, or a probe miss count that is not an
        integer >= 0 (the schema's checks, again for a spec changed with `dataclasses.replace`)."""
        misses = self.stall_probe_misses
        if not (self.stall_probe_interval_s > 0 and self.stall_probe_timeout_s > 0) or isinstance(misses, bool) \
                or not isinstance(misses, int) or misses < 0:
            raise ValueError(f"SamplerSpec: need stall_probe_interval_s > 0, stall_probe_timeout_s > 0 and an "
                             f"integer stall_probe_misses >= 0; got {self.stall_probe_interval_s}, "
                             f"{self.stall_probe_timeout_s}, {misses!r}")

    def engine_spec(self, *, max_new_tokens: int, **changes) -> EngineSpec:
        """The rollout engine's settings (`EngineSpec`): ``engine`` with every engine field this spec names, taken
        by name, ``max_new_tokens`` (the run's longest completion, tokens), and ``changes`` (EngineSpec fields, e.g.
        ``weight_noise=0.0``).

        Raises:
          ValueError: a value `EngineSpec` refuses (naming the field).
        """
        values = {}
        for f in EngineSpec.flag_fields():
            if hasattr(self, f.name):
                v = getattr(self, f.name)
                values[f.name] = None if v == f.metadata.get("none_as", object()) else v
        return dataclasses.replace(self.engine, **{**values, "max_new_tokens": int(max_new_tokens), **changes})

    @classmethod
    def from_config(cls, sampler) -> "SamplerSpec":
        """The spec of a validated config's ``sampler`` section (a ConfigDict, or anything with its fields).

        Raises:
          AttributeError: naming a field the section lacks (a section that is not the schema's).
        """
        return cls(
            mode=str(sampler.mode), address=str(sampler.address), token=str(sampler.token),
            backend=str(sampler.backend), quantization=str(sampler.quantization),
            weight_noise=float(sampler.weight_noise), weight_noise_seed=int(sampler.weight_noise_seed),
            compute_dtype=str(sampler.compute_dtype), max_prompt_length=int(sampler.max_prompt_length),
            max_batch_size=int(sampler.max_batch_size), batching=str(sampler.batching),
            max_slots=int(sampler.max_slots), mesh_data=int(sampler.mesh.data),
            mesh_tensor=int(sampler.mesh.tensor), startup_timeout_s=float(sampler.startup_timeout_s),
            request_timeout_s=float(sampler.request_timeout_s), retries=int(sampler.retries),
            max_restarts=int(sampler.max_restarts), stall_probe_interval_s=float(sampler.stall_probe_interval_s),
            stall_probe_timeout_s=float(sampler.stall_probe_timeout_s),
            stall_probe_misses=sampler.stall_probe_misses, vllm_model=str(sampler.vllm_model),
            vllm_weights_dir=str(sampler.vllm_weights_dir), engine=EngineSpec.of_config_fields(sampler))
