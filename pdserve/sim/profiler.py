"""Measuring an instance for its profile (pdserve/sim/profile.py): an engine built in process, or a running
server over HTTP. Both measure the same points:

- prefill: one prompt alone, `new` tokens after `cached` ones (the cached part a prefix the instance computed just
  before, so the prefix cache has it), max_tokens 1: in process the engine steps' wall time; over HTTP the TTFT
  less the HTTP path (`http_path_s`: a one-token prompt's TTFT less one engine step; the profile's overheads);
- decode: `batch` requests of `context` tokens each, once all are decoding, the median step (in process) or the
  median inter-token gap (HTTP);
- the KV pool (blocks x block size) and its bytes per token (the pool's bytes / its tokens).
Points are measured twice and the faster kept (the box may be shared: a slower repeat is load, not the engine).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdserve.sim.profile import EngineSettings, Profile

REPEATS = 2


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(10, vocab - 1, size=n)]


class EngineMeasure:
    """An LLMEngine in this process."""

    def __init__(self, engine: Any) -> None:
        from pdserve.types.sampling_params import SamplingParams

        self.engine = engine
        self.vocab = engine.model_cfg.vocab_size
        self._sp = SamplingParams
        self._n = 0

    def _rid(self) -> str:
        self._n += 1
        return f"profile-{self._n}"

    def _run(self, prompts: Sequence[list[int]], max_tokens: int, on_step: Callable[[float, int], None] | None = None
             ) -> float:
        eng = self.engine
        for p in prompts:
            eng.add_request(self._rid(), p, self._sp(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        total = 0.0
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            total += dt
            if on_step is not None:
                on_step(dt, len(eng.scheduler.running))
        return total

    def prefill(self, new: int, cached: int, rng: np.random.Generator) -> float:
        best = float("inf")
        for _ in range(REPEATS):
            prefix = _ids(rng, cached, self.vocab)
            if cached:
                self._run([prefix + _ids(rng, 1, self.vocab)], 1)  # the prefix into the cache
            best = min(best, self._run([prefix + _ids(rng, new, self.vocab)], 1))
        return best

    def decode(self, batch: int, context: int, steps: int, rng: np.random.Generator) -> float:
        best = float("inf")
        for _ in range(REPEATS):
            times: list[float] = []

            def record(dt: float, running: int, times: list[float] = times) -> None:
                if running == batch and len(times) < steps + 2:
                    times.append(dt)

            self._run([_ids(rng, context, self.vocab) for _ in range(batch)], steps + 3, record)
            # steps where every request decodes: drop the first two (the last prefill may still share one)
            decode_steps = times[2:] or times
            best = min(best, statistics.median(decode_steps))
        return best

    def kv(self) -> tuple[int, int, int]:
        """(pool tokens, bytes per token, block size)."""
        r = self.engine.runner
        return r.num_blocks * r.block_size, r.block_bytes // r.block_size, r.block_size

    def settings(self) -> EngineSettings:
        s = self.engine.scheduler
        cfg = self.engine.config
        return EngineSettings(block_size=self.engine.blocks.block_size, max_num_seqs=s.max_num_seqs,
                              max_num_batched_tokens=s.max_num_batched_tokens,
                              prefill_only_chunk_tokens=s.prefill_only_chunk_tokens,
                              enable_chunked_prefill=s.enable_chunked_prefill,
                              enable_prefix_caching=cfg.enable_prefix_caching)


def http_settings(info: dict[str, Any]) -> tuple[EngineSettings, bool]:
    """A server's scheduler settings from its /pdserve/info (`scheduler`), and whether they were read there; a
    server that does not say (an older pdserve, vLLM) gets pdserve's defaults for its device."""
    from pdserve.types.engine_config import DEFAULT_GPU_BUDGET, PREFILL_ONLY_CHUNK_GPU

    bs = int(info.get("block_size", 16))
    sched = info.get("scheduler")
    if isinstance(sched, dict):
        return EngineSettings(block_size=bs, max_num_seqs=int(sched["max_num_seqs"]),
                              max_num_batched_tokens=int(sched["max_num_batched_tokens"]),
                              prefill_only_chunk_tokens=int(sched["prefill_only_chunk_tokens"]),
                              enable_chunked_prefill=bool(sched["enable_chunked_prefill"]),
                              enable_prefix_caching=bool(sched["enable_prefix_caching"])), True
    gpu = str(info.get("device", "cpu")).startswith("cuda")
    return EngineSettings(block_size=bs, max_num_batched_tokens=DEFAULT_GPU_BUDGET if gpu else 2048,
                          prefill_only_chunk_tokens=PREFILL_ONLY_CHUNK_GPU if gpu else 0), False


def copy_rate(nbytes: int = 64 << 20, device: str = "cpu") -> float:
    """Bytes/s of a memory copy on `device`: on one host the KV READ is a copy (BENCHMARKS.md, issue 4: NIXL READ
    1.14x a one-thread torch copy on the CPU box); on one GPU (P and D sharing it: CUDA IPC) a device copy."""
    import torch

    gpu = device.startswith("cuda")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            if gpu:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            if gpu:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(prev)


class HttpMeasure:
    """A running pdserve (or vLLM) server, through /v1/completions with token-id prompts."""

    def __init__(self, url: str, model: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.info: dict[str, Any] = {}
        self.vocab = 32000

    async def _start(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(f"{self.url}/v1/models") as r:
                self.model = self.model or (await r.json())["data"][0]["id"]
            async with s.get(f"{self.url}/pdserve/info") as r:
                if r.status == 200:
                    self.info = await r.json()

    async def _stream(self, session: Any, prompt: list[int], max_tokens: int) -> list[float]:
        """Token arrival times (perf_counter) of one streamed completion, the send time first."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        times = [time.perf_counter()]
        async with session.post(f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        times.append(time.perf_counter())
        return times

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def _prefill(self, new: int, cached: int, rng: np.random.Generator) -> float:
        import aiohttp

        best = float("inf")
        async with aiohttp.ClientSession() as s:
            for _ in range(REPEATS):
                prefix = _ids(rng, cached, self.vocab)
                if cached:
                    await self._stream(s, prefix + _ids(rng, 1, self.vocab), 1)
                t = await self._stream(s, prefix + _ids(rng, new, self.vocab), 1)
                best = min(best, t[1] - t[0])
        return best

    def prefill(self, new: int, cached: int, rng: np.random.Generator) -> float:
        return self.run(self._prefill(new, cached, rng))

    async def _decode(self, batch: int, context: int, steps: int, rng: np.random.Generator) -> float:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            best = float("inf")
            for _ in range(REPEATS):
                runs = await asyncio.gather(*(self._stream(s, _ids(rng, context, self.vocab), steps + 8)
                                              for _ in range(batch)))
                start = max(r[1] for r in runs)  # every request has its first token: all decode from here
                gaps = [b - a for r in runs for a, b in zip(r[1:], r[2:], strict=False) if a >= start]
                best = min(best, statistics.median(gaps) if gaps else float("inf"))
        return best

    def decode(self, batch: int, context: int, steps: int, rng: np.random.Generator) -> float:
        return self.run(self._decode(batch, context, steps, rng))

    def kv(self) -> tuple[int, int, int]:
        bs = int(self.info.get("block_size", 16))
        blocks = int(self.info.get("num_gpu_blocks", 0))
        tier = (self.info.get("kv_tiers") or [{}])[0]
        nbytes = int(tier.get("capacity_bytes", 0))
        return blocks * bs, (nbytes // max(blocks * bs, 1)) if nbytes else 0, bs


def measure(m: EngineMeasure | HttpMeasure, *, prefill_lens: Sequence[int], cached_lens: Sequence[int],
            decode_batches: Sequence[int], decode_contexts: Sequence[int], decode_steps: int,
            log: Callable[[str], None] = print, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    pre: list[dict] = []
    for cached in cached_lens:
        for new in prefill_lens:
            s = m.prefill(new, cached, rng)
            pre.append({"new": new, "cached": cached, "seconds": s})
            log(f"prefill new={new} cached={cached}: {s * 1e3:.1f} ms")
    dec: list[dict] = []
    for ctx in decode_contexts:
        for b in decode_batches:
            s = m.decode(b, ctx, decode_steps, rng)
            dec.append({"batch": b, "context": b * (ctx + 2), "seconds": s})
            log(f"decode batch={b} context={ctx} each: {s * 1e3:.2f} ms/step")
    return pre, dec


def http_path_s(one_token_ttft: float, decode_points: Sequence[dict]) -> float:
    """The HTTP path of a request (client to engine and the token back): a one-token prompt's TTFT less the one
    engine step it took, read as the smallest-batch decode step measured (one row, little context)."""
    step = min((p["seconds"] for p in decode_points), default=0.0)
    return max(0.0, one_token_ttft - step)


def load_average() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def base_profile(name: str, model: str, device: str, kv: tuple[int, int, int], settings: EngineSettings,
                 tp: int, kv_dtype: str) -> Profile:
    tokens, per_token, _ = kv
    return Profile(name=name, model=model, device=device, tp=tp, kv_cache_dtype=kv_dtype, kv_capacity_tokens=tokens,
                   kv_bytes_per_token=per_token, engine=settings)
