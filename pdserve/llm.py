"""Offline API, as in vLLM: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM(model).chat(...)`.

Prompts are texts, token-id lists, `TextPrompt` or `TokensPrompt` dicts (`pdserve.inputs`), alone or in a
list. `skip_tokenizer_init=True` runs without a tokenizer (token ids in, token ids out; a model folder
with dummy weights has none). `use_tqdm` shows vLLM's "Processed prompts" bar.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.inputs import ParsedPrompt, is_conversation_list, parse_prompts
from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import TokenLogprob
from pdserve.types.sampling_params import SamplingParams, child_seed


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the prompt's n outputs
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when logprobs were asked


@dataclass
class GenerationResult:
    """One prompt's result (vLLM's `RequestOutput`): `outputs` holds its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    # SamplingParams(prompt_logprobs=k): per prompt position (the first None) the prompt token's logprob and the
    # top k, as TokenLogprob (token_id, logprob, rank, top)
    prompt_logprobs: list[TokenLogprob | None] | None = None


RequestOutput = GenerationResult  # vLLM's name for it


class LLM:
    def __init__(self, model: str | None = None, *, skip_tokenizer_init: bool = False, **engine_args: Any):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config)
        self.skip_tokenizer_init = skip_tokenizer_init
        self._tokenizer = None
        self._ids = itertools.count()

    # ---- tokenizer -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self.skip_tokenizer_init:
            raise ValueError("this LLM was created with skip_tokenizer_init=True: it has no tokenizer "
                             "(give prompts as token ids)")
        if self._tokenizer is None:
            from pdserve.text.tokenizer import TokenizerLoadError, load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.config.tokenizer or str(self.engine.model_dir))
            except TokenizerLoadError as e:
                raise TokenizerLoadError(f"{e}. For token-id prompts without a tokenizer, create the LLM with "
                                         f"skip_tokenizer_init=True") from e
        return self._tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `sampling_params=None` means: the model's generation_config.json defaults, as in vLLM."""
        from pdserve.api.openai.params import GenerationDefaults

        d = GenerationDefaults.from_model_dir(self.engine.model_dir)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p,
                              repetition_penalty=d.repetition_penalty)

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[GenerationResult]:
        """Runs every prompt to completion with continuous batching; results in the prompts' order."""
        parsed = parse_prompts(prompts)
        params_list = self._params_for(sampling_params, len(parsed))
        return self._run(parsed, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """One conversation (a list of messages) or a list of conversations, rendered with the model's chat
        template (or `chat_template`: a template string or a file path) and generated as token prompts."""
        conversations = list(messages) if is_conversation_list(messages) else [messages]
        if not conversations or not all(isinstance(c, (list, tuple)) and c for c in conversations):
            raise TypeError("messages must be a non-empty list of message dicts, or a list of such lists")
        if chat_template is not None:
            from pathlib import Path

            if len(chat_template) < 4096 and Path(chat_template).is_file():
                chat_template = Path(chat_template).read_text(encoding="utf-8")
        tok = self.tokenizer
        prompts = []
        for conv in conversations:
            ids = tok.encode_chat(list(conv), add_generation_prompt, tools, chat_template=chat_template,
                                  continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- internals -----------------------------------------------------------------------------
    def _params_for(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            bad = next((p for p in sampling_params if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params entries must be SamplingParams, got {type(bad).__name__}")
            if len(sampling_params) != n:
                raise ValueError(f"The lengths of prompts ({n}) and sampling_params ({len(sampling_params)}) "
                                 "must be the same.")
            return list(sampling_params)
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")

    def _ids_of(self, prompt: ParsedPrompt) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids
        if self.skip_tokenizer_init:
            raise ValueError("text prompts need a tokenizer, but this LLM has skip_tokenizer_init=True; give "
                             "token ids ({'prompt_token_ids': [...]})")
        return self.tokenizer.encode(prompt.text)

    def _run(self, prompts: list[ParsedPrompt], params_list: list[SamplingParams],
             use_tqdm: bool | Callable[..., Any]) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        collectors: dict[str, tuple[GenerationResult, int, Any]] = {}
        added: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                if self.skip_tokenizer_init and params.stop:
                    raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")
                ids = self._ids_of(prompt)
                res = GenerationResult(str(next(self._ids)), prompt.text, ids)
                res.outputs = [None] * params.n  # type: ignore[list-item]
                results.append(res)
                for j in range(params.n):
                    one = params if params.n == 1 else dataclasses.replace(params, n=1, seed=child_seed(params.seed, j))
                    rid = res.request_id if params.n == 1 else f"{res.request_id}_{j}"
                    self.engine.add_request(rid, ids, one)
                    added.append(rid)
                    collectors[rid] = (res, j, self._collector(ids, one))
        except BaseException:
            for rid in added:  # a bad prompt in the middle leaves nothing half-run in the engine
                self.engine.abort_request(rid)
            raise
        bar = _progress(use_tqdm, len(results))
        remaining = {r.request_id: len(r.outputs) for r in results}
        done: set[str] = set()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in done:
                    continue
                res, j, collector = collectors[out.request_id]
                if j == 0 and out.prompt_logprobs is not None:  # on the first output only
                    res.prompt_logprobs = out.prompt_logprobs
                stop_hit = collector.add(out)
                if not (stop_hit or out.finished):
                    continue
                if stop_hit and not out.finished:
                    self.engine.abort_request(out.request_id)  # a stop string: the engine would go on
                done.add(out.request_id)
                res.outputs[j] = _completion(collector.result(), j)
                if j == 0:
                    res.num_cached_tokens = out.num_cached_tokens
                remaining[res.request_id] -= 1
                if bar is not None and remaining[res.request_id] == 0:
                    bar.update(len(res.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs))
        if bar is not None:
            bar.close()
        return results

    def _collector(self, prompt_ids: list[int], params: SamplingParams):
        from pdserve.text.output import OfflineOutputCollector

        detokenize = params.detokenize and not self.skip_tokenizer_init
        return OfflineOutputCollector(self.tokenizer if detokenize else None, prompt_ids, params, detokenize)


def _completion(res: Any, index: int) -> CompletionOutput:
    cumulative = sum(lp.logprob for lp in res.logprobs) if res.logprobs is not None else None
    return CompletionOutput(res.text, res.token_ids, res.finish_reason, res.stop_reason, res.logprobs, index,
                            cumulative)


class _Progress:
    """vLLM's offline progress bar: prompts done, with input/output token speeds."""

    def __init__(self, factory: Callable[..., Any], total: int):
        self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True,
                           postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.start = time.perf_counter()
        self.tokens_in = 0
        self.tokens_out = 0

    def update(self, tokens_in: int, tokens_out: int) -> None:
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.tokens_in / elapsed:.2f} toks/s, "
                            f"output: {self.tokens_out / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress(use_tqdm: bool | Callable[..., Any], total: int) -> _Progress | None:
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm):  # vLLM accepts a tqdm-like class
        return _Progress(use_tqdm, total)
    from tqdm.auto import tqdm

    return _Progress(tqdm, total)
