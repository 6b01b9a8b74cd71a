"""What the simulated clients send: `pdserve bench serve`'s own workloads (bench/datasets.py and
bench/arrivals.py, the same seeded draws as a real run with the same flags) or a trace file of public LLM
serving traces' columns.

Trace files (CSV or JSONL), one request per row, columns matched case-insensitively:
- arrival: `TIMESTAMP` (Azure LLM inference traces: a date-time), `timestamp` (Mooncake traces: milliseconds),
  `arrival_time` / `time` (seconds);
- prompt tokens: `ContextTokens`, `input_length`, `input_tokens`, `prompt_len`, `prompt_tokens`;
- output tokens: `GeneratedTokens`, `output_length`, `output_tokens`, `output_len`;
- optional `hash_ids` (Mooncake): the prompt's 512-token blocks' ids, so that prompts sharing a prefix share
  those blocks in the prefix cache; without it every trace prompt is unique.
Arrivals are shifted so that the first is at 0.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.options import BenchSpec
from pdserve.kv_events.block_hash import block_hashes as chained_block_hashes
from pdserve.sim.token_ids import IdTokenizer

MOONCAKE_BLOCK_TOKENS = 512  # what one Mooncake trace hash id covers

TIME_COLUMNS = ("timestamp", "arrival_time", "time")
INPUT_COLUMNS = ("contexttokens", "input_length", "input_tokens", "prompt_len", "prompt_tokens")
OUTPUT_COLUMNS = ("generatedtokens", "output_length", "output_tokens", "output_len")


_ZEROS: dict[int, list[int]] = {}
_INDEXES: list[bytes] = []  # struct.pack("<I", i) for every block index i asked so far


def _block_indexes(n: int) -> list[bytes]:
    """The packed indexes of a prompt's first n blocks (packed once per run, not once per request)."""
    if len(_INDEXES) < n:
        _INDEXES.extend(struct.pack("<I", i) for i in range(len(_INDEXES), n))
    return _INDEXES[:n]


@dataclass(eq=False)
class Job:
    """One request of the workload."""

    index: int
    arrival: float  # seconds after the first dispatch
    prompt_len: int
    output_len: int
    token_ids: list[int] | None = None  # the prompt's ids (bench datasets); None: a trace row (lengths only)
    hash_ids: list[int] | None = None  # a trace row's 512-token block ids (Mooncake)
    _hashes: dict[int, list[bytes]] | None = None

    def prompt_ids(self) -> list[int]:
        """Token ids for the Request (a trace row's are placeholders, one shared list per length: its block
        identities are `block_hashes`; the engine never writes a prompt's ids)."""
        if self.token_ids is not None:
            return self.token_ids
        zeros = _ZEROS.get(self.prompt_len)
        if zeros is None:
            zeros = _ZEROS[self.prompt_len] = [0] * self.prompt_len
        return zeros

    def forget_hashes(self) -> None:
        """Its legs have their copies: a long run keeps no block identities of requests already sent."""
        self._hashes = None

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, computed once per block size: for token ids the
        engine's own (kv_events.block_hash, what BlockManager would compute on each instance); for a trace row
        identities from its hash ids (a prefix shared in the trace is shared here) or unique to the row."""
        if self._hashes is None:
            self._hashes = {}
        got = self._hashes.get(block_size)
        if got is None:
            full = self.prompt_len // block_size
            if self.token_ids is not None:
                got = chained_block_hashes(self.token_ids, block_size)
            elif self.hash_ids:
                per = max(1, MOONCAKE_BLOCK_TOKENS // block_size)
                ids = self.hash_ids
                got = [b"m" + struct.pack("<qI", ids[min(i // per, len(ids) - 1)] if i // per < len(ids)
                                          else -1 - self.index, i) for i in range(full)]
            else:
                tag = b"r" + struct.pack("<q", self.index)
                got = [tag + i for i in _block_indexes(full)]
            self._hashes[block_size] = got
        return got


def _bench_requests(spec: BenchSpec, vocab_size: int, tokenizer: Any | None) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, drawn by bench/datasets.py as `pdserve bench` draws them."""
    from pdserve.bench.datasets import load_jsonl, sample_random, sample_shared_prefix

    tok = IdTokenizer(vocab_size)
    if spec.dataset_name == "random":
        reqs = sample_random(tok, spec.num_prompts, spec.random_input_len, spec.random_output_len,
                             spec.random_range_ratio, spec.random_prefix_len, spec.seed)
    elif spec.dataset_name == "prefix":
        reqs = sample_shared_prefix(tok, spec.num_prompts, spec.prefix_len, spec.suffix_len, spec.num_prefixes,
                                    spec.random_output_len, spec.seed)
    elif spec.dataset_name == "jsonl":
        if tokenizer is None:
            raise ValueError("--dataset-name jsonl needs --tokenizer (the prompts' token ids)")
        assert spec.dataset_path is not None
        rows = load_jsonl(spec.dataset_path, spec.num_prompts, spec.random_output_len, tokenizer, spec.seed,
                          spec.shuffle)
        return [(tokenizer.encode(r.prompt, add_special_tokens=False), r.expected_output_len) for r in rows]
    else:
        raise ValueError(f"pdserve sim: --dataset-name {spec.dataset_name} is not simulated (random, prefix, "
                         "jsonl, or --trace FILE)")
    return [(tok.encode(r.prompt), r.expected_output_len) for r in reqs]


def bench_jobs(spec: BenchSpec, vocab_size: int = 32000, tokenizer: Any | None = None) -> list[Job]:
    """The workload `pdserve bench serve` would send with `spec`: its requests and its arrival times."""
    reqs = _bench_requests(spec, vocab_size, tokenizer)
    offsets = arrival_offsets(len(reqs), spec.request_rate, spec.burstiness, np.random.RandomState(spec.seed))
    return [Job(i, t, len(ids), out, token_ids=ids) for i, ((ids, out), t) in enumerate(zip(reqs, offsets,
                                                                                            strict=True))]


def _column(names: Sequence[str], wanted: Sequence[str]) -> str | None:
    lower = {n.lower(): n for n in names}
    return next((lower[w] for w in wanted if w in lower), None)


def _seconds(value: Any, column: str, unit: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return dt.datetime.fromisoformat(value.strip()[:26]).timestamp()  # Azure: 7 decimals; ISO takes 6
    value = float(value)
    if unit == "auto":
        unit = "ms" if column.lower() == "timestamp" else "s"
    return value / 1000.0 if unit == "ms" else value


def load_trace(path: str | Path, limit: int | None = None, time_unit: str = "auto") -> list[Job]:
    """A trace file's rows as jobs (at most `limit`), arrivals relative to the first row's."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    first = text.lstrip()[:1]
    rows: list[dict[str, Any]]
    if first == "{":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{path}: no rows")
    names = list(rows[0].keys())
    tcol, icol, ocol = _column(names, TIME_COLUMNS), _column(names, INPUT_COLUMNS), _column(names, OUTPUT_COLUMNS)
    if tcol is None or icol is None or ocol is None:
        raise ValueError(f"{path}: needs an arrival column ({'/'.join(TIME_COLUMNS)}), an input-token column "
                         f"({'/'.join(INPUT_COLUMNS)}) and an output-token column ({'/'.join(OUTPUT_COLUMNS)}); "
                         f"has {', '.join(names)}")
    hcol = _column(names, ("hash_ids",))
    jobs: list[Job] = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        prompt_len, output_len = int(float(row[icol])), int(float(row[ocol]))
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"{path}: row {i + 1}: input and output token counts must be >= 1")
        hashes = row.get(hcol) if hcol else None
        if isinstance(hashes, str):
            hashes = json.loads(hashes)
        jobs.append(Job(i, _seconds(row[tcol], tcol, time_unit), prompt_len, output_len, hash_ids=hashes))
    t0 = min(j.arrival for j in jobs)
    for j in jobs:
        j.arrival -= t0
    jobs.sort(key=lambda j: (j.arrival, j.index))
    return jobs


def write_trace(path: str | Path, jobs: Sequence[Job]) -> None:
    """Mooncake-style CSV (timestamp in ms, input_length, output_length) of `jobs`."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "input_length", "output_length"])
        for j in jobs:
            w.writerow([round(j.arrival * 1000.0, 3), j.prompt_len, j.output_len])


def poisson_jobs(n: int, rate: float, prompt_len: int, output_len: int, seed: int = 0) -> list[Job]:
    """`n` requests of fixed lengths at `rate` (bench/arrivals.py's Poisson draws): a trace-like workload
    (unique prompts, lengths only) for shapes too large to spell out token by token."""
    offsets = arrival_offsets(n, rate, 1.0, np.random.RandomState(seed)) if not math.isinf(rate) else [0.0] * n
    return [Job(i, t, prompt_len, output_len) for i, t in enumerate(offsets)]


@dataclass(eq=False)
class Conversation:
    """A multi-turn conversation (bench/multiturn.py's synthetic ones): turn k's prompt is the system prompt, the
    earlier user messages and answers, then user message k. Answers are the tokens the simulated instance
    samples (`answer_token`), so a later turn's prompt repeats them as a real client repeats the server's
    answer, and the prefix cache finds them. Chat-template tokens are not modelled."""

    index: int
    system: list[int]
    users: list[list[int]]
    answer_len: int
    answer_token: int
    turn: int = 0
    history: list[int] | None = None

    def next_job(self, index: int, arrival: float) -> Job | None:
        if self.turn >= len(self.users):
            return None
        if self.history is None:
            self.history = list(self.system)
        ids = self.history + self.users[self.turn]
        self.history = ids + [self.answer_token] * self.answer_len
        self.turn += 1
        return Job(index, arrival, len(ids), self.answer_len, token_ids=ids)


def multiturn_conversations(spec: BenchSpec, vocab_size: int, answer_token: int) -> list[Conversation]:
    """`pdserve bench --dataset-name multiturn`'s conversations, drawn by bench/multiturn.py itself."""
    from pdserve.bench.multiturn import MultiTurnOptions, synthetic_conversations

    tok = IdTokenizer(vocab_size)
    opts = MultiTurnOptions(spec.multiturn_turns, spec.multiturn_system_len, spec.multiturn_user_len,
                            spec.multiturn_answer_len, spec.multiturn_think_time)
    convs = synthetic_conversations(tok, spec.num_prompts, opts, spec.seed)
    return [Conversation(i, tok.encode(c.system) if c.system else [], [tok.encode(u) for u in c.user_messages],
                         c.answer_len, answer_token) for i, c in enumerate(convs)]
