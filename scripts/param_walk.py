"""How one request's id walks the proxy's code: which functions receive it, in the order they are called, and how
many times the walk enters each file (issue #45: "no climb back up a layer, and no file entered more than twice").

It runs a real proxy in this process against two stand-in instances (`pdserve.testing.standin`, subprocesses on
127.0.0.1), sends one disaggregated request with a known `X-Request-Id`, and records every first call of a
pdserve/proxy function one of whose arguments carries that id: the id itself (or a string holding it), a mapping
holding it (the upstream headers), or an object whose attributes do (`rid`, `headers`, `req`, `up`). The walk is that
sequence, each call with its caller's file (for a coroutine started as a task: where it was created); a file is
entered by a call from another file; a climb is a call from a file into one that imports it (directly or not: a
layer above). Methods of an object that holds the id (`ClientRequest.view`, `Upstream.hold`) are not counted: no
caller passes the id to them.

    python scripts/param_walk.py [--route completions|generate] [--stream]
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
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "pdserve" / "proxy"
RID = "walk-7f3a9c"


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


def carries(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return RID in value
    if depth > 1:
        return False
    if isinstance(value, dict):
        return any(carries(v, depth + 1) for v in value.values())
    for name in ("rid", "headers", "req", "up"):
        try:
            attr = getattr(value, name, None)
        except Exception:  # noqa: BLE001 - a property that fails is no carrier
            attr = None
        if attr is not None and not callable(attr) and carries(attr, depth + 1):
            return True
    return False


def _caller(frame: FrameType) -> str | None:
    """The proxy file that called (or, for a coroutine started as a task, created) this frame's function."""
    back = frame.f_back
    if back is not None and back.f_code.co_filename.startswith(str(PROXY)):
        return Path(back.f_code.co_filename).name
    if frame.f_code.co_flags & 0x80:  # CO_COROUTINE: started by the event loop; where was it created?
        for ref in gc.get_referrers(frame):
            origin = getattr(ref, "cr_origin", None)
            for file, _, _ in origin or ():
                if file.startswith(str(PROXY)):
                    return Path(file).name
    return None


class Tracer:
    def __init__(self) -> None:
        self.walk: list[tuple[str | None, str, str]] = []  # (caller file, file, function)
        self._seen: set[int] = set()
        self._keep: list[FrameType] = []  # frames held so that their ids are not reused

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PROXY)) or id(frame) in self._seen:
            return  # not the proxy's, or a coroutine resumed (its first call is what counts)
        self._seen.add(id(frame))
        self._keep.append(frame)
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        carriers = [n for n in names if carries(frame.f_locals.get(n))]
        if carriers == ["self"]:
            return  # a method of an object that holds the id (ClientRequest.view, Upstream.hold): no one passed it
        if carriers:
            self.walk.append((_caller(frame), Path(path).name, code.co_name))


def importers() -> dict[str, set[str]]:
    """file -> the proxy files that import it, directly or not."""
    direct: dict[str, set[str]] = {}
    for f in PROXY.glob("*.py"):
        deps = set()
        tree = ast.parse(f.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test).endswith("TYPE_CHECKING") for n in ast.walk(block)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve.proxy.") \
                    and id(node) not in typing_only:  # a type named in hints is no layer below
                deps.add(node.module.rsplit(".", 1)[1] + ".py")
        direct[f.name] = deps
    above: dict[str, set[str]] = {name: set() for name in direct}
    for name in direct:  # transitive: who reaches `name` through imports
        for src in direct:
            stack, seen = [src], set()
            while stack:
                cur = stack.pop()
                for dep in direct.get(cur, ()):
                    if dep not in seen:
                        seen.add(dep)
                        stack.append(dep)
            if name in seen and src != name:
                above[name].add(src)
    return above


async def one_request(route: str, stream: bool, prefill: str, decode: str) -> int:
    from aiohttp import ClientSession, web

    from pdserve.proxy.app import create_app
    from pdserve.proxy.config import ProxyConfig

    app = create_app(ProxyConfig(host="127.0.0.1", port=0, prefill=[prefill], decode=[decode], log_level="warning"))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    if route == "generate":
        path, body = "/inference/v1/generate", {"token_ids": list(range(1, 40)), "stream": stream,
                                                  "sampling_params": {"max_tokens": 8}}
    else:
        path, body = "/v1/completions", {"model": "m", "prompt": "x " * 40, "max_tokens": 8, "stream": stream}
    try:
        async with ClientSession() as http:
            for _ in range(100):  # until the health probes admitted both (bounded: 10 s)
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            sys.set_coroutine_origin_tracking_depth(8)
            sys.setprofile(TRACER)
            try:
                async with http.post(f"http://127.0.0.1:{port}{path}", json=body,
                                     headers={"X-Request-Id": RID}) as r:
                    await r.read()
                    return r.status
            finally:
                sys.setprofile(None)
    finally:
        await runner.cleanup()


TRACER = Tracer()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", choices=("completions", "generate"), default="completions")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start_standin(Path(tmp) / f"standin{i}.log") for i in range(2)]
        try:
            status = asyncio.run(one_request(args.route, args.stream, procs[0][1], procs[1][1]))
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(timeout=10)
    above = importers()
    entries: Counter[str] = Counter()
    climbs = []
    for caller, file, func in TRACER.walk:
        if caller != file:
            entries[file] += 1
            if caller is not None and file in above.get(caller, set()):
                climbs.append(f"{caller} -> {file}:{func}")
    print(json.dumps({"status": status, "route": args.route, "stream": args.stream,
                      "walk": [f"{c} -> {f}:{fn}" for c, f, fn in TRACER.walk],
                      "entries": dict(entries.most_common()), "climbs": climbs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
