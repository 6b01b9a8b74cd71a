"""A tiny NIXL READ between two processes, to see which UCX transport a KV pull really takes.

    python -m pdserve.preflight.probe --mem vram --target-gpu 0 --initiator-gpu 1 [--size-mib 64]
    python -m pdserve.preflight.probe --mem dram

The target process (the prefill side) registers a buffer and starts the initiator (the decode side) as a
child process with CUDA_VISIBLE_DEVICES set to its own GPU, as `pdserve up` runs instances. The initiator
READs the buffer twice (the first read sets up the connection), checks the bytes, and prints a result line
`PROBE_RESULT {json}`. Run it with `UCX_PROTO_INFO=y` to get UCX's protocol tables: `pdserve preflight`
parses them for the transport of "remote memory read" (cuda_ipc/cuda is the fast path between GPUs of one
host; tcp/lo is the silent fallback that costs ~0.5 GB/s).

The last line of the target's stdout is `PROBE_RESULT {json}` with the initiator's timing and the probe's
own parse of the transports. Needs numpy and nixl; VRAM also needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import time
from typing import Any

RESULT = "PROBE_RESULT "
_HDR = struct.Struct("<QQQQ")  # metadata length, address, size, device id


def _load_nixl() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            module = __import__(f"{name}._api", fromlist=["nixl_agent"])
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError("NIXL is not importable (pip install nixl)")


def _buffer(mem: str, size: int, fill: bool) -> tuple[Any, int, int]:
    """(keep-alive object, address, device id) of a `size`-byte buffer in DRAM or on cuda:0."""
    if mem == "vram":
        import torch

        t = (torch.arange(size, dtype=torch.int64, device="cuda:0") % 251).to(torch.uint8) if fill else (
            torch.zeros(size, dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize()
        return t, int(t.data_ptr()), 0
    import numpy as np

    a = (np.arange(size, dtype=np.int64) % 251).astype(np.uint8) if fill else np.zeros(size, dtype=np.uint8)
    return a, int(a.ctypes.data), 0


def _checksum_ok(buf: Any, mem: str) -> bool:
    if mem == "vram":
        import torch

        n = buf.numel()
        expect = (torch.arange(n, dtype=torch.int64, device=buf.device) % 251).to(torch.uint8)
        return bool(torch.equal(buf, expect))
    import numpy as np

    return bool(np.array_equal(buf, (np.arange(buf.size, dtype=np.int64) % 251).astype(np.uint8)))


def run_initiator(mem: str) -> int:
    nixl = _load_nixl()
    n, addr, size, dev = _HDR.unpack(sys.stdin.buffer.read(_HDR.size))
    metadata = sys.stdin.buffer.read(n)
    keep, local, local_dev = _buffer(mem, size, fill=False)
    kind = "VRAM" if mem == "vram" else "DRAM"
    agent = nixl.nixl_agent("pdserve-probe-initiator", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(local, size, local_dev, "")], kind)
    remote = agent.add_remote_agent(metadata)
    times = []
    for i in range(2):
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([(local, size, local_dev)], kind),
            agent.get_xfer_descs([(addr, size, dev)], kind), remote, b"done" if i == 1 else b"",
        )
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - t0)
        handle.release()
        if state != "DONE":
            print(RESULT + json.dumps({"ok": False, "error": f"READ ended in state {state}"}), flush=True)
            return 1
    ok = _checksum_ok(keep, mem)
    print(RESULT + json.dumps({"ok": ok, "bytes": size, "first_s": times[0], "second_s": times[1],
                               "gbps": size / times[1] / 1e9, "error": None if ok else "data mismatch"}),
          flush=True)
    return 0 if ok else 1


_CELLS = re.compile(r"\|(.*)\|\s*$")


def parse_proto_info(text: str) -> list[tuple[str, str]]:
    """(operation title, transport) pairs of the `remote memory read` tables in UCX_PROTO_INFO output,
    e.g. ("remote memory read by ucp_get* into cuda memory from cuda", "cuda_ipc/cuda")."""
    found: list[tuple[str, str]] = []
    title: str | None = None
    for line in text.splitlines():
        m = _CELLS.search(line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(1).split("|")]
        if len(cells) == 1:  # a title row: "<ctx> intra-node cfg#1" or "remote memory read by ..."
            title = cells[0] if "remote memory read" in cells[0] else None
            continue
        if title is not None and len(cells) >= 3 and cells[0].lower() != "range" and cells[-1]:
            pair = (title, cells[-1])
            if pair not in found:
                found.append(pair)
    return found


def run_target(mem: str, size: int, target_gpu: str | None, initiator_gpu: str | None, timeout: float) -> int:
    if target_gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = target_gpu  # before CUDA initialises in this process
    nixl = _load_nixl()
    keep, addr, dev = _buffer(mem, size, fill=True)
    kind = "VRAM" if mem == "vram" else "DRAM"
    agent = nixl.nixl_agent("pdserve-probe-target", nixl.nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory([(addr, size, dev, "")], kind)
    metadata = agent.get_agent_metadata()
    env = dict(os.environ)
    if initiator_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = initiator_gpu
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.preflight.probe", "--role", "initiator", "--mem", mem],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_HDR.pack(len(metadata), addr, size, dev) + metadata)
    proc.stdin.close()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        agent.get_new_notifs()  # progresses this agent as a READ target (TCP needs it)
        time.sleep(0.001)
    if proc.poll() is None:
        proc.kill()
    out = proc.stdout.read().decode("utf-8", "replace")
    proc.wait()
    agent.deregister_memory(reg)
    del keep
    result: dict[str, Any] = {"ok": False, "error": f"initiator exited with {proc.returncode} and no result"}
    for line in out.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
    result["read_transports"] = [list(p) for p in parse_proto_info(out)]
    result["initiator_output_tail"] = out.splitlines()[-15:] if not result.get("ok") else []
    sys.stdout.write(out if os.environ.get("PDSERVE_PROBE_ECHO") else "")
    print(RESULT + json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.preflight.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("target", "initiator"), default="target")
    p.add_argument("--mem", choices=("dram", "vram"), default="dram")
    p.add_argument("--target-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the target (prefill) side")
    p.add_argument("--initiator-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the initiator (decode) side")
    p.add_argument("--size-mib", type=float, default=64.0)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.role == "initiator":
        return run_initiator(args.mem)
    return run_target(args.mem, int(args.size_mib * 2**20), args.target_gpu, args.initiator_gpu, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
