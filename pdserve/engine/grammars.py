"""The engine's side of structured outputs: a request's grammar is compiled when it arrives and advanced
with every token it samples; the sampler masks its logits with the grammar's bitmask.

The decode side owns the grammar in P/D: a prefill leg's one token is thrown away by the proxy, and the
decode instance starts the grammar at the request's first output token. The tokenizer (needed for the
vocabulary's bytes) is loaded on the first structured request, so a `--tokens-only` engine serves them
too as long as its model folder has one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pdserve.engine.request import Request
from pdserve.types.sampling_params import ParamError

log = logging.getLogger("pdserve.engine")


class Grammars:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: Iterable[int],
                 options: dict[str, Any] | None = None):
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._options = options or {}
        self._compiler: Any = None
        self._load_error: ParamError | None = None

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            if self._load_error is not None:
                raise self._load_error
            from pdserve.structured.grammar import load_compiler

            try:
                self._compiler = load_compiler(self._tokenizer_path, self._vocab_size, self._eos, self._options)
            except ParamError as e:
                self._load_error = e
                raise
            log.info("structured outputs: llguidance over the tokenizer in %s", self._tokenizer_path)
        return self._compiler

    def compile(self, spec: Any) -> Any:
        """The request's grammar; ParamError (a 400) for a spec the grammar engine refuses."""
        return self.compiler.compile(spec)

    @staticmethod
    def advance(req: Request, token_id: int) -> bool:
        """After `token_id` was appended (and did not end the request): True when the grammar refused it (the
        request fails). A complete grammar allows only EOS next, so the request then ends as vLLM's does:
        with EOS as its last token."""
        grammar = req.grammar
        if grammar.accept(token_id):
            return False
        req.finish_reason = "error"
        req.error = f"structured output: the grammar refused token {token_id}: {grammar.error or 'no reason'}"
        return True
