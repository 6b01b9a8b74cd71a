"""What every route needs: the engine, tokenizer, names, limits and metrics of one server."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.openai.errors import APIError, check_served_model
from pdserve.api.openai.params import GenerationDefaults
from pdserve.server.metrics import ServerMetrics
from pdserve.text.output_parsers import ParserConfig
from pdserve.text.tokenizer import Tokenizer


@dataclass
class ServerState:
    engine: Any  # AsyncEngine (duck-typed so tests can drive the routes with a fake)
    tokenizer: Tokenizer | None  # None on a --tokens-only server (no text routes)
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    vocab_size: int  # the model's: token ids at or above it are refused
    defaults: GenerationDefaults
    metrics: ServerMetrics
    info: dict[str, Any] = field(default_factory=dict)  # GET /pdserve/info
    api_key: str | None = None
    max_request_body_bytes: int = 64 * 1024 * 1024
    randomize_request_ids: bool = field(
        default_factory=lambda: os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("1", "true")
    )
    started: float = field(default_factory=time.time)
    draining: bool = False  # SIGTERM received: refuse new work
    parsers: ParserConfig = field(default_factory=ParserConfig)  # --reasoning-parser, --tool-call-parser
    tokens_only: bool = False  # --tokens-only: /inference/v1/generate only, no tokenizer
    enable_scale_out: bool = False  # --enable-scale-out: /inference/v1/* on a normal server too

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to report back (the default for an empty one); 404 for a model not served here."""
        return check_served_model(name, self.served_model_names)

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError("The server is shutting down.", 503)

    def engine_request_id(self, base: str) -> str:
        return f"{base}-{uuid.uuid4().hex[:8]}" if self.randomize_request_ids else base
