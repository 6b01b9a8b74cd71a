"""Step thread counts on CPU: PDSERVE_CPU_THREADS parsing and per-step choice."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.cpu.threads import BIND_ENV, DECODE_STEP_TOKENS, ENV, StepThreads


def test_default_leaves_one_core(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    t = StepThreads.from_env()
    n = max(1, torch.get_num_threads() - 1)
    assert (t.decode, t.prefill) == (n, n)


def test_decode_and_prefill_sized_steps():
    t = StepThreads(1, 3)
    assert t.for_step(1) == t.for_step(DECODE_STEP_TOKENS) == 1
    assert t.for_step(DECODE_STEP_TOKENS + 1) == 3


@pytest.mark.parametrize("value,expect", [("2", (2, 2)), ("1,3", (1, 3)), (" 2,1 ", (2, 1))])
def test_env_sets_counts(monkeypatch, value, expect):
    monkeypatch.setenv(ENV, value)
    t = StepThreads.from_env()
    assert (t.decode, t.prefill) == expect


@pytest.mark.parametrize("value", ["x", "1,2,3", "0", "1,-1", "1.5"])
def test_bad_env_is_an_error(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        StepThreads.from_env()


def test_apply_sets_the_stepping_threads_count():
    seen = []

    def step():  # the engine steps in its own thread; OpenMP's count is per thread
        t = StepThreads(1, 2)
        t.apply(1)
        seen.append(torch.get_num_threads())
        t.apply(DECODE_STEP_TOKENS + 1)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    th = threading.Thread(target=step)
    th.start()
    th.join(60)
    torch.set_num_threads(before)
    assert seen == [1, 2]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")
def test_bind_pins_only_the_stepping_thread(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv(BIND_ENV, "1")
    t = StepThreads.from_env()
    assert t.bind
    process_cores = os.sched_getaffinity(0)
    seen = []

    def step():
        t.apply(1)
        seen.append(os.sched_getaffinity(0))  # pid 0: this thread

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    assert seen == [{min(process_cores)}]
    assert os.sched_getaffinity(0) == process_cores  # the other threads keep every core
