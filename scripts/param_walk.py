"""How one request parameter walks the code, on real servers (issue #45: "the parameter walks of kv_transfer_params
and of the proxy's request id have no climb back up a layer, and no file is entered more than twice").

Two walks:

- `rid`: the proxy's request id. A real proxy runs in this process against two stand-in instances
  (`pdserve.testing.standin`, subprocesses on 127.0.0.1); one disaggregated completions request goes through it with
  a known `X-Request-Id`. Watched: pdserve/proxy.
- `kv`: a request's `kv_transfer_params`, from the server's route to the engine's P/D half. A real `pdserve serve`
  app (a tiny random model, its engine thread, the P/D half without a connector) runs in this process; one generate
  request carries params with a marker key. Watched: pdserve/server, pdserve/engine, pdserve/api, pdserve/kv_transfer.

Recorded: every first call of a watched function one of whose arguments carries the parameter: the value itself (a
string holding the marker), a mapping holding it (headers, the params' dict), or an object whose attributes do
(`rid`, `headers`, `req`, `up`, `wire`, `kv_transfer_params`) or a list of such, each with its caller's file (for a
coroutine started as a task: where it was created; for an async generator driven by a task, which keeps no origin:
the walk's previous step's file, marked `~`). A file is entered by a call from another file; a climb is a call from a module into
one that imports it (directly or not: a layer above). Methods of an object that holds the parameter
(`ClientRequest.view`, `Upstream.hold`) are not counted: no caller passes it to them.

    python scripts/param_walk.py rid [--stream]
    python scripts/param_walk.py kv
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pdserve"
MARK = "walk-7f3a9c"
CARRIER_ATTRS = ("rid", "headers", "req", "up", "wire", "kv_transfer_params")


def carries(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return MARK in value
    if depth > 4:
        return False
    if isinstance(value, Mapping):
        return any(carries(k, depth + 1) or carries(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(carries(v, depth + 1) for v in value[:64])
    for name in CARRIER_ATTRS:
        try:
            attr = getattr(value, name, None)
        except Exception:  # noqa: BLE001 - a property that fails is no carrier
            attr = None
        if attr is not None and not callable(attr) and carries(attr, depth + 1):
            return True
    return False


def rel(path: str) -> str:
    return str(Path(path).relative_to(PKG))


class Tracer:
    def __init__(self, watched: list[Path]) -> None:
        self.watched = tuple(str(w) for w in watched)
        self.walk: list[tuple[str | None, str, str]] = []  # (caller file, file, function)
        self._seen: set[int] = set()
        self._keep: list[FrameType] = []  # frames held so that their ids are not reused
        self._lock = threading.Lock()

    def _caller(self, frame: FrameType) -> str | None:
        """The watched file that called (or, for a coroutine started as a task, created) this frame's function."""
        back = frame.f_back
        if back is not None and back.f_code.co_filename.startswith(self.watched):
            return rel(back.f_code.co_filename)
        if frame.f_code.co_flags & 0x80:  # CO_COROUTINE: started by the event loop; where was it created?
            for ref in gc.get_referrers(frame):
                for file, _, _ in getattr(ref, "cr_origin", None) or ():
                    if file.startswith(self.watched):
                        return rel(file)
        if frame.f_code.co_flags & 0x200 and self.walk:  # CO_ASYNC_GENERATOR driven by a task: no origin is
            return "~" + self.walk[-1][1]  # kept, so the walk's last step is taken for its caller (marked ~)
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(self.watched) or id(frame) in self._seen:
            return  # not watched, or a coroutine resumed (its first call is what counts)
        with self._lock:
            self._seen.add(id(frame))
            self._keep.append(frame)
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        carriers = [n for n in names if carries(frame.f_locals.get(n))]
        if carriers and carriers != ["self"]:
            with self._lock:
                self.walk.append((self._caller(frame), rel(path), code.co_name))


def importers() -> dict[str, set[str]]:
    """module file (relative to pdserve/) -> the modules that import it, directly or not (imports under
    TYPE_CHECKING are no layer: a type named in hints)."""
    direct: dict[str, set[str]] = {}
    files = {str(f.relative_to(PKG)): f for f in PKG.rglob("*.py")}
    for name, f in files.items():
        tree = ast.parse(f.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test).endswith("TYPE_CHECKING") for n in ast.walk(block)}
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve.") \
                    and id(node) not in typing_only:
                base = node.module.removeprefix("pdserve.").replace(".", "/")
                for cand in (f"{base}.py", f"{base}/__init__.py"):
                    if cand in files:
                        deps.add(cand)
        direct[name] = deps
    reach: dict[str, set[str]] = {}
    for src in direct:
        stack, seen = [src], set()
        while stack:
            for dep in direct.get(stack.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
        reach[src] = seen
    return {name: {src for src, seen in reach.items() if name in seen and src != name} for name in direct}


# ---- the proxy's request id ------------------------------------------------------------------------------------
def start_standin(log: Path) -> tuple[subprocess.Popen, str]:
    fh = log.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.testing.standin", "--port", "0"], stdout=fh,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    for _ in range(600):  # 30 s
        m = re.search(r"standin listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(log.read_text(errors="replace")[-2000:])


async def proxy_request(tracer: Tracer, stream: bool, prefill: str, decode: str) -> int:
    from aiohttp import ClientSession, web

    from pdserve.proxy.app import create_app
    from pdserve.proxy.config import ProxyConfig

    app = create_app(ProxyConfig(host="127.0.0.1", port=0, prefill=[prefill], decode=[decode], log_level="warning"))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    body = {"model": "m", "prompt": "x " * 40, "max_tokens": 8, "stream": stream}
    try:
        async with ClientSession() as http:
            for _ in range(100):  # until the health probes admitted both (bounded: 10 s)
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            sys.set_coroutine_origin_tracking_depth(8)
            sys.setprofile(tracer)
            try:
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                     headers={"X-Request-Id": MARK}) as r:
                    await r.read()
                    return r.status
            finally:
                sys.setprofile(None)
    finally:
        await runner.cleanup()


def rid_walk(stream: bool) -> tuple[int, Tracer]:
    tracer = Tracer([PKG / "proxy"])
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start_standin(Path(tmp) / f"standin{i}.log") for i in range(2)]
        try:
            status = asyncio.run(proxy_request(tracer, stream, procs[0][1], procs[1][1]))
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(timeout=10)
    return status, tracer


# ---- the server's kv_transfer_params ---------------------------------------------------------------------------
def kv_walk() -> tuple[int, Tracer]:
    from fastapi.testclient import TestClient

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_model

    from pdserve.server.app import build_app
    from pdserve.server.cli import add_arguments, build_state

    tracer = Tracer([PKG / "server", PKG / "engine", PKG / "api", PKG / "kv_transfer"])
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp), "llama")
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args([str(model), "--tokens-only", "--served-model-name", "tiny", "--device", "cpu",
                                  "--num-gpu-blocks-override", "64"])
        state = build_state(args)
        app = build_app(state)
        body = {"token_ids": list(range(3, 40)), "sampling_params": {"max_tokens": 4, "temperature": 0},
                "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False, MARK: MARK}}
        sys.set_coroutine_origin_tracking_depth(8)
        threading.setprofile(tracer)  # the engine thread and the test client's portal start inside: traced too
        sys.setprofile(tracer)
        try:
            with TestClient(app) as client:
                status = client.post("/inference/v1/generate", json=body).status_code
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    return status, tracer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("walk", choices=("rid", "kv"))
    ap.add_argument("--stream", action="store_true", help="rid: a streamed request")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    status, tracer = rid_walk(args.stream) if args.walk == "rid" else kv_walk()
    above = importers()
    entries: Counter[str] = Counter()
    climbs = []
    for caller, file, func in tracer.walk:
        if caller is None or caller.lstrip("~") != file:
            entries[file] += 1
            if caller is not None and file in above.get(caller.lstrip("~"), set()):
                climbs.append(f"{caller} -> {file}:{func}")
    print(json.dumps({"walk": args.walk, "status": status, "steps": [f"{c} -> {f}:{fn}" for c, f, fn in tracer.walk],
                      "entries": dict(entries.most_common()), "climbs": climbs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
