"""Prompt inputs of the offline API, as vLLM spells them (`vllm.inputs`): a text, a list of token ids,
`TextPrompt` (`{"prompt": str}`) or `TokensPrompt` (`{"prompt_token_ids": [...]}`), alone or in a list.

No torch here: this is the vocabulary `pdserve.llm` checks its arguments with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # shown back in the result; the ids are what runs
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True)
class ParsedPrompt:
    text: str | None  # None for token-id prompts (as vLLM reports them)
    token_ids: list[int] | None  # None until a text is tokenized


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where} must be a list of token ids (int), got {type(value).__name__}")
    bad = next((t for t in value if type(t) is not int), None)
    if bad is not None or any(t < 0 for t in value):
        shown = bad if bad is not None else next(t for t in value if t < 0)
        raise TypeError(f"{where} must contain non-negative ints (token ids), got {shown!r}")
    return list(value)


def parse_prompt(prompt: Any, index: int = 0) -> ParsedPrompt:
    """One prompt in any of the accepted forms; TypeError naming what was wrong otherwise."""
    where = f"prompts[{index}]"
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{where}['prompt'] must be a string, got {type(text).__name__}")
            return ParsedPrompt(text, _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']"))
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{where}['prompt'] must be a string, got {type(prompt['prompt']).__name__}")
            return ParsedPrompt(prompt["prompt"], None)
        if "prompt_embeds" in prompt:
            raise TypeError(f"{where}: prompt_embeds are not supported")
        raise TypeError(f"{where} is a dict without 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt); "
                        f"its keys are {sorted(prompt)}")
    if isinstance(prompt, (list, tuple)):
        return ParsedPrompt(None, _token_ids(prompt, where))
    raise TypeError(f"{where} must be a str, a list of token ids, a TextPrompt or a TokensPrompt dict, "
                    f"got {type(prompt).__name__}")


def parse_prompts(prompts: Any) -> list[ParsedPrompt]:
    """`generate`'s first argument: one prompt or a sequence of them (a flat list of ints is one prompt)."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if not prompts:
            return []
        if all(type(t) is int for t in prompts):
            return [parse_prompt(list(prompts))]
        return [parse_prompt(p, i) for i, p in enumerate(prompts)]
    raise TypeError(f"prompts must be a str, a list of token ids, a TextPrompt/TokensPrompt dict or a list of "
                    f"those, got {type(prompts).__name__}")


def is_conversation_list(messages: Any) -> bool:
    """`LLM.chat`'s argument: one conversation (a list of message dicts) or a list of conversations."""
    return isinstance(messages, (list, tuple)) and bool(messages) and all(
        isinstance(m, (list, tuple)) for m in messages)
