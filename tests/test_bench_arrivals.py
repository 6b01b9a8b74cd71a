"""Arrival process of `pdserve bench` (vLLM's gamma/Poisson draws, rescaled to N/rate) and SSE parsing."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, paced
from pdserve.bench.client import SSEDecoder, chat_token_text, completions_token_text


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], offsets]))


def test_deterministic_with_seed() -> None:
    a = arrival_offsets(50, 3.0, 1.0, np.random.RandomState(7))
    b = arrival_offsets(50, 3.0, 1.0, np.random.RandomState(7))
    c = arrival_offsets(50, 3.0, 1.0, np.random.RandomState(8))
    assert a == b
    assert a != c


def test_rescaled_so_last_send_is_n_over_rate() -> None:
    for burstiness in (0.5, 1.0, 3.0):
        offsets = arrival_offsets(40, 2.5, burstiness, np.random.RandomState(0))
        assert offsets[-1] == pytest.approx(40 / 2.5, rel=1e-12)
        assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
        assert offsets[0] > 0  # the first request waits for its own gap, as in vLLM


def test_infinite_rate_and_infinite_burstiness() -> None:
    assert arrival_offsets(5, math.inf, 1.0, np.random.RandomState(0)) == [0.0] * 5
    uniform = arrival_offsets(4, 2.0, math.inf, np.random.RandomState(0))
    assert uniform == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(0, 1.0, 1.0, np.random.RandomState(0)) == []
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, np.random.RandomState(0))
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, np.random.RandomState(0))


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_rate_and_burstiness_statistics(burstiness: float, cv: float) -> None:
    """Gamma(k) gaps: mean 1/rate (exact after rescaling), coefficient of variation 1/sqrt(k)."""
    rate, n = 4.0, 20000
    gaps = _gaps(arrival_offsets(n, rate, burstiness, np.random.RandomState(123)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    if burstiness == 1.0:  # exponential gaps: P(gap < mean) = 1 - 1/e
        assert np.mean(gaps < 1 / rate) == pytest.approx(1 - math.exp(-1), abs=0.015)


def test_paced_never_dispatches_early() -> None:
    offsets = [0.0, 0.01, 0.03, 0.05]

    async def run() -> list[tuple[int, float]]:
        start = time.perf_counter()
        return [(i, time.perf_counter() - start) async for i in paced(range(4), offsets)]

    sent = asyncio.run(run())
    assert [i for i, _ in sent] == [0, 1, 2, 3]
    for (_, t), offset in zip(sent, offsets, strict=True):
        assert t >= offset - 0.005  # event-loop clock granularity


def test_sse_decoder_reassembles_split_events() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\n") == []
    assert d.feed(b'\ndata: {"b": 2}\r\n\r\n: ping comment\n\ndata: [DONE]\n\n') == [
        '{"a": 1}',
        '{"b": 2}',
        "[DONE]",
    ]
    assert d.feed(b"data: tail") == []
    assert d.flush() == ["tail"]
    assert d.flush() == []


def test_token_bearing_messages() -> None:
    assert completions_token_text({"choices": [{"text": "hi"}]}) == "hi"
    assert completions_token_text({"choices": [{"text": ""}]}) == ""  # empty text still counts
    assert completions_token_text({"choices": [], "usage": {"completion_tokens": 3}}) is None
    assert chat_token_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) is None
    assert chat_token_text({"choices": [{"delta": {"content": ""}}]}) == ""
    assert chat_token_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert chat_token_text({"choices": [{"delta": {"reasoning_content": "think"}}]}) == ""
    assert chat_token_text({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}) == ""
    assert chat_token_text({"choices": [{"delta": {}, "finish_reason": "stop"}]}) is None
    assert chat_token_text({"choices": [], "usage": {}}) is None
