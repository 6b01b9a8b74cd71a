"""No process outlives `pdserve render` (its worker processes and the multiprocessing resource tracker),
whether it gets SIGTERM during startup, SIGINT while serving, or SIGKILL. (That no test leaves any process
behind at all is checked by tests/conftest.py at the end of the session.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from launch_helpers import children_of, wait_until
from test_render_support import Proc, make_tokenizer_dir

from pdserve.launch.procs import pid_alive

WORKERS = 2


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("leaks"))


def start_render(tok_dir: Path, log: Path) -> Proc:
    return Proc(log, "render", str(tok_dir), "--max-model-len", "256", "--renderer-num-workers", str(WORKERS))


def helpers_of(proc: Proc) -> list[int]:
    """The render server's child processes: its workers and the resource tracker, once all started."""
    found: list[int] = []

    def started() -> bool:
        found[:] = children_of(proc.proc.pid)
        return len(found) >= WORKERS + 1 or proc.proc.poll() is not None

    assert wait_until(started, 180, step=0.05), "the render workers did not start"
    assert proc.proc.poll() is None, proc.log()
    return list(found)


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "startup"), (signal.SIGINT, "serving"),
                                       (signal.SIGKILL, "serving")])
def test_render_leaves_no_process(tok_dir: Path, tmp_path: Path, sig: signal.Signals, when: str) -> None:
    proc = start_render(tok_dir, tmp_path / "render.log")
    helpers: list[int] = []
    try:
        if when == "serving":
            proc.wait_ready()
        helpers = helpers_of(proc)  # during startup: as soon as the workers exist, before /health is 200
        proc.proc.send_signal(sig)
        rc = proc.proc.wait(60)
        if sig != signal.SIGKILL:
            assert rc == 0, proc.log()
        # SIGKILL: nothing ran in the server; the workers notice their parent is gone and exit
        assert wait_until(lambda: not any(pid_alive(p) for p in helpers), 30), (
            f"still running after {sig.name} during {when}: {[p for p in helpers if pid_alive(p)]}\n{proc.log()}"
        )
    finally:
        proc.stop()
        for pid in helpers:  # whatever happened, none of them outlives the test
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
