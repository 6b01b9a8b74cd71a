"""Step thread counts on CPU: PDSERVE_CPU_THREADS parsing and per-step choice."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.cpu.spare_cores import SpareCores
from pdserve.cpu.threads import BIND_ENV, DECODE_STEP_TOKENS, ENV, StepThreads


def test_default_leaves_one_core_unless_the_machine_is_idle(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    t = StepThreads.from_env()
    cores = torch.get_num_threads()
    n = max(1, cores - 1)
    assert (t.decode, t.prefill) == (n, n)
    assert t.spare_max == (cores if cores > 1 and SpareCores().available else None)


def test_fixed_count_never_takes_more(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    t = StepThreads.from_env()
    assert t.spare is None and t.for_step(1) == t.for_step(DECODE_STEP_TOKENS + 1) == 1


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


class _Counters:
    """Scripted (machine busy s, own busy s) readings and a clock for SpareCores."""

    def __init__(self):
        self.now = 0.0
        self.machine = 100.0
        self.own = 10.0

    def advance(self, dt: float, machine_cores: float, own_cores: float) -> None:
        self.now += dt
        self.machine += dt * machine_cores
        self.own += dt * own_cores


def test_spare_cores_subtracts_this_process():
    c = _Counters()
    spare = SpareCores(window_s=1.0, sample_s=0.1, counters=lambda: (c.machine, c.own), clock=lambda: c.now)
    assert spare.available
    assert spare.others_busy() is None  # one sample: no window yet
    for _ in range(20):  # 2 s: the machine busy 1.2 cores, of which this process 1.0
        c.advance(0.1, 1.2, 1.0)
        busy = spare.others_busy()
    assert busy == pytest.approx(0.2)
    for _ in range(20):  # another process takes a core: seen within the 1 s window
        c.advance(0.1, 2.0, 1.0)
        busy = spare.others_busy()
    assert busy == pytest.approx(1.0)
    c.advance(60.0, 0.0, 0.0)  # an idle spell: the old window does not count
    assert spare.others_busy() is None


def test_spare_cores_reads_this_machine():
    spare = SpareCores(window_s=10.0, sample_s=0.2)
    if not spare.available:
        pytest.skip("no /proc/stat here")
    busy = None
    for _ in range(10_000):  # bounded: our own CPU for at least one 0.2 s sample interval
        sum(i * i for i in range(2_000))
        busy = spare.others_busy()
        if busy is not None:
            break
    assert busy is not None
    # the counters tick at 10 ms: over >= 0.2 s, within a tenth of a core of the truth per CPU
    assert 0.0 <= busy <= (os.cpu_count() or 1) * 1.1


def test_auto_takes_every_core_only_while_the_others_leave_them_idle():
    c = _Counters()
    spare = SpareCores(window_s=1.0, sample_s=0.1, counters=lambda: (c.machine, c.own), clock=lambda: c.now)
    t = StepThreads(1, 1, spare_max=2, spare=spare)
    assert t.for_step(1) == 1  # no window yet: the base count
    for _ in range(15):
        c.advance(0.1, 1.1, 1.0)
    assert t.for_step(1) == t.for_step(DECODE_STEP_TOKENS + 1) == 2
    for _ in range(15):
        c.advance(0.1, 2.0, 1.0)
    assert t.for_step(1) == 1


def test_env_auto(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    t = StepThreads.from_env()
    cores = torch.get_num_threads()
    assert (t.decode, t.prefill) == (max(1, cores - 1),) * 2
    if cores > 1 and SpareCores().available:
        assert t.spare_max == cores and t.spare is not None
    else:
        assert t.spare is None


def test_spare_cores_counts_a_busy_main_thread_as_others():
    """From a stepping thread, the main thread's CPU (a server's event loop) is not the steps' own."""
    spare = SpareCores(window_s=10.0, sample_s=0.2)
    if not spare.available or not os.path.exists(f"/proc/self/task/{os.getpid()}/stat"):
        pytest.skip("no /proc here")
    from pdserve.cpu import spare_cores

    seen = {}

    def step():
        seen["first"] = spare_cores._step_counters()[1]

    before = spare_cores._step_counters()[1]  # main thread: all of this process
    th = threading.Thread(target=step)
    th.start()
    th.join(60)
    # this process's CPU less its main thread's, which has done all the work so far (imports, tests)
    assert seen["first"] < before


def test_observe_keeps_the_window_fresh_across_a_lull():
    c = _Counters()
    spare = SpareCores(window_s=1.0, sample_s=0.1, counters=lambda: (c.machine, c.own), clock=lambda: c.now)
    t = StepThreads(1, 1, spare_max=2, spare=spare)
    for _ in range(15):  # steps while another process is busy
        c.advance(0.1, 2.0, 1.0)
        t.for_step(1)
    for _ in range(100):  # the engine idles 10 s, the machine too; observed between steps
        c.advance(0.1, 0.05, 0.0)
        t.observe()
    assert t.for_step(DECODE_STEP_TOKENS + 1) == 2  # the burst's first (prefill) step sees the idle cores


def _idle_auto(spare_max: int = 2) -> StepThreads:
    """`auto` with the other processes idle: every decode step may take every core."""
    c = _Counters()
    spare = SpareCores(window_s=1.0, sample_s=0.1, counters=lambda: (c.machine, c.own), clock=lambda: c.now)
    for _ in range(15):
        spare.others_busy()
        c.advance(0.1, 1.1, 1.0)
    assert spare.others_busy() == pytest.approx(0.1)
    return StepThreads(1, 1, spare_max=spare_max, spare=spare)


@pytest.mark.parametrize(("one_s", "two_s", "favoured"), [(0.047, 0.050, 1), (0.060, 0.041, 2)])
def test_auto_decode_steps_run_the_count_measured_faster(one_s, two_s, favoured):
    """Served, the second core can be slower for a short decode step (the event loop takes it mid-step);
    offline it is faster: `auto` measures both per batch bucket, runs the faster and now and then the other."""
    from pdserve.cpu.threads import EXPLORE_EVERY

    t = _idle_auto()
    seen = []
    for _ in range(4 * EXPLORE_EVERY):
        n = t.for_step(4)
        seen.append(n)
        t.record(4, n, one_s if n == 1 else two_s)
    assert seen[:2] == [2, 1]  # each count measured once first
    later = seen[2:]
    other = 3 - favoured
    assert later.count(other) == sum(1 for k in range(3, 4 * EXPLORE_EVERY + 1) if k % EXPLORE_EVERY == 0)
    assert later.count(favoured) == len(later) - later.count(other)
    assert t.decode_choice.estimates(4) == pytest.approx({1: one_s, 2: two_s})
    assert t.for_step(DECODE_STEP_TOKENS + 1) == 2  # prefill-sized steps: every idle core, as before
    assert t.for_step(40) == 2  # another batch bucket: measured on its own


def test_fixed_counts_learn_nothing(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    t = StepThreads.from_env()
    t.record(4, 1, 0.05)
    assert t.decode_choice is None and t.for_step(4) == 1
