"""Shared fixtures: tiny random-weight models built locally (no downloads)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")

@pytest.fixture(scope="session")
def pd_reference(tmp_path_factory):
    """The collocated `pdserve serve` whose answers the P/D e2e files compare against: make_model_dir's tiny
    model (seeded: every call writes the same bytes) with test_pd_e2e's flags. Its greedy answers do not depend
    on what it served before, so one is started for the session instead of one per module (each start costs a
    process's torch import and model load on the 2-core CI box). A module fixture lists it beside its own
    servers and calls wait_ready(); it is stopped here, at the end of the session."""
    from server_utils import make_model_dir
    from test_pd_e2e import start  # skips where NIXL is missing, as the files that use it do

    srv = start(make_model_dir(tmp_path_factory.mktemp("pd-reference-model")),
                tmp_path_factory.mktemp("pd-reference-logs"), "collocated")
    try:
        yield srv
    finally:
        srv.stop()


# CI runs property tests with a fixed seed, so a red build is reproducible and never a coin flip.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass


# -- no process left behind ------------------------------------------------------------------------------
# pytest becomes a child subreaper (Linux), so that a process orphaned by a test (a worker whose server was
# killed, a grandchild of a launcher) is reparented to pytest rather than to init. At the end of the session
# every live child of pytest is a leak: it is listed, killed by PID and the run fails.

LEFTOVER_GRACE_S = 10.0  # processes still shutting down when the last test ended get this long


def _live_children(pid: int) -> dict[int, str]:
    """Live (non-zombie) children of `pid`: {pid: command line}, from /proc."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) != pid or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except (OSError, ValueError):
            continue
    return out


def _reap_zombies() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from multiprocessing import resource_tracker

    if not os.path.isdir("/proc/self"):
        return
    # This process's own multiprocessing resource tracker (tests that used multiprocessing in-process)
    # is stopped like at interpreter exit; it is not a leak.
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_pid", None) is not None:
        tracker._stop()
    me = os.getpid()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while _live_children(me) and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.2)
    leftovers = _live_children(me)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    _reap_zombies()
    if leftovers:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(leftovers.items()))
        session.config.get_terminal_writer().line(
            f"\nFAILED: {len(leftovers)} process(es) started by the tests outlived them (now killed):\n{lines}",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
