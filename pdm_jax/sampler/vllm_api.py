"""vLLM's OpenAI-compatible server vocabulary: routes, request options and answer fields of its completions API.

What `pdm_jax.rollouts.vllm_client` sends and reads, and what the fake server `pdm_jax.sampler.vllm_fake` answers
(vLLM docs: "OpenAI-Compatible Server", the completions API's extra parameters, "Weight Transfer"; the dev-mode
routes need VLLM_SERVER_DEV_MODE=1). Request fields shared with our own schema (prompt, n, temperature, top_p,
top_k, max_tokens, stop_token_ids, logprobs, seed, model) keep their names in `pdm_jax.sampler.wire`. Imports
nothing.
"""

VLLM_COMPLETIONS = "/v1/completions"
VLLM_MODELS = "/v1/models"
VLLM_HEALTH = "/health"
VLLM_PAUSE = "/pause"  # dev mode: stop scheduling (mode=wait: let running requests finish), clear caches
VLLM_RESUME = "/resume"
VLLM_COLLECTIVE_RPC = "/collective_rpc"  # dev mode: {"method", "args", "kwargs"} run on every worker
VLLM_RESET_PREFIX_CACHE = "/reset_prefix_cache"  # dev mode: drop KV blocks computed with the old weights
VLLM_RELOAD_METHOD = "reload_weights"  # worker method: reload the weights in place from kwargs weights_path
VLLM_WEIGHTS_PATH = "weights_path"
RETURN_TOKENS_AS_TOKEN_IDS = "return_tokens_as_token_ids"  # tokens come back as "token_id:<id>" strings
IGNORE_EOS = "ignore_eos"  # stop only on stop_token_ids (ours), never on the served model's own eos
ECHO = "echo"
TEXT = "text"
TOKENS = "tokens"  # logprobs.tokens: one string per generated token
TOKEN_LOGPROBS = "token_logprobs"  # logprobs.token_logprobs: log-probability of each generated token
TEXT_OFFSET = "text_offset"
STOP_REASON = "stop_reason"  # the stop token id (int) or string that ended a choice, or null
DATA = "data"
ID = "id"
TOKEN_ID_PREFIX = "token_id:"
#: vLLM writes a -inf log-probability as this number (JSON has no -inf); read back as -inf in top-K tables.
VLLM_MIN_LOGPROB = -9999.0
#: Sampling parameters sent explicitly at their neutral values, so that no server default (e.g. from the
#: served model's generation_config.json) changes the distribution the rollouts are drawn from.
VLLM_NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                         "min_p": 0.0, "min_tokens": 0}
