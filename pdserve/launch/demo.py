"""`pdserve up --demo`: one streamed request through the proxy, its answer and TTFT, and the decode
instance's KV transfer line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.preflight.metrics import NixlSnapshot, log_lines, scrape

DEFAULT_PROMPT = "The three primary colours are"


@dataclass
class StreamResult:
    text: str
    ttft_s: float | None  # time to the first streamed token
    total_s: float
    completion_tokens: int | None
    finish_reason: str | None


def stream_completion(
    proxy_url: str, model: str | None, prompt: str, max_tokens: int, *, timeout: float = 300.0
) -> StreamResult:
    """POST /v1/completions with stream=true; raises RuntimeError with the server's message on errors."""
    body: dict[str, object] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    parts: list[str] = []
    ttft = None
    usage_tokens = None
    finish = None
    t0 = time.perf_counter()
    with httpx.Client(timeout=timeout, trust_env=False) as client, client.stream(
        "POST", proxy_url.rstrip("/") + "/v1/completions", json=body
    ) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code} from the proxy: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error in the stream: {event['error']}")
            for choice in event.get("choices") or []:
                text = choice.get("text") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
    return StreamResult("".join(parts), ttft, time.perf_counter() - t0, usage_tokens, finish)


def served_model(instance_url: str) -> str | None:
    """The first id of an instance's GET /v1/models (what clients put in "model")."""
    try:
        r = httpx.get(instance_url.rstrip("/") + "/v1/models", timeout=5.0, trust_env=False)
        r.raise_for_status()
        data = r.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def kv_transfer_report(decode_urls: list[str], decode_logs: list[Path], before: list[NixlSnapshot],
                       wait_log_s: float) -> list[str]:
    """Lines describing the KV transfer(s) the demo caused: from each decode's /metrics (delta), and the
    latest `KV Transfer metrics` log line if the instance writes one within `wait_log_s`."""
    lines: list[str] = []
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        for url, base in zip(decode_urls, before, strict=True):
            try:
                snap = scrape(client, url)
            except httpx.HTTPError as e:
                lines.append(f"{url}/metrics: {e}")
                continue
            if not snap.present:
                lines.append(f"{url}/metrics has no vllm:nixl_* series")
                continue
            delta = snap.delta(base)
            if delta.transfers or delta.counter("vllm:nixl_num_failed_transfers"):
                lines.append(f"KV Transfer metrics (from {url}/metrics): {delta.summary_line()}")
    deadline = time.monotonic() + wait_log_s
    while True:
        found = [(p, log_lines(p, 1)) for p in decode_logs]
        found = [(p, ls) for p, ls in found if ls]
        if found or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    for path, ls in found:
        lines.append(f"{path.name}: {ls[-1].strip()}")
    return lines


def run_demo(
    proxy_url: str,
    model: str | None,
    decode_urls: list[str],
    decode_logs: list[Path],
    *,
    prompt: str,
    max_tokens: int,
    wait_log_s: float,
    say: Callable[[str], None],
) -> bool:
    """Send the demo request and print what happened; False if the request failed."""
    before: list[NixlSnapshot] = []
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        for url in decode_urls:
            try:
                before.append(scrape(client, url))
            except httpx.HTTPError:
                before.append(NixlSnapshot())
    say(f"demo: POST {proxy_url}/v1/completions  prompt={prompt!r} max_tokens={max_tokens}")
    try:
        res = stream_completion(proxy_url, model, prompt, max_tokens)
    except (RuntimeError, httpx.HTTPError, ValueError) as e:
        say(f"demo request failed: {e}")
        return False
    say(f"answer: {prompt}{res.text}")
    ttft = f"{res.ttft_s * 1e3:.1f} ms" if res.ttft_s is not None else "n/a (no text streamed)"
    tokens = f", {res.completion_tokens} tokens" if res.completion_tokens is not None else ""
    say(f"TTFT: {ttft}; total {res.total_s * 1e3:.1f} ms{tokens}, finish_reason={res.finish_reason}")
    if decode_urls:
        for line in kv_transfer_report(decode_urls, decode_logs, before, wait_log_s) or [
            "no KV transfer was reported by the decode instance(s)"
        ]:
            say(line)
    return True
