"""Disk tier read path on this machine: plain `readinto` (what pdserve.kv_offload.disk_tier does) against
NIXL's POSIX backend reading the same block files into registered DRAM, warm (page cache) and cold
(posix_fadvise DONTNEED before each pass). Prints one JSON object per (block size, path, cache state).

    python benchmarks/kv_disk_read.py [--blocks 256] [--dir "$(mktemp -d)"]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

# A SmolLM2-135M block (30 layers x K,V x 16 tokens x 3 KV heads x 64 x fp32) and a Llama-3.1-8B bf16 one.
BLOCK_SIZES = {"smollm2-135m-fp32": 30 * 2 * 16 * 3 * 64 * 4, "llama-8b-bf16": 32 * 2 * 16 * 8 * 128 * 2}


def load_nixl():
    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            mod = __import__(f"{name}._api", fromlist=["nixl_agent", "nixl_agent_config"])
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError:
            continue
    return None, None


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path], out: np.ndarray, nbytes: int) -> None:
    for i, p in enumerate(paths):
        with open(p, "rb", buffering=0) as f:
            n = f.readinto(memoryview(out[i * nbytes:(i + 1) * nbytes]))
            assert n == nbytes


class NixlReader:
    def __init__(self, out: np.ndarray):
        agent_cls, cfg_cls = load_nixl()
        self.agent = agent_cls("kvread", cfg_cls(backends=["POSIX"]))
        self.out = out
        self.dram_reg = self.agent.register_memory([(out.ctypes.data, out.nbytes, 0, "")], "DRAM")

    def read(self, paths: list[Path], nbytes: int) -> None:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        try:
            file_reg = self.agent.register_memory([(0, nbytes, fd, "") for fd in fds], "FILE")
            local = self.agent.get_xfer_descs(
                [(self.out.ctypes.data + i * nbytes, nbytes, 0) for i in range(len(fds))], "DRAM")
            remote = self.agent.get_xfer_descs([(0, nbytes, fd) for fd in fds], "FILE")
            handle = self.agent.initialize_xfer("READ", local, remote, "kvread")
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            assert state == "DONE", state
            self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(file_reg)
        finally:
            for fd in fds:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvread-"))
    root.mkdir(parents=True, exist_ok=True)
    agent_cls, _ = load_nixl()
    for label, nbytes in BLOCK_SIZES.items():
        n = args.blocks if nbytes < 1 << 20 else max(args.blocks // 4, 8)
        rng = np.random.default_rng(0)
        data = rng.integers(0, 255, size=n * nbytes, dtype=np.uint8)
        paths = []
        for i in range(n):
            p = root / f"{label}-{i}.bin"
            p.write_bytes(data[i * nbytes:(i + 1) * nbytes].tobytes())
            paths.append(p)
        out = np.zeros(n * nbytes, dtype=np.uint8)
        readers = {"plain_readinto": functools.partial(plain_read, paths, out, nbytes)}
        if agent_cls is not None:
            readers["nixl_posix"] = functools.partial(NixlReader(out).read, paths, nbytes)
        for cache in ("warm", "cold"):
            for name, fn in readers.items():
                times = []
                for _ in range(args.repeats):
                    out[:] = 0
                    if cache == "cold":
                        drop_cache(paths)
                    else:
                        fn()  # warm the page cache
                        out[:] = 0
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                    assert np.array_equal(out, data), f"{name} read wrong bytes"
                med = statistics.median(times)
                print(json.dumps({"block": label, "block_bytes": nbytes, "blocks": n, "path": name, "cache": cache,
                                  "median_s": round(med, 5), "GBps": round(n * nbytes / med / 1e9, 3),
                                  "us_per_block": round(med / n * 1e6, 1)}), flush=True)
        for p in paths:
            p.unlink()


if __name__ == "__main__":
    main()
