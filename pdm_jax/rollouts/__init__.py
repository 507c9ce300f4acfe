"""pdm_jax.rollouts: the trainer's side of rollouts (docs/DESIGN.md §3).

base         Sampler (and InMemorySampler): the protocol every backend below implements
spec         SamplerSpec: the run config's sampler section, typed, read once (what the supervisor takes)
supervisor   SamplerSupervisor: starts, health-checks, restarts and versions the sampler of any mode
client       SamplerClient (msgpack over HTTP to ``pdm_jax.sampler.server``, retries)
launcher     start_sampler_server -> SamplerProcess (a server subprocess the trainer owns)
vllm_client  VLLMSampler: rollouts and weight pushes through a vLLM OpenAI-compatible server
in_process   InProcessSampler: a SamplingEngine in this process (modes in_process, colocated)
producer     RolloutProducer: rollouts sampled ahead of the step (staleness)
queued       the batches sampled ahead, saved with each RL checkpoint and handed back on resume

The service these talk to lives in ``pdm_jax.sampler``, which imports nothing from here.
"""
