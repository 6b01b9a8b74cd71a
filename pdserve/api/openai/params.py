"""OpenAI request fields -> engine SamplingParams, with vLLM's defaults and client-error checks."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.api.openai.errors import APIError, bad_request, not_supported
from pdserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pdserve.text.forced_tools import ForcedTool, ForcedToolError, forced_tool
from pdserve.text.output_parsers import ToolChoiceError, parses_tool_calls
from pdserve.types.sampling_params import MAX_N, ParamError, SamplingParams, child_seed  # noqa: F401 - re-exported
from pdserve.types.structured_params import LEGACY_FIELDS, StructuredOutputsParams, from_openai_request

log = logging.getLogger("pdserve.server")

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from the model's generation_config.json, used when a request omits a field
    (vLLM's `--generation-config auto` behaviour)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> GenerationDefaults:
        path = Path(model_dir) / "generation_config.json" if model_dir else None
        if path is None or not path.is_file():
            return cls()
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls()
        if not isinstance(cfg, dict):
            return cls()

        def num(key: str, default: float) -> float:
            value = cfg.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        max_new = cfg.get("max_new_tokens")
        repetition = num("repetition_penalty", 1.0)
        defaults = cls(
            temperature=num("temperature", 1.0),
            top_p=num("top_p", 1.0),
            top_k=int(num("top_k", 0)),
            min_p=num("min_p", 0.0),
            repetition_penalty=repetition if repetition > 0 else 1.0,  # a bad value would fail every request
            max_new_tokens=max_new if isinstance(max_new, int) and max_new > 0 else None,
        )
        if defaults != cls():
            log.info("default sampling parameters from the model's generation_config.json: %s", defaults)
        return defaults


def check_unsupported(req: _SamplingFields) -> None:
    """Fields vLLM accepts that this engine cannot honour: a clear 400 rather than silently different output."""
    if req.use_beam_search:
        raise not_supported("use_beam_search")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"Requested prompt logprobs of {req.prompt_logprobs}, which is greater than max "
                              f"allowed: {MAX_LOGPROBS}" if req.prompt_logprobs > MAX_LOGPROBS
                              else "`prompt_logprobs` must be a non-negative value.", "prompt_logprobs")
        if req.stream and req.prompt_logprobs > 0:  # vLLM's rule: stream chunks have no prompt_logprobs field
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.", "n")
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}.", "n")


def check_completion_request(req: CompletionRequest) -> None:
    """`check_unsupported` plus the completions-only fields this server refuses."""
    check_unsupported(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1, got 0 (0 is allowed with echo: the prompt alone).",
                          "max_tokens")
    if req.suffix is not None:
        raise not_supported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise not_supported("best_of", " (other than equal to n)")


def check_chat_fields(parsers: Any, req: ChatCompletionRequest) -> bool:
    """`check_unsupported` plus the chat-only checks; returns whether the output goes through the tool-call
    parser ("auto" needs --enable-auto-tool-choice and --tool-call-parser; "required" and named functions
    need structured output: 400)."""
    check_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request("`top_logprobs` must be a non-negative value.", "top_logprobs")
    try:
        return parses_tool_calls(parsers, req.tools, req.tool_choice)
    except ToolChoiceError as e:
        raise APIError(str(e), 400, e.param) from e


def completion_prompt_logprobs(req: CompletionRequest) -> int | None:
    """The prompt logprobs a completions request needs: `prompt_logprobs`, else with `echo` its `logprobs`
    (the echoed prompt tokens carry theirs, as in vLLM's CompletionRequest.to_sampling_params). None for a
    streamed `prompt_logprobs: 0` without echo (stream chunks have no field for them: not computed)."""
    if req.prompt_logprobs is not None and not (req.stream and not req.echo):
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


def echo_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens` 0 (OpenAI's way to score a prompt): the engine samples one token, which the
    response leaves out."""
    return bool(req.echo) and req.max_tokens == 0


def completion_prompt_items(req: CompletionRequest) -> list[Any]:
    """A completions request's prompts, one item each: a text or a list of token ids (400 if there are none)."""
    prompt = req.prompt
    if prompt is None:
        raise bad_request("Either prompt or prompt_embeds must be provided.", "prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("Prompt cannot be empty.", "prompt")
    return items


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise bad_request("stop cannot contain an empty string.", "stop")
    return stops


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       defaults: GenerationDefaults, param: str) -> int:
    """min(requested, room left in the context, the model's default cap), as vLLM computes it."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}.", param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.", "prompt"
        )
    room = max_model_len - prompt_len
    value = room if requested is None else min(requested, room)
    if requested is None and defaults.max_new_tokens is not None:
        value = min(value, defaults.max_new_tokens)
    return value


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_param_name(param: str | None, prefix: str) -> str | None:
    """The name a client error gives a sampling field: `/inference/v1/generate` nests them under
    `sampling_params.`, the OpenAI routes keep them at the top level (other params are left alone)."""
    return f"{prefix}{param}" if prefix and param in SAMPLING_FIELDS else param


def build_sampling_params(fields: Any, *, max_tokens: int, logprobs: int | None, defaults: GenerationDefaults,
                          seed: int | None, param_prefix: str = "",
                          prompt_logprobs: int | None = None) -> SamplingParams:
    """Engine parameters from a request's sampling fields (an OpenAI request, or a GenerateRequest's
    `sampling_params`: the same names); omitted fields get the model's generation defaults."""
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {MAX_LOGPROBS}"
            if logprobs > MAX_LOGPROBS else f"logprobs must be non-negative, got {logprobs}.",
            sampling_param_name("logprobs", param_prefix),
        )
    top_k = defaults.top_k if fields.top_k is None else fields.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if fields.temperature is None else fields.temperature,
            top_p=defaults.top_p if fields.top_p is None else fields.top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=defaults.min_p if fields.min_p is None else fields.min_p,
            seed=seed,
            stop=stop_list(fields.stop),
            stop_token_ids=list(fields.stop_token_ids or []),
            ignore_eos=fields.ignore_eos,
            min_tokens=fields.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=fields.skip_special_tokens,
            include_stop_str_in_output=fields.include_stop_str_in_output,
            presence_penalty=0.0 if fields.presence_penalty is None else fields.presence_penalty,
            frequency_penalty=0.0 if fields.frequency_penalty is None else fields.frequency_penalty,
            repetition_penalty=(defaults.repetition_penalty if fields.repetition_penalty is None
                                else fields.repetition_penalty),
            logit_bias=logit_bias_by_id(fields.logit_bias, sampling_param_name("logit_bias", param_prefix)),
            allowed_token_ids=fields.allowed_token_ids,
            structured_outputs=structured_outputs_of(fields),
        )
    except ParamError as e:
        raise APIError(str(e), 400, sampling_param_name(e.param, param_prefix)) from e


def structured_outputs_of(fields: Any) -> StructuredOutputsParams | None:
    """`structured_outputs`, `response_format` and the legacy `guided_*` fields (those a request has) as one
    spec (ParamError for a malformed one; the grammar itself is checked by the engine)."""
    forced = forced_tool_of(fields)
    if forced is not None:
        # as vLLM's ChatCompletionRequest.to_sampling_params: the tool call's schema is the constraint
        return StructuredOutputsParams(json=forced.schema(fields.tools,
                                                          getattr(fields, "parallel_tool_calls", None) is not False))
    legacy = {k: getattr(fields, k) for k in LEGACY_FIELDS if getattr(fields, k, None) is not None}
    return from_openai_request(getattr(fields, "structured_outputs", None), getattr(fields, "response_format", None),
                               legacy)


def forced_tool_of(fields: Any) -> ForcedTool | None:
    """A chat request's tool_choice "required" or named function (checked by check_chat_fields), else None."""
    tools = getattr(fields, "tools", None)
    try:
        return forced_tool(tools, getattr(fields, "tool_choice", None)) if tools else None
    except ForcedToolError as e:
        raise APIError(str(e), 400, e.param) from e


def logit_bias_by_id(bias: dict[str, float] | None, param: str) -> dict[int, float] | None:
    """OpenAI's JSON keys token ids as strings; the engine wants ints (values are clamped to [-100, 100] by
    SamplingParams, and ids checked against the vocabulary by the engine)."""
    if bias is None:
        return None
    by_id: dict[int, float] = {}
    for token, value in bias.items():
        try:
            by_id[int(token)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {token!r}.", param) from None
    return by_id


def validate_token_ids(ids: Any, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise bad_request("Prompt cannot be empty." if isinstance(ids, list) else f"{param} must be a list", param)
    # The common case in C-level passes (types, min, max): a Python loop over an 8k-token prompt cost ~1 ms
    # per request, paid twice by a disaggregated request (both legs). The loop only names the culprit.
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for t in ids:
        if type(t) is not int or t < 0:
            raise bad_request(f"{param} must contain non-negative integers, got {t!r}.", param)
        if t >= vocab_size:
            raise bad_request(f"Token id {t} is out of vocabulary", param)
    return ids


def truncate_prompt(ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    if truncate is None:
        return ids
    if truncate == -1:
        truncate = max_model_len
    if truncate < 1:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1.", "truncate_prompt_tokens")
    return ids[-truncate:]
