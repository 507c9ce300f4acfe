"""The sampler service's wire schema: the field names of its HTTP bodies, and its error bodies.

The server and the clients build and read every body with these names (`wire_request`, `wire_response`,
`wire_codec`). The wire follows vLLM's completions API, so three Python names differ::

    Python (SamplingEngine / SamplerClient / RolloutBatch)   wire
    max_new_tokens                                           max_tokens
    top_k_logprobs                                           logprobs
    RolloutBatch.group_ids                                   prompt_index (per choice)

Validation errors (`RequestError`) name fields by their *wire* names, e.g.
``"max_tokens: must be an integer in [1, 256], got 300"``. docs/sampler.md ("The wire schema") lays out the
bodies.
"""

from __future__ import annotations

from typing import Any, Optional

# The limits that validation names travel with the schema; they live in `limits` (no engine, no codec).
from pdm_jax.sampler.limits import (MAX_INT32, MAX_PATH_LENGTH, MAX_SEED, MAX_STOP_TOKEN_IDS,  # noqa: F401
                                    MIN_TEMPERATURE, TOKEN_CHARS, token_problem)


# ----------------------------------------------------------------------------- field names
# POST /v1/generate request
PROMPT = "prompt"
N = "n"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
MAX_TOKENS = "max_tokens"  # Python: max_new_tokens
STOP_TOKEN_IDS = "stop_token_ids"
LOGPROBS = "logprobs"  # Python: top_k_logprobs (also the per-choice sampled log mu in the response)
SEED = "seed"
RETURN_ROUTING = "return_routing"  # Python: return_routing (MoE routing replay)
ROUTED_EXPERTS = "routed_experts"  # per choice: [P_i + T_r, L, k] int, RolloutBatch.routed_experts
FIRST_PROMPT_INDEX = "first_prompt_index"  # per-host rollouts: the request's prompts start at this index
MODEL = "model"  # accepted and ignored in a request; the model's name in responses and /health
STREAM = "stream"  # only false/absent is accepted
#: How the response carries the rows: "choices" (default: one object per row, as vLLM) or "columns" (one packed
#: array per field for all rows, `COLUMNS`: what `SamplerClient` asks for, no per-row objects to build or check).
RESPONSE_FORMAT = "response_format"
RESPONSE_FORMATS = ("choices", "columns")
GENERATE_FIELDS = frozenset({PROMPT, N, TEMPERATURE, TOP_P, TOP_K, MAX_TOKENS, STOP_TOKEN_IDS, LOGPROBS, SEED,
                             FIRST_PROMPT_INDEX, RETURN_ROUTING, MODEL, STREAM, RESPONSE_FORMAT})
DEFAULT_MAX_TOKENS = 16  # max_tokens when a request omits it (vLLM's default)

# POST /v1/generate response
OBJECT = "object"
TEXT_COMPLETION = "text_completion"
WEIGHTS_VERSION = "weights_version"
CHOICES = "choices"
INDEX = "index"
PROMPT_INDEX = "prompt_index"  # Python: RolloutBatch.group_ids
TOKEN_IDS = "token_ids"
TOP_LOGPROBS = "top_logprobs"
IDS = "ids"
FINISH_REASON = "finish_reason"
COLUMNS = "columns"  # response_format "columns": {token_ids [sum T_r], lengths [N], logprobs [sum T_r], top_logprobs
LENGTHS = "lengths"  # {ids, logprobs} [sum T_r, K] or [0, 0] for K = 0 (each row's T_r tokens, row after row;
#                      padded [N,T(,K)] read too), prompt_index [N], finish_reason [N] strings, weights_version [N]
#                      (, routed_experts [N,P+T,L,k])}
USAGE = "usage"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"

# POST /v1/weights request and response; GET /health
PATH = "path"
VERSION = "version"
STATUS = "status"
OK = "ok"
MAX_NEW_TOKENS = "max_new_tokens"  # /health: the server's max_tokens limit
COMPILE_STATS = "compile_stats"  # /v1/weights response: the server process's XLA compile counts so far

# error bodies
ERROR = "error"
MESSAGE = "message"
FIELD = "field"
TYPE = "type"


# ============================================================================= errors
class RequestError(ValueError):
    """An invalid generation or weights request; ``field`` is the offending field's *wire* name.

    ``str(e)`` is ``"<field>: <message>"`` (a field name over 100 characters -- an
    unknown field sent by a client -- is cut there).  The server answers it with HTTP 422.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field if len(field) <= 100 else field[:97] + '...'}: {message}")
        self.field = field


def error_body(message: str, field: Optional[str], kind: str) -> dict:
    """The body of an error response: ``{"error": {"message", "field", "type"}}``."""
    return {ERROR: {MESSAGE: message, FIELD: field, TYPE: kind}}


def error_detail(body: Any) -> Any:
    """The ``error`` object of a decoded error body, or the body itself when it has none (e.g. plain text)."""
    return body.get(ERROR, body) if isinstance(body, dict) else body


def decode_error(body: Any) -> tuple:
    """``(message, field)`` of a decoded error body; message falls back to ``str(body)``, field to None."""
    err = body.get(ERROR, {}) if isinstance(body, dict) else {}
    return err.get(MESSAGE) or str(body), err.get(FIELD)
