"""OpenAI request schemas as vLLM's server accepts them, and the /v1/models listing.

Requests ignore unknown fields (a proxy passes through whatever the client sent). Non-finite floats are
rejected at parse time: NaN would slip through every range check. Responses are built as plain dicts by
the views in serving_completion.py, serving_chat.py and tokens_only.py. No torch here: the render tier
reuses these models.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


# ---- shared request pieces --------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ResponseFormat(OpenAIBaseModel):
    type: str
    json_schema: dict[str, Any] | None = None
    # type "structural_tag" (vLLM's): {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: Any = None


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat (OpenAI's and vLLM's extra sampling parameters)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields
    # vLLM's pre-0.12 names for structured_outputs' fields (older clients still send them)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


# ---- completions ------------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None


# ---- chat -------------------------------------------------------------------------------------------
class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = Field(default=None, description="deprecated in favour of max_completion_tokens")
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    truncate_prompt_tokens: int | None = None


# ---- tokenize / detokenize --------------------------------------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    """`{"prompt": ...}` (completion style) or `{"messages": [...]}` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ---- models -----------------------------------------------------------------------------------------
class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


def model_list(served_model_names: Sequence[str], root: str, max_model_len: int, created: float) -> dict[str, Any]:
    """The body of `GET /v1/models`: one card per served name, all of the same model (vLLM's shape)."""
    cards = [ModelCard(id=name, root=root, max_model_len=max_model_len, created=int(created),
                       permission=[ModelPermission()])
             for name in served_model_names]
    return ModelList(data=cards).model_dump()


def chat_role(req: ChatCompletionRequest) -> str:
    """The role of the message a chat answer writes: the assistant's, or with `add_generation_prompt` off
    (continuing the last message) that message's role."""
    if req.add_generation_prompt:
        return "assistant"
    last = req.messages[-1] if req.messages else {}
    role = last.get("role") if isinstance(last, dict) else None
    return role if isinstance(role, str) else "assistant"
