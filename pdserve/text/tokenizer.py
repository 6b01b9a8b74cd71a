"""Tokenizer loading, encode/decode and chat templates, with Hugging Face `transformers` doing the work.

The tokenizer class is resolved from `tokenizer_config.json` the way `AutoTokenizer` resolves it for a
local folder, but without `AutoTokenizer` itself: that one reads `config.json` through modules which
import torch, and this package is also used by torch-free processes (the render tier).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from pdserve.text.chat import ChatTemplateError, detect_content_format, prepare_messages

log = logging.getLogger("pdserve.text")

# Keys a client may not smuggle into the template call through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "return_dict", "padding", "truncation",
    "max_length", "return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "sanitize_control_tokens",
})


class TokenizerLoadError(RuntimeError):
    pass


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _tokenizer_class(folder: Path, tokenizer_config: dict[str, Any]) -> type:
    """The class AutoTokenizer would pick for this local folder (remote code is not supported)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    backend = PreTrainedTokenizerFast  # = TokenizersBackend in transformers 5
    name = tokenizer_config.get("tokenizer_class")
    if not isinstance(name, str) or tokenizer_config.get("auto_map"):
        return backend
    # AutoTokenizer's rule: a Llama class over a byte-level tokenizer.json loads as the generic backend.
    if name.removesuffix("Fast") == "LlamaTokenizer" and _is_byte_level(folder / "tokenizer.json"):
        return backend
    cls = getattr(transformers, name, None) or getattr(transformers, name.removesuffix("Fast"), None)
    if cls is None:
        log.warning("tokenizer class %s is unknown to transformers; using the generic fast tokenizer", name)
        return backend
    return cls


def _is_byte_level(tokenizer_json: Path) -> bool:
    data = _read_json(tokenizer_json)

    def has_byte_level(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(has_byte_level(v) for v in node.values())
        if isinstance(node, list):
            return any(has_byte_level(v) for v in node)
        return False

    return has_byte_level(data.get("pre_tokenizer")) or has_byte_level(data.get("decoder"))


def _generation_eos_ids(folder: Path) -> set[int]:
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return {eos}
    if isinstance(eos, list):
        return {e for e in eos if isinstance(e, int) and not isinstance(e, bool)}
    return set()


class Tokenizer:
    """A loaded tokenizer plus what serving needs from it. Thread-safe for concurrent reads."""

    def __init__(self, hf: Any, path: str, chat_template: str | None = None):
        self.hf = hf
        self.path = path
        self.backend = hf.backend_tokenizer  # the Rust `tokenizers.Tokenizer`: fast decode of small windows
        folder = Path(path)
        vocab = hf.get_vocab()
        self.max_token_id: int = max(vocab.values()) if vocab else -1
        self.vocab_size: int = max(len(hf), self.max_token_id + 1)
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        eos = _generation_eos_ids(folder)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.all_special_ids: frozenset[int] = frozenset(hf.all_special_ids)
        # What the Rust decoder leaves out with skip_special_tokens: added tokens flagged special.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special
        )
        self.chat_template: str | None = chat_template or _template_string(hf.chat_template)
        self.chat_content_format = detect_content_format(self.chat_template)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerLoadError(f"tokenizer folder {str(folder)!r} does not exist")
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise TokenizerLoadError(f"{str(folder)!r} has neither tokenizer.json nor tokenizer_config.json")
        tok_cls = _tokenizer_class(folder, _read_json(folder / "tokenizer_config.json"))
        try:
            hf = tok_cls.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "cannot load"
            raise TokenizerLoadError(f"cannot load the tokenizer in {str(folder)!r}: {e}") from e
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text(encoding="utf-8")
        return cls(hf, str(folder), chat_template)

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: the longest vocabulary entry (byte-level
        entries have one character per byte, and a decoded character is at least one byte). So a text of
        more than max_model_len x this many characters cannot fit in the context, whatever it says."""
        return max((len(piece) for piece in self.hf.get_vocab()), default=1) or 1

    # ---- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_window(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Raw decode of a few ids (no clean-up of tokenization spaces), for incremental detokenisation."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        """One token's text as vLLM shows it in logprobs (`tokenizer.decode([id])`)."""
        return self.hf.decode([token_id])

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    # ---- chat --------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """Renders a conversation to the prompt text. Raises ChatTemplateError for anything the client
        can fix (no template, a template that rejects the messages, bad message shapes)."""
        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError(
                "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
                "a chat template if the tokenizer does not define one."
            )
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        content_format = detect_content_format(template) if chat_template else self.chat_content_format
        conversation = prepare_messages(messages, content_format)
        kwargs = {k: v for k, v in chat_template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
        kwargs.setdefault("add_generation_prompt", add_generation_prompt)
        kwargs.setdefault("continue_final_message", continue_final_message)
        try:
            text = self.hf.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=template, tokenize=False, **kwargs
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors, raise_exception() in templates, HF ValueErrors
            raise ChatTemplateError(f"chat template error: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render a single conversation")
        return text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, *, add_special_tokens: bool = False,
                    **kwargs: Any) -> list[int]:
        """The prompt token ids of a conversation (the template carries BOS itself, as in vLLM)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


def _template_string(template: Any) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, dict):  # several named templates: "default" is the one HF would use
        value = template.get("default")
        return value if isinstance(value, str) else None
    return None


def load_tokenizer(path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
    return Tokenizer.from_pretrained(path, chat_template=chat_template)
