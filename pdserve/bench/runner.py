"""One benchmark run against one OpenAI-compatible server: discovery, workload, dispatch, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import numpy as np

from pdserve.bench.arrivals import arrival_offsets, paced
from pdserve.bench.client import BACKENDS, RequestFunc, is_chat_backend
from pdserve.bench.datasets import load_jsonl, sample_random, sample_shared_prefix
from pdserve.bench.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    calculate_metrics,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)
from pdserve.bench.options import MULTITURN_DATASETS, BenchSpec
from pdserve.bench.progress import ProgressBar
from pdserve.bench.result import build_result, format_block
from pdserve.bench.spec_decode import format_spec_block, read_spec_counters
from pdserve.bench.tokenizer import TokenizerError, load_tokenizer, token_counter
from pdserve.bench.types import RequestInput, RequestOutput, SampleRequest

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


class BenchError(RuntimeError):
    """A configuration or connectivity problem that stops the benchmark with a message."""


@dataclass
class Target:
    """The resolved server side of a run."""

    root_url: str
    api_url: str
    model_id: str
    model_name: str | None
    tokenizer: Any | None
    tokenizer_id: str | None


async def list_models(root_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """`data` of GET /v1/models."""
    url = f"{root_url}/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(url, headers=headers) as resp,
        ):
            resp.raise_for_status()
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError) as err:
        raise BenchError(f"Failed to fetch models from {url} (pass --model to skip this): {err}") from err
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not all(isinstance(m, dict) and "id" in m for m in models):
        raise BenchError(f"No models found on the server at {root_url}.")
    return models


async def first_model(root_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """(served name, model id) of data[0] of GET /v1/models, as vLLM reads them."""
    first = (await list_models(root_url, headers))[0]
    return str(first["id"]), str(first.get("root") or first["id"])


async def _served_root(spec: BenchSpec, served: str) -> str | None:
    """The local folder the server loaded `served` from (its /v1/models `root`), if this machine has it."""
    try:
        models = await list_models(spec.root_url, spec.request_headers())
    except BenchError:
        return None
    for m in models:
        root = m.get("root")
        if m.get("id") == served and isinstance(root, str) and os.path.isdir(root):
            return root
    return None


async def _load_tokenizer(spec: BenchSpec, model_id: str, served: str) -> tuple[Any, str]:
    """--tokenizer, else the model id when it is a local path, else the server's local model folder, else
    the model id as a hub id."""
    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer), spec.tokenizer
    candidates = [model_id]
    if not os.path.exists(model_id):
        root = await _served_root(spec, served)
        if root is not None:
            candidates.insert(0, root)
    errors: list[TokenizerError] = []
    for candidate in candidates:
        try:
            return load_tokenizer(candidate), candidate
        except TokenizerError as err:
            errors.append(err)
    raise errors[-1]


async def resolve_target(spec: BenchSpec, need_tokenizer: bool) -> Target:
    headers = spec.request_headers()
    if spec.model is None:
        print("Model not specified, fetching first model from server...")
        model_name, model_id = await first_model(spec.root_url, headers)
        print(f"First model name: {model_name}, first model id: {model_id}")
    else:
        model_name, model_id = spec.served_model_name, spec.model
    tokenizer = None
    tokenizer_id: str | None = None
    if not spec.skip_tokenizer_init:
        try:
            tokenizer, tokenizer_id = await _load_tokenizer(spec, model_id, model_name or model_id)
        except TokenizerError as err:
            if need_tokenizer or spec.tokenizer:
                raise BenchError(f"{err}; pass --tokenizer PATH (a folder with tokenizer.json)") from err
            print(f"WARNING: {err}; output tokens are counted from the server's usage only", file=sys.stderr)
    elif need_tokenizer:
        raise BenchError(f"--dataset-name {spec.dataset_name} needs a tokenizer (drop --skip-tokenizer-init)")
    return Target(spec.root_url, spec.api_url, model_id, model_name, tokenizer, tokenizer_id)


def needs_tokenizer(spec: BenchSpec) -> bool:
    return spec.dataset_name in ("random", "prefix", "multiturn")


def build_requests(spec: BenchSpec, tokenizer: Any | None) -> list[SampleRequest]:
    if spec.dataset_name == "random":
        return sample_random(
            tokenizer,
            spec.num_prompts,
            spec.random_input_len,
            spec.random_output_len,
            spec.random_range_ratio,
            spec.random_prefix_len,
            spec.seed,
        )
    if spec.dataset_name == "prefix":
        return sample_shared_prefix(
            tokenizer,
            spec.num_prompts,
            spec.prefix_len,
            spec.suffix_len,
            spec.num_prefixes,
            spec.random_output_len,
            spec.seed,
        )
    assert spec.dataset_path is not None
    requests = load_jsonl(
        spec.dataset_path, spec.num_prompts, spec.random_output_len, tokenizer, spec.seed, spec.shuffle
    )
    if any(r.chat_messages is not None for r in requests) and not is_chat_backend(spec.backend):
        raise BenchError("the JSONL file has 'messages' conversations: use --backend openai-chat")
    return requests


async def align_prompts(root_url: str, model: str, requests: list[SampleRequest]) -> list[SampleRequest]:
    """Trim prompts the server tokenises longer than intended, via its /tokenize and /detokenize (vLLM).

    `model` is the name the server serves (vLLM sends its model id, which a server rejects when the two
    differ; the served name is what the request bodies carry too).
    """
    if not requests:
        return requests
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        sem = asyncio.Semaphore(64)

        async def tokenize(prompt: str) -> list[int]:
            body = {"model": model, "prompt": prompt, "add_special_tokens": False}
            async with sem, session.post(f"{root_url}/tokenize", json=body) as r:
                r.raise_for_status()
                return list((await r.json())["tokens"])

        async def detokenize(tokens: list[int]) -> str:
            async with (
                sem,
                session.post(f"{root_url}/detokenize", json={"model": model, "tokens": tokens}) as r,
            ):
                r.raise_for_status()
                return str((await r.json())["prompt"])

        try:
            first = await tokenize(requests[0].prompt)
        except Exception:
            print("WARNING: /tokenize unavailable, skipping alignment.")
            return requests
        if len(first) == requests[0].prompt_len:
            return requests
        print(
            f"WARNING: tokenizer mismatch (server={len(first)}, expected={requests[0].prompt_len}), "
            "re-aligning prompts."
        )

        async def fix(req: SampleRequest) -> SampleRequest:
            tokens = await tokenize(req.prompt)
            if len(tokens) <= req.prompt_len:
                return req
            return replace(req, prompt=await detokenize(tokens[: req.prompt_len]))

        results = await asyncio.gather(*(fix(r) for r in requests), return_exceptions=True)
        return [
            res if isinstance(res, SampleRequest) else orig
            for orig, res in zip(requests, results, strict=True)
        ]


def _request_input(
    spec: BenchSpec, target: Target, req: SampleRequest, request_id: str | None
) -> RequestInput:
    return RequestInput(
        prompt=req.prompt,
        api_url=target.api_url,
        prompt_len=req.prompt_len,
        output_len=req.expected_output_len,
        model=target.model_id,
        model_name=target.model_name,
        logprobs=spec.logprobs,
        extra_headers=spec.request_headers(),
        extra_body=spec.sampling_body() or None,
        ignore_eos=spec.ignore_eos,
        request_id=request_id,
        chat_messages=req.chat_messages,
    )


async def _ready_check(
    func: RequestFunc, inp: RequestInput, session: aiohttp.ClientSession, timeout_s: int
) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        out = await func(inp, session, None)
        if out.success:
            print("Initial test run completed.")
            return
        if time.perf_counter() >= deadline:
            raise BenchError(
                "Initial test run failed - Please make sure benchmark arguments are correctly specified. "
                f"Error: {out.error}"
            )
        await asyncio.sleep(min(5.0, max(0.0, deadline - time.perf_counter())))


async def benchmark(spec: BenchSpec, target: Target, requests: list[SampleRequest]) -> dict[str, Any]:
    """Send the workload, print vLLM's result block, return vLLM's result dict (with per-request arrays)."""
    func = BACKENDS[spec.backend][0]
    goodput = parse_goodput(spec.goodput)
    percentiles = parse_percentiles(spec.metric_percentiles)
    selected = parse_percentile_metrics(spec.percentile_metrics or DEFAULT_PERCENTILE_METRICS)
    connector = aiohttp.TCPConnector(
        limit=spec.max_concurrency or 0, limit_per_host=spec.max_concurrency or 0, keepalive_timeout=60
    )
    async with aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT) as session:
        test_input = _request_input(spec, target, requests[0], None)
        if spec.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...")
            await _ready_check(func, test_input, session, spec.ready_check_timeout_sec)
        else:
            print("Skipping endpoint ready check.")
        semaphore: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else contextlib.nullcontext()
        )
        if spec.num_warmups > 0:
            print(f"Warming up with {spec.num_warmups} requests...")

            async def warm() -> RequestOutput:
                async with semaphore:
                    return await func(test_input, session, None)

            await asyncio.gather(*(warm() for _ in range(spec.num_warmups)))
            print("Warmup run completed.")

        print("Starting main benchmark run...")
        distribution = "Poisson process" if spec.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {spec.request_rate}")
        print(f"Burstiness factor: {spec.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {spec.max_concurrency}")

        offsets = arrival_offsets(
            len(requests), spec.request_rate, spec.burstiness, np.random.RandomState(spec.seed)
        )
        bar = None if spec.disable_tqdm else ProgressBar(len(requests))
        progress = bar.update if bar is not None else None

        async def limited(inp: RequestInput, arrival: float) -> RequestOutput:
            async with semaphore:
                out = await func(inp, session, progress)
            out.client_queue_time = out.start_time - arrival
            return out

        tasks: list[asyncio.Task[RequestOutput]] = []
        start = time.perf_counter()
        async for i in paced(range(len(requests)), offsets):
            inp = _request_input(spec, target, requests[i], f"{spec.request_id_prefix}{i}")
            tasks.append(asyncio.create_task(limited(inp, time.perf_counter())))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()

    count = token_counter(target.tokenizer) if target.tokenizer is not None else None
    metrics, output_lens = calculate_metrics(outputs, duration, count, percentiles, goodput)
    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, o in enumerate(failed[:10]):
            print(f"Error {i}: {o.error}")
    show_latency = target.tokenizer is not None or not spec.skip_tokenizer_init
    result = build_result(
        spec, outputs, output_lens, metrics, duration, goodput, selected, percentiles, show_latency
    )
    print(format_block(spec, metrics, duration, goodput, selected, percentiles, outputs, show_latency))
    return result


def finalize_result(
    spec: BenchSpec, target: Target, bench_result: dict[str, Any], date: str
) -> dict[str, Any]:
    """vLLM's result JSON: setup keys, metadata, traffic keys, then the run's keys."""
    out: dict[str, Any] = {
        "date": date,
        "endpoint_type": spec.backend,
        "backend": spec.backend,
        "label": spec.label,
        "model_id": target.model_id,
        "tokenizer_id": target.tokenizer_id,
        "num_prompts": spec.num_prompts,
    }
    for item in spec.metadata or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchError(f"Invalid metadata format {item!r}. Please use KEY=VALUE format.")
        out[key.strip()] = value.strip()
    out["request_rate"] = spec.request_rate if spec.request_rate < float("inf") else "inf"
    out["burstiness"] = spec.burstiness
    out["max_concurrency"] = spec.max_concurrency
    out.update(bench_result)
    if not spec.save_detailed:
        for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            out.pop(key, None)
    return out


def result_path(spec: BenchSpec, model_id: str, date: str) -> str:
    label = spec.label or spec.backend
    conc = f"-concurrency{spec.max_concurrency}" if spec.max_concurrency is not None else ""
    name = (
        spec.result_filename or f"{label}-{spec.request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    )
    if spec.result_dir:
        os.makedirs(spec.result_dir, exist_ok=True)
        name = os.path.join(spec.result_dir, name)
    return name


async def run_multiturn(spec: BenchSpec, target: Target) -> dict[str, Any]:
    """Conversations turn by turn (pdserve/bench/multiturn.py): the per-turn table, and with --save-result
    the JSON plus a TTFT-by-turn plot next to it."""
    from pdserve.bench import multiturn as mt

    opts = spec.multiturn_options()
    if spec.dataset_name == "sharegpt":
        assert spec.dataset_path is not None
        conversations = mt.load_sharegpt(spec.dataset_path, spec.num_prompts, opts)
    else:
        conversations = mt.synthetic_conversations(target.tokenizer, spec.num_prompts, opts, spec.seed)

    def make_input(messages: list[dict[str, Any]], answer_len: int, rid: str) -> RequestInput:
        inp = _request_input(spec, target, SampleRequest("", 0, answer_len, chat_messages=messages),
                             f"{spec.request_id_prefix}{rid}")
        inp.ignore_eos = inp.ignore_eos or spec.dataset_name == "multiturn"  # synthetic answers have a length
        return inp

    print(f"Starting multi-turn run: {len(conversations)} conversations, up to {opts.turns} turns, "
          f"max concurrency {spec.max_concurrency}")
    results, duration = await mt.run_conversations(conversations, make_input, think_time=opts.think_time,
                                                   max_concurrency=spec.max_concurrency)
    summary = mt.summarize_turns(results)
    print(mt.format_turns(summary, duration))
    for r in [r for r in results if not r.ok][:10]:
        print(f"conversation {r.conversation} turn {r.turn} failed: {r.error}")
    date = time.strftime("%Y%m%d-%H%M%S")
    result = {"date": date, "label": spec.label, "model_id": target.model_id,
              **mt.result_json(summary, results, duration, opts)}
    if not spec.save_detailed:
        result.pop("requests")
    if spec.save_result:
        path = result_path(spec, target.model_id, date)
        write_json(path, result)
        plot = mt.plot_ttft_by_turn({spec.label or "run": summary}, path.removesuffix(".json") + "-ttft-by-turn.png")
        print(f"Saved result to {path} and {plot}")
    return result


def write_json(path: str, data: dict[str, Any]) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


async def run_serve(spec: BenchSpec) -> dict[str, Any]:
    """`pdserve bench serve`: the whole run; saves the JSON when asked; returns the result dict."""
    target = await resolve_target(spec, needs_tokenizer(spec))
    if spec.dataset_name in MULTITURN_DATASETS:
        return await run_multiturn(spec, target)  # conversations, not independent requests
    requests = build_requests(spec, target.tokenizer)
    if spec.dataset_name in ("random", "prefix") and not spec.no_align_prompts:
        requests = await align_prompts(target.root_url, target.model_name or target.model_id, requests)
    if spec.temperature is None:
        print(
            "WARNING: no temperature is sent (the server's default applies); pass --temperature 0 for greedy."
        )
    spec_before = await read_spec_counters(target.root_url)
    bench_result = await benchmark(spec, target, requests)
    spec_after = await read_spec_counters(target.root_url) if spec_before is not None else None
    if spec_before is not None and spec_after is not None:
        spec_keys = (spec_after - spec_before).result_keys()
        if spec_keys:
            print(format_spec_block(spec_keys))
            bench_result.update(spec_keys)
    date = time.strftime("%Y%m%d-%H%M%S")
    result = finalize_result(spec, target, bench_result, date)
    if spec.save_result:
        path = result_path(spec, target.model_id, date)
        write_json(path, result)
        print(f"Saved result to {path}")
    return result
