"""Wire shapes of the tokens-only engine route and the render tier (vLLM 0.33, section 10 of the spec).

* `GenerateRequest`: what `/v1/*/render` returns and `POST /inference/v1/generate` accepts.
* `GenerateTokensResponse` / stream chunks: what the engine answers (parsed again by derender).
* Derender bodies: the generate response (or one stream chunk) plus the client's original request.

Token ids are strict non-negative integers everywhere (`"5"`, `5.0` and `true` are refused, not coerced).
No torch here: both the engine server and the torch-free render tier import this module.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt

from pdserve.api.openai.protocol import INT64_MAX, INT64_MIN, OpenAIBaseModel, StreamOptions

TokenId = Annotated[StrictInt, Field(ge=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]

# Detokeniser window and logprob context bounds carried in a derender stream_state.
MAX_STATE_TOKENS = 1024


def random_request_id() -> str:
    return uuid.uuid4().hex


# ---- POST /inference/v1/generate ---------------------------------------------------------------------
class GenerateSamplingParams(OpenAIBaseModel):
    """`SamplingParams` field names. Fields left out get the model's generation defaults, and `max_tokens`
    the room left in the context (capped by generation_config's max_new_tokens)."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # None: generation_config's default
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None
    extra_args: dict[str, Any] | None = None


class GenerateRequest(OpenAIBaseModel):
    request_id: str = Field(default_factory=random_request_id)
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    token_offsets: list[int] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    features: Any = None
    content_parts: Any = None


class TopTokenLogprob(OpenAIBaseModel):
    token_id: TokenId
    logprob: float
    rank: int | None = None


class TokenLogprobEntry(OpenAIBaseModel):
    token_id: TokenId
    logprob: float
    rank: int | None = None
    top_logprobs: list[TopTokenLogprob] = Field(default_factory=list)


class TokensLogprobs(OpenAIBaseModel):
    content: list[TokenLogprobEntry] = Field(default_factory=list)


class GenerateChoice(OpenAIBaseModel):
    index: NonNegInt = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: TokensLogprobs | None = None
    text: str | None = None  # output_mode "text" only
    routed_experts: Any = None
    sampling_mask: Any = None
    weight_versions: Any = None


class GenerateUsage(OpenAIBaseModel):
    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0
    total_tokens: NonNegInt = 0


class GenerateTokensResponse(OpenAIBaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    output_mode: str = "tokens"
    choices: list[GenerateChoice]
    usage: GenerateUsage | None = None
    prompt_logprobs: Any = None
    prompt_token_id_logprobs: Any = None
    prompt_token_ids: list[TokenId] | None = None
    mm_placeholders: Any = None
    metrics: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class GenerateTokensStreamResponse(GenerateTokensResponse):
    """One SSE chunk: `choices[].token_ids` are the delta; the usage-only last chunk has no choices."""


class AbortRequestsBody(OpenAIBaseModel):
    request_ids: list[str]


# ---- derender ----------------------------------------------------------------------------------------
class ChoiceStreamState(OpenAIBaseModel):
    """One choice's resumable state. Bounded: nothing in it grows with the output's length, except the
    text of a tool call that is still open (see `pdserve.text.tool_parsers`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    index: NonNegInt
    prev_tokens: Annotated[list[TokenId], Field(max_length=MAX_STATE_TOKENS)]  # detokeniser window
    read_offset: NonNegInt  # window[:read_offset] is text already decoded (the context of the next token)
    role_sent: StrictBool = False
    num_output_tokens: NonNegInt = 0
    text_len: NonNegInt = 0  # characters of output text emitted so far (completions logprob offsets)
    stop_tail: str = ""  # end of the text, for stop strings (bounded by the longest stop string)
    unemitted: NonNegInt = 0  # characters at the end of stop_tail held back (could start a stop string)
    finished: StrictBool = False
    parser: dict[str, Any] | None = None


class DerenderStreamState(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    version: Literal[1] = 1
    choices: Annotated[list[ChoiceStreamState], Field(max_length=128)] = Field(default_factory=list)


class _DerenderBase(OpenAIBaseModel):
    model: str | None = None
    stream: bool = False
    generate_response: GenerateTokensResponse | None = None
    generate_chunk: GenerateTokensStreamResponse | None = None
    stream_state: DerenderStreamState | None = None


class ChatDerenderRequest(_DerenderBase):
    prompt_tokens: NonNegInt | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: dict[str, Any] | None = None


class CompletionDerenderRequest(_DerenderBase):
    generate_responses: list[GenerateTokensResponse] | None = None
    prompt_tokens: list[NonNegInt] | NonNegInt | None = None
    prompt_token_ids: list[list[TokenId] | None] | None = None
    prompt_index: NonNegInt = 0  # streaming: which prompt of the request this generate stream is
    completion_request: dict[str, Any] | None = None
