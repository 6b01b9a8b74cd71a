"""Process management of `pdserve up`: process groups, readiness, teardown without orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch_helpers import port_free
from server_utils import free_port

from pdserve.launch import procs as launch_procs
from pdserve.launch.spec import ProcSpec

CHILD = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    write_marker, check_marker = (sys.argv[3:5] + ["-", "-"])[:2]
    if check_marker != "-":
        print("saw-marker", os.path.exists(check_marker), flush=True)
    if mode == "crash" or mode == "once" and os.path.exists(write_marker):
        print("fatal: cannot load model", flush=True)
        sys.exit(3)
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time\\n"
        "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "time.sleep(600)", mode])
    print("grandchild", grandchild.pid, flush=True)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = 200 if self.path == "/health" and mode != "never" else 503
            self.send_response(code)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), H)
    if write_marker != "-":
        open(write_marker, "w").close()
    server.serve_forever()
    """
)


def grandchild_pid(log: Path) -> int:
    for _ in range(200):
        m = re.search(r"grandchild (\d+)", log.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no grandchild pid in {log}: {log.read_text()!r}")


def spec(tmp_path: Path, name: str, mode: str) -> ProcSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = free_port()
    return ProcSpec(name, "decode", [sys.executable, str(script), str(port), mode], {"X_TEST": "1"},
                    "127.0.0.1", port, tmp_path / "logs" / f"{name}.log", cpus=[min(os.sched_getaffinity(0))])


def test_start_ready_stop_leaves_nothing(tmp_path: Path) -> None:
    s = spec(tmp_path, "decode", "normal")
    child = launch_procs.start(s)
    try:
        lines: list[str] = []
        res = launch_procs.wait_ready([child], 30, stopping=lambda: False, report=lines.append)
        assert res.ok and any("decode" in ln and "ready" in ln for ln in lines)
        gc = grandchild_pid(s.log_path)
        assert os.getpgid(child.pid) == child.pid and os.getpgid(gc) == child.pid  # own group, with its child
        assert os.sched_getaffinity(child.pid) == set(s.cpus or [])
        assert launch_procs.pid_alive(gc)
    finally:
        problems = launch_procs.stop_all([child], timeout=10)
    assert problems == []
    assert not launch_procs.pid_alive(child.pid) and not launch_procs.pid_alive(gc)
    assert port_free(s.port)


def test_sigterm_ignored_escalates_to_sigkill(tmp_path: Path) -> None:
    s = spec(tmp_path, "prefill", "ignore")
    child = launch_procs.start(s)
    try:
        assert launch_procs.wait_ready([child], 30, stopping=lambda: False, report=lambda _: None).ok
        gc = grandchild_pid(s.log_path)
    finally:
        problems = launch_procs.stop_all([child], timeout=0.5)
    assert len(problems) == 1 and "killed" in problems[0]
    assert not launch_procs.pid_alive(child.pid) and not launch_procs.pid_alive(gc)
    assert port_free(s.port)


def test_crash_at_startup_is_reported(tmp_path: Path) -> None:
    s = spec(tmp_path, "decode", "crash")
    child = launch_procs.start(s)
    try:
        res = launch_procs.wait_ready([child], 30, stopping=lambda: False, report=lambda _: None)
        assert not res.ok and res.failed is child and child.exited() == 3
        assert launch_procs.tail(s.log_path) == ["fatal: cannot load model"]
    finally:
        assert launch_procs.stop_all([child], timeout=5) == []


def test_never_ready_times_out_and_stop_request_interrupts(tmp_path: Path) -> None:
    s = spec(tmp_path, "decode", "never")
    child = launch_procs.start(s)
    try:
        res = launch_procs.wait_ready([child], 1.0, stopping=lambda: False, report=lambda _: None)
        assert not res.ok and res.timed_out == [child]
        res = launch_procs.wait_ready([child], 30, stopping=lambda: True, report=lambda _: None)
        assert not res.ok and res.interrupted
    finally:
        assert launch_procs.stop_all([child], timeout=10) == []
    assert not launch_procs.pid_alive(child.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_stop_when_launcher_is_killed(tmp_path: Path) -> None:
    s = spec(tmp_path, "decode", "normal")
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from pdserve.launch import procs as launch_procs
        from pdserve.launch.spec import ProcSpec
        watchdog = launch_procs.Watchdog(grace=5)
        child = launch_procs.start(ProcSpec("decode", "decode", {s.argv!r}, {{}}, "127.0.0.1", {s.port},
                                            Path({str(s.log_path)!r})))
        watchdog.watch(child)
        print(child.pid, watchdog.proc.pid, flush=True)
        time.sleep(600)
        """
    ))
    proc = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid, watchdog = (int(w) for w in proc.stdout.readline().split())
        gc = grandchild_pid(s.log_path)
    finally:
        proc.kill()
        proc.wait()
    # the watchdog saw its pipe close and stopped the child's whole group (grandchild included)
    for _ in range(300):
        if not any(launch_procs.pid_alive(p) for p in (pid, gc, watchdog)):
            break
        time.sleep(0.05)
    survivors = [p for p in (pid, gc, watchdog) if launch_procs.pid_alive(p)]
    for p in survivors:  # do not leak them into the rest of the suite, whatever happened
        os.kill(p, signal.SIGKILL)
    assert survivors == []
    assert port_free(s.port)


RUN = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pdserve.launch import cli as launch
    from pdserve.launch.config import LaunchConfig
    from pdserve.launch.spec import Deployment, ProcSpec
    specs = [ProcSpec(**{**d, "log_path": Path(d["log_path"])}) for d in json.loads(sys.argv[1])]
    cfg = LaunchConfig(log_dir=specs[0].log_path.parent, stop_timeout=10, startup_timeout=60,
                       **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
    dep = Deployment(specs[:-1], specs[-1], "toy", "cuda")
    sys.exit(launch.run(cfg, dep, demo=False, exit_after=False, demo_prompt=None, demo_max_tokens=1))
    """
)


def test_run_starts_waves_in_order_and_tears_down_on_sigterm(tmp_path: Path) -> None:
    """launch.run with toy children: a GPU-sharing second wave starts only after the first is healthy;
    SIGTERM stops every child (and grandchild) and frees every port."""
    import json

    (tmp_path / "child.py").write_text(CHILD)
    marker = tmp_path / "wave0-up"
    specs = []
    for name, role, wave, extra in (("prefill", "prefill", 0, [str(marker), "-"]),
                                    ("decode", "decode", 1, ["-", str(marker)]), ("proxy", "proxy", 0, [])):
        port = free_port()
        specs.append({"name": name, "role": role, "argv": [sys.executable, str(tmp_path / "child.py"), str(port),
                      "normal", *extra], "env": {}, "host": "127.0.0.1", "port": port,
                      "log_path": str(tmp_path / "logs" / f"{name}.log"), "gpu": "0", "wave": wave})
    (tmp_path / "run.py").write_text(RUN)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py"), json.dumps(specs)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PDSERVE_READY"):
                break
        ready = next((ln for ln in lines if ln.startswith("PDSERVE_READY")), None)
        assert ready is not None, "".join(lines)
        pids = [int(p) for p in re.search(r"pids=([\d,]+)", ready).group(1).split(",")]  # type: ignore[union-attr]
        assert len(pids) == 3
        grandchildren = [grandchild_pid(tmp_path / "logs" / f"{n}.log") for n in ("prefill", "decode", "proxy")]
        assert "saw-marker True" in (tmp_path / "logs" / "decode.log").read_text()
        assert re.search(r"waiting for prefill to answer", "".join(lines))
        assert re.search(r"waiting for decode to answer", "".join(lines))
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "stopping: proxy" in rest and rest.rstrip().endswith("stopped.")
        for p in pids + grandchildren:
            assert not launch_procs.pid_alive(p)
        for spec in specs:
            assert port_free(int(spec["port"]))  # type: ignore[arg-type]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if launch_procs.pid_alive(p):
                os.killpg(p, signal.SIGKILL)


def _toy_deployment(tmp_path: Path, prefill_mode: str, settings: dict) -> subprocess.Popen[str]:
    """launch.run over toy children (prefill in `prefill_mode`, decode, proxy), started as a subprocess."""
    import json

    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "run.py").write_text(RUN)
    specs = []
    for name, role, mode in (("prefill", "prefill", prefill_mode), ("decode", "decode", "normal"),
                             ("proxy", "proxy", "normal")):
        port = free_port()
        marker = str(tmp_path / f"{name}-started")
        specs.append({"name": name, "role": role, "argv": [sys.executable, str(tmp_path / "child.py"), str(port),
                      mode, marker, "-"], "env": {}, "host": "127.0.0.1", "port": port,
                      "log_path": str(tmp_path / "logs" / f"{name}.log")})
    return subprocess.Popen([sys.executable, str(tmp_path / "run.py"), json.dumps(specs), json.dumps(settings)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen[str], lines: list[str], pattern: str) -> re.Match[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no {pattern!r} before exit:\n{''.join(lines)}")


def _all_pids(text: str) -> set[int]:
    return {int(p) for p in re.findall(r"pid[s =]+([\d,]+)", text) for p in p.split(",") if p}


def test_dead_instance_is_restarted_while_the_others_keep_serving(tmp_path: Path) -> None:
    """SIGKILL of a serving child: restarted after its backoff on the same port, announced ready again,
    the others untouched; its log keeps the lines of the run before the restart."""
    proc = _toy_deployment(tmp_path, "normal", {"max_restarts": 3})
    lines: list[str] = []
    pids: set[int] = set()
    try:
        ready = _read_until(proc, lines, r"^PDSERVE_READY .*pids=([\d,]+)")
        prefill, decode, proxy = (int(p) for p in ready.group(1).split(","))
        pids = {prefill, decode, proxy}
        os.kill(prefill, signal.SIGKILL)
        _read_until(proc, lines, r"prefill \(pid \d+\) was killed by SIGKILL; restarting it in 1s")
        restarted = int(_read_until(proc, lines, r"prefill restarted \(pid (\d+)\)").group(1))
        pids.add(restarted)
        _read_until(proc, lines, r"prefill ready again")
        assert restarted != prefill and launch_procs.pid_alive(restarted)
        assert launch_procs.pid_alive(decode) and launch_procs.pid_alive(proxy)
        log = (tmp_path / "logs" / "prefill.log").read_text()
        assert log.count("grandchild") == 2 and "===== pdserve up: restart 1 of prefill" in log
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert not any(launch_procs.pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if launch_procs.pid_alive(p):
                os.killpg(p, signal.SIGKILL)


def test_crash_loop_ends_the_deployment_with_the_log_tail(tmp_path: Path) -> None:
    """A child that crashes at every restart: after --max-restarts restarts the deployment stops, showing
    the crash's last log lines, and nothing is left running."""
    proc = _toy_deployment(tmp_path, "once", {"max_restarts": 2})
    lines: list[str] = []
    pids: set[int] = set()
    try:
        ready = _read_until(proc, lines, r"^PDSERVE_READY .*pids=([\d,]+)")
        pids = {int(p) for p in ready.group(1).split(",")}
        os.kill(int(ready.group(1).split(",")[0]), signal.SIGKILL)  # the prefill
        rest, _ = proc.communicate(timeout=120)
        out = "".join(lines) + rest
        assert proc.returncode == 1, out
        assert "restarting it in 1s (restart 1 of at most 2" in out and "restarting it in 2s (restart 2" in out
        assert re.search(r"pdserve up: prefill exited with code 3 while serving, after 2 restart\(s\) within "
                         r"600s \(crash loop\)\. Last lines of .*prefill\.log:\n(  \| .*\n)*  \| fatal: cannot "
                         r"load model\n", out), out
        pids |= _all_pids(out)
        assert out.rstrip().endswith("stopped.")
        assert not any(launch_procs.pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if launch_procs.pid_alive(p):
                os.killpg(p, signal.SIGKILL)
