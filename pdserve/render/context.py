"""What a render process knows: the tokenizer, the served names, the context length, the parsers.

`RenderConfig` is plain data (it is pickled to the worker processes); `RenderContext` is what each process
builds from it once. No engine, no weights, no torch: only `tokenizer.json`, the chat template,
`config.json` (for the context length and vocabulary size) and `generation_config.json` (sampling defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.api.openai.errors import check_served_model
from pdserve.api.openai.params import GenerationDefaults
from pdserve.model.config import derived_max_model_len, verify_max_model_len
from pdserve.text.output_parsers import ParserConfig
from pdserve.text.tokenizer import Tokenizer, load_tokenizer


class RenderSetupError(ValueError):
    """A model folder or option the render tier cannot start with."""


@dataclass(frozen=True)
class RenderConfig:
    model_path: str  # the HF folder (config.json, generation_config.json)
    tokenizer_path: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int  # the model's (token ids at or above it are refused in prompts)
    chat_template: str | None = None
    parsers: ParserConfig = field(default_factory=ParserConfig)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, served_model_names: list[str], tokenizer: str | None = None,
                       max_model_len: int | None = None, chat_template: str | None = None,
                       parsers: ParserConfig | None = None) -> RenderConfig:
        folder = Path(model_dir)
        cfg: dict[str, Any] = {}
        cfg_path = folder / "config.json"
        if cfg_path.is_file():
            try:
                loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise RenderSetupError(f"cannot read {cfg_path}: {e}") from e
            cfg = loaded if isinstance(loaded, dict) else {}
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        model_len = text_cfg.get("max_position_embeddings")
        if isinstance(model_len, int) and model_len >= 2:  # the engine's rule, so that both refuse alike
            scaling = text_cfg.get("rope_scaling")
            try:
                max_model_len = verify_max_model_len(
                    max_model_len, derived_max_model_len(model_len, scaling if isinstance(scaling, dict) else None))
            except ValueError as e:
                raise RenderSetupError(str(e)) from None
        elif max_model_len is None:
            raise RenderSetupError(f"{folder} has no max_position_embeddings in config.json; pass --max-model-len")
        if max_model_len < 2:
            raise RenderSetupError("--max-model-len must be at least 2")
        vocab = text_cfg.get("vocab_size")
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text(encoding="utf-8")
        return cls(
            model_path=str(folder),
            tokenizer_path=str(tokenizer or folder),
            served_model_names=tuple(served_model_names),
            max_model_len=max_model_len,
            vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else -1,  # -1: the tokenizer's
            chat_template=chat_template,
            parsers=parsers or ParserConfig(),
        )


class RenderContext:
    def __init__(self, config: RenderConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_path, chat_template=config.chat_template)
        self.defaults = GenerationDefaults.from_model_dir(config.model_path)
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size if config.vocab_size > 0 else self.tokenizer.vocab_size
        self.parsers = config.parsers

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        return check_served_model(name, self.config.served_model_names)
