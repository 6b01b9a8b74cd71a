"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config)
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from pdserve.text.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.tokenizer or str(self.engine.model_dir))
        return self._tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Prompts are strings or token-id lists. Runs all of them to completion with continuous batching."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        processors: dict[str, Any] = {}
        order: list[str] = []
        for prompt, params in zip(prompts, params_list, strict=True):
            params = params or SamplingParams()
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
                text = prompt
            else:
                ids, text = list(prompt), None
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, params)
            results[rid] = GenerationResult(rid, text, ids)
            processors[rid] = self._output_processor(ids, params)
            order.append(rid)
        finished: dict[str, CompletionOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                proc = processors[out.request_id]
                if proc is not None:
                    stop_hit = proc.add(out)
                    if stop_hit and not out.finished:
                        self.engine.abort_request(out.request_id)
                        finished[out.request_id] = proc.result()
                        continue
                if out.finished and out.request_id not in finished:
                    finished[out.request_id] = proc.result() if proc is not None else self._plain(out)
                    results[out.request_id].num_cached_tokens = out.num_cached_tokens
        for rid in order:
            results[rid].outputs.append(finished[rid])
        return [results[rid] for rid in order]

    def _output_processor(self, prompt_ids: list[int], params: SamplingParams):
        from pdserve.text.output import OfflineOutputCollector

        return OfflineOutputCollector(self.tokenizer, prompt_ids, params)

    def _plain(self, out) -> CompletionOutput:  # pragma: no cover - used only without a processor
        return CompletionOutput("", [], out.finish_reason, out.stop_reason)
