"""The rollout engine's batching defaults, defined once (imports nothing: the server's ``--help`` reads them
without JAX).

The run config's schema (`pdm_jax.config`), `pdm_jax.sampler.engine.SamplingEngine`, the server's flags
(`pdm_jax.sampler.server`), the launcher, the supervisor and the dry run all take these values, so a
server started by hand batches as the trainer's own does (tests/test_sampler_defaults.py checks the equalities).
"""

#: The sampler's weight precisions (``sampler.quantization``, the server's ``--quantization``); see quantize.py.
QUANTIZATIONS = ("none", "bf16", "fp8", "int8", "int4", "int2")

#: The largest ``sampler.weight_noise`` (the server's ``--weight_noise``): a relative std of 1 already buries each
#: weight in noise of its own size.
MAX_WEIGHT_NOISE = 1.0

#: How a request's rows are batched: "static" (chunks of ``max_batch_size`` rows run to their longest row)
#: or "continuous" (``max_slots`` slots of one KV cache, a slot whose row stops takes the next pending row).
BATCHING_MODES = ("static", "continuous")
BATCHING = "continuous"
#: The largest batch bucket (rows): bigger static requests run in chunks; continuous batching's slots default.
MAX_BATCH_SIZE = 64
#: Continuous batching's slots; 0 = ``MAX_BATCH_SIZE``.
MAX_SLOTS = 0
#: Continuous batching parks up to ``PARK_ROWS x slots`` rows that outgrow the first cache phase (0 = never).
PARK_ROWS = 2
#: Continuous batching prefills its prompt store this many prompts at a time (0 = the whole request at once).
PREFILL_CHUNK = 0
