"""Multi-turn conversations: `pdserve bench --dataset-name multiturn` (synthetic) or `sharegpt` (a file).

Each conversation runs its turns in order over the chat API: the request carries the whole conversation
so far (the shared system prompt, every earlier user message and the server's own earlier answers), the
answer is appended, the client "thinks" for `--multiturn-think-time` seconds, then sends the next user
message. Conversations run side by side up to `--max-concurrency` (default: all at once).

What it reports, per turn index: TTFT (mean, p50, p99), prompt tokens, the tokens new in that turn (this
prompt minus the previous prompt and answer), and the prefill tokens actually computed (prompt tokens minus
`usage.prompt_tokens_details.cached_tokens`: whatever came from a prefix cache or another instance's held
KV). With multi-turn reuse (decode instances with `bidirectional_kv_xfer`, see ARCHITECTURE.md) the computed
tokens approach the new ones; without it they grow with the conversation.

Synthetic conversations: one system prompt shared by all conversations (`--multiturn-system-len` tokens),
`--multiturn-turns` user messages of `--multiturn-user-len` tokens, answers of `--multiturn-answer-len`
tokens (`ignore_eos`). ShareGPT files: a JSON list of `{"conversations": [{"from": "human"|"gpt"|"system",
"value": text}, ...]}` (or `messages` with `role`/`content`); the human turns are sent, the answers are the
server's (`--multiturn-answer-len` tokens each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from pdserve.bench.client import request_chat
from pdserve.bench.datasets import allowed_token_ids, decode_to_target_len
from pdserve.bench.types import RequestInput

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class Conversation:
    user_messages: list[str]
    system: str | None = None
    answer_len: int = 64


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str = ""

    @property
    def computed_tokens(self) -> int | None:
        return None if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens


@dataclass
class MultiTurnOptions:
    turns: int = 6
    system_len: int = 512
    user_len: int = 128
    answer_len: int = 64
    think_time: float = 0.0


def _random_text(tokenizer: Any, n: int, rng: np.random.Generator, allowed: np.ndarray) -> str:
    ids = [int(t) for t in allowed[rng.integers(0, len(allowed), size=n)]]
    text, _, _ = decode_to_target_len(tokenizer, ids, n, rng, allowed)
    return text


def synthetic_conversations(tokenizer: Any, num: int, opts: MultiTurnOptions, seed: int = 0) -> list[Conversation]:
    """`num` conversations sharing one system prompt, each of `opts.turns` random user messages."""
    if opts.turns < 1 or opts.user_len < 1 or opts.answer_len < 1 or opts.system_len < 0:
        raise ValueError("--multiturn-turns, --multiturn-user-len and --multiturn-answer-len must be >= 1")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    system = _random_text(tokenizer, opts.system_len, rng, allowed) if opts.system_len else None
    return [Conversation([_random_text(tokenizer, opts.user_len, rng, allowed) for _ in range(opts.turns)],
                         system, opts.answer_len) for _ in range(num)]


def load_sharegpt(path: str, num: int, opts: MultiTurnOptions) -> list[Conversation]:
    """ShareGPT-format conversations (cycled when the file has fewer than `num`), at most `opts.turns` user
    turns each; conversations without a user turn are skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    out: list[Conversation] = []
    for i, row in enumerate(data):
        turns = row.get("conversations", row.get("messages")) if isinstance(row, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: entry {i} has no 'conversations' (or 'messages') list")
        system, users = None, []
        for t in turns:
            if not isinstance(t, dict):
                raise ValueError(f"{path}: entry {i}: each turn must be an object")
            who = t.get("from", t.get("role"))
            text = t.get("value", t.get("content"))
            if not isinstance(text, str):
                raise ValueError(f"{path}: entry {i}: a turn without a text 'value'/'content'")
            if who == "system" and system is None and not users:
                system = text
            elif who in ("human", "user"):
                users.append(text)
        if users:
            out.append(Conversation(users[: opts.turns], system, opts.answer_len))
    if not out:
        raise ValueError(f"{path}: no conversation with a human turn")
    return [out[i % len(out)] for i in range(num)]


async def _run_conversation(index: int, conv: Conversation, session: aiohttp.ClientSession,
                            make_input: Any, think_time: float) -> list[TurnResult]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    results: list[TurnResult] = []
    for turn, user in enumerate(conv.user_messages):
        messages.append({"role": "user", "content": user})
        inp: RequestInput = make_input(list(messages), conv.answer_len, f"c{index}-t{turn}")
        out = await request_chat(inp, session, None)
        res = TurnResult(index, turn, out.success, out.ttft, out.latency, out.prompt_len, out.cached_tokens,
                         out.output_tokens, out.error[-500:])
        results.append(res)
        if not out.success:
            break  # the rest of the conversation would be built on an answer that never came
        messages.append({"role": "assistant", "content": out.generated_text})
        if think_time > 0 and turn + 1 < len(conv.user_messages):
            await asyncio.sleep(think_time)
    return results


async def run_conversations(conversations: list[Conversation], make_input: Any, *, think_time: float = 0.0,
                            max_concurrency: int | None = None) -> tuple[list[TurnResult], float]:
    """Every conversation's turns in order, conversations side by side; returns (turn results, seconds)."""
    sem: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext())
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:

        async def one(i: int, conv: Conversation) -> list[TurnResult]:
            async with sem:
                return await _run_conversation(i, conv, session, make_input, think_time)

        start = time.perf_counter()
        per_conv = await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations)))
        duration = time.perf_counter() - start
    return [r for rs in per_conv for r in rs], duration


@dataclass
class TurnSummary:
    turn: int
    count: int
    failed: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens_mean: float
    new_tokens_mean: float
    computed_tokens_mean: float | None  # prefill tokens computed: prompt - cached (None: no usage details)
    cached_tokens_mean: float | None
    computed_over_new: float | None = field(default=None)


def summarize_turns(results: list[TurnResult]) -> list[TurnSummary]:
    by_conv: dict[int, dict[int, TurnResult]] = {}
    for r in results:
        by_conv.setdefault(r.conversation, {})[r.turn] = r
    out: list[TurnSummary] = []
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn]
        ok = [r for r in rows if r.ok]
        ttfts = np.asarray([r.ttft * 1e3 for r in ok]) if ok else np.asarray([math.nan])
        new: list[int] = []
        for r in ok:
            prev = by_conv[r.conversation].get(turn - 1)
            new.append(r.prompt_tokens - (prev.prompt_tokens + prev.completion_tokens if prev is not None else 0))
        computed = [r.computed_tokens for r in ok if r.computed_tokens is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        new_mean = float(np.mean(new)) if new else math.nan
        comp_mean = float(np.mean(computed)) if computed else None
        out.append(TurnSummary(
            turn, len(rows), len(rows) - len(ok), float(np.mean(ttfts)), float(np.percentile(ttfts, 50)),
            float(np.percentile(ttfts, 99)), float(np.mean([r.prompt_tokens for r in ok])) if ok else math.nan,
            new_mean, comp_mean, float(np.mean(cached)) if cached else None,
            comp_mean / new_mean if comp_mean is not None and new_mean > 0 else None))
    return out


def format_turns(summary: list[TurnSummary], duration: float) -> str:
    lines = [f"{' Multi-turn result ':=^96}",
             f"{'turn':>4} {'ok/n':>7} {'TTFT mean':>10} {'p50':>9} {'p99':>9} {'prompt':>8} {'new':>7} "
             f"{'cached':>8} {'computed':>9} {'comp/new':>9}"]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    for s in summary:
        lines.append(f"{s.turn:>4} {s.count - s.failed:>3}/{s.count:<3} {num(s.ttft_mean_ms, '.1f'):>10} "
                     f"{num(s.ttft_p50_ms, '.1f'):>9} {num(s.ttft_p99_ms, '.1f'):>9} "
                     f"{num(s.prompt_tokens_mean, '.0f'):>8} {num(s.new_tokens_mean, '.0f'):>7} "
                     f"{num(s.cached_tokens_mean, '.0f'):>8} {num(s.computed_tokens_mean, '.0f'):>9} "
                     f"{num(s.computed_over_new, '.2f'):>9}")
    lines.append(f"(TTFT in ms; tokens are means per request; duration {duration:.2f} s)")
    lines.append("=" * 96)
    return "\n".join(lines)


def plot_ttft_by_turn(series: dict[str, list[TurnSummary]], path: str, title: str = "TTFT by turn") -> str:
    """One line per labelled run: TTFT p50 (solid) and mean (dotted) against the turn index."""
    from pdserve.bench.plots import _figure, _save

    fig, ax = _figure(title, "turn", "TTFT (ms)")
    for label, summary in series.items():
        turns = [s.turn for s in summary]
        line = ax.plot(turns, [s.ttft_p50_ms for s in summary], marker="o", label=f"{label} p50")[0]
        ax.plot(turns, [s.ttft_mean_ms for s in summary], linestyle=":", color=line.get_color(),
                label=f"{label} mean")
    ax.set_xticks(sorted({s.turn for summary in series.values() for s in summary}))
    ax.legend()
    return _save(fig, path)


def result_json(summary: list[TurnSummary], results: list[TurnResult], duration: float,
                opts: MultiTurnOptions) -> dict[str, Any]:
    return {"dataset": "multiturn", "duration": duration, "options": asdict(opts),
            "turns": [asdict(s) for s in summary],
            "completed": sum(r.ok for r in results), "failed": sum(not r.ok for r in results),
            "requests": [asdict(r) for r in results]}
