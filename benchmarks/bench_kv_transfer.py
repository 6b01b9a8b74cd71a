"""NIXL KV READ throughput of a prompt's blocks between two processes vs a raw copy, measured in one run.

The pool is Llama-3.1-8B shaped by default: 32 layers x 2 (K,V) x 8 kv heads x 128 dims x bf16 =
128 KiB per token, 2 MiB per 16-token block, 1 GiB for an 8k-token prompt. A producer process holds the
prompt's blocks (KVConnector, kv_producer); this process loads them as a consumer, exactly as the engine
does (claim, READ, release-with-verify), and reports:

- NIXL READ GB/s (post to completion) and end-to-end load GB/s (claim + READ + release), medians;
- the raw copy of the same bytes: on CPU a torch copy in this process, on GPU a device-to-device copy;
- their ratio;
- with `--digest both`: the per-block KV digests' cost (pdserve/kv_transfer/digest.py), loads with digests on and
  off interleaved: the producer's hold (where it digests) and the consumer's load (where it verifies after the
  READ), each next to the load without digests; and the consumer's digest of the loaded blocks timed alone (on
  a GPU the fused Triton kernel and, beside it, the torch reduction it replaced), each as a ratio of the same
  run's NIXL READ. On the CPU also the consumer's hash run in a second thread during a load without digests
  (what overlapping the hash with the READ of the next chunk could hide; xxhash releases the GIL).

    python benchmarks/bench_kv_transfer.py --tokens 8192 --device cuda     # H200
    python benchmarks/bench_kv_transfer.py --tokens 1024 --device cpu      # CI-class CPU box
    python benchmarks/bench_kv_transfer.py --tokens 1024,4096,16384 --device cpu --layers 8 --digest both
    python benchmarks/bench_kv_transfer.py --tokens 1024,4096,16384 --device cuda --digest both  # Llama-3.1-8B
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from typing import Any

from pdserve.api.pd import KVTransferParams

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8_e4m3"}


def _pool(args: argparse.Namespace, num_blocks: int, device: str, seed: int) -> Any:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    if args.dtype == "fp8":  # pdserve's fp8 pool: uint8 regions of fp8 values then bf16 scales (fp8_kv)
        from pdserve.attention.fp8_kv import SCALE_BYTES

        shape = (num_blocks, args.layers, 2, args.block_size, args.kv_heads, args.head_dim + SCALE_BYTES)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    shape = (num_blocks, args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    pool = torch.empty(shape, dtype=getattr(torch, DTYPES[args.dtype]), device=device)
    pool.normal_(generator=gen)
    return pool


def _connector(args: argparse.Namespace, role: str, pool: Any, port: int) -> Any:
    from pdserve.attention.fp8_kv import SCALE_SCHEME
    from pdserve.kv_transfer import KVConnector, KVTransferConfig, make_compat

    fp8 = args.dtype == "fp8"
    compat = make_compat(
        model="bench-llama-3.1-8b-shape",
        dtype="bfloat16" if fp8 else str(pool.dtype),
        kv_cache_dtype="fp8_e4m3" if fp8 else None,
        kv_scales=SCALE_SCHEME if fp8 else "none",
        block_size=args.block_size,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
    )
    config = KVTransferConfig.from_json(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "engine_id": f"bench-{role}-{uuid.uuid4().hex[:6]}",
            "kv_connector_extra_config": {"transfer_timeout_s": 30.0, "enable_kv_digest": args.digest != "off"},
        },
        side_channel_host="127.0.0.1",
        side_channel_port=port,
    )
    return KVConnector(config, pool, compat, args.block_size)


def _checksum(pool: Any, ids: list[int]) -> int:
    import torch

    flat = pool[ids].contiguous().view(-1)
    size = flat.element_size()
    as_int = flat if size == 1 else flat.view(torch.int16) if size == 2 else flat.view(torch.int32)
    return int(as_int.to(torch.int64).sum().item())


def _producer(conn: Any, args: argparse.Namespace, num_blocks: int) -> None:
    pool = _pool(args, num_blocks, args.producer_device, seed=1)
    connector = _connector(args, "kv_producer", pool, 0)
    conn.send(connector.side_channel_port)
    try:
        while True:
            if not conn.poll(0.01):
                connector.producer.poll_released()
                continue
            cmd, arg = conn.recv()
            if cmd == "hold":
                rid, ids, digest = arg
                producer = connector.producer
                digester, producer.digester = producer.digester, producer.digester if digest else None
                t0 = time.perf_counter()
                held = producer.hold(rid, ids, len(ids) * args.block_size, 0)
                hold_s = time.perf_counter() - t0
                producer.digester = digester
                conn.send((held.to_json(), hold_s))
            elif cmd == "checksum":
                conn.send(_checksum(pool, arg))
            else:
                break
    finally:
        connector.shutdown()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class _RawCopy:
    """A copy of the same number of bytes from the producer's device to the consumer's, in this process
    (device-to-device, or peer-to-peer between two GPUs)."""

    def __init__(self, src_device: str, dst_device: str, nbytes: int) -> None:
        import torch

        self.devices = (src_device, dst_device)
        self.src = torch.ones(nbytes // 2, dtype=torch.int16, device=src_device)
        self.dst = torch.zeros(nbytes // 2, dtype=torch.int16, device=dst_device)
        self.run()  # fault the pages in / warm the copy engine

    def run(self, nbytes: int | None = None) -> float:
        """Seconds to copy the first nbytes (all by default)."""
        n = self.src.numel() if nbytes is None else nbytes // 2
        for d in self.devices:
            _sync(d)
        t0 = time.perf_counter()
        self.dst[:n].copy_(self.src[:n])
        for d in self.devices:
            _sync(d)
        return time.perf_counter() - t0


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _time_digest_alone(out: dict[str, list[float]], args: argparse.Namespace, connector: Any, digester: Any,
                       pool: Any, ids: list[int], load_off: Any) -> None:
    """The consumer's digest of the blocks it just loaded, by itself: what `check_digests` adds after the READ.
    On a GPU also the torch reduction the fused kernel replaced; on the CPU also a load without digests while a
    second thread hashes as many other blocks (the cost left if the hash overlapped the READ)."""
    from pdserve.kv_transfer.digest import VLLM_LANESUM, lanesum_torch

    out["digest"].append(_timed(lambda: digester.rank_digests(0, ids), args.device))
    if args.device.startswith("cuda") and digester.algo == VLLM_LANESUM:
        out["torch"].append(_timed(lambda: lanesum_torch(pool, ids), args.device))
    if not args.device.startswith("cuda"):
        others = [b for b in range(pool.shape[0]) if b not in set(ids)][:len(ids)]
        hasher = threading.Thread(target=digester.rank_digests, args=(0, others))
        t0 = time.perf_counter()
        hasher.start()
        load_off()
        hasher.join()
        out["overlap"].append(time.perf_counter() - t0)


def _report_digest(sizes: list[tuple[int, int]], block_bytes: int,
                   digest_stats: dict, alone: dict, stats: dict) -> list[dict[str, Any]]:
    rows = []
    print("per-block KV digests (medians; READ = the NIXL READ alone, load = claim + READ + release, both without "
          "digests; cost as a share of the same run's READ and load):")
    for tokens, n in sizes:
        off, on = digest_stats[(n, False)], digest_stats[(n, True)]
        med = {k: statistics.median(v) for k, v in (("load_off", off["load"]), ("load_on", on["load"]),
                                                     ("hold_off", off["hold"]), ("hold_on", on["hold"]),
                                                     ("read", stats[n]["xfer"]))}
        for key, values in alone[n].items():
            if values:
                med[f"{key}_s"] = statistics.median(values)
        row = {"tokens": tokens, "bytes": n * block_bytes, **med,
               "consumer_pct": 100 * (med["load_on"] - med["load_off"]) / med["load_off"],
               "producer_pct": 100 * (med["hold_on"] - med["hold_off"]) / med["load_off"],
               "digest_pct_of_read": 100 * med["digest_s"] / med["read"],
               "producer_pct_of_read": 100 * (med["hold_on"] - med["hold_off"]) / med["read"]}
        line = (f"  {tokens:6d} tokens {n * block_bytes / 2**20:6.0f} MiB: READ {med['read'] * 1e3:8.3f} ms, load "
                f"{med['load_off'] * 1e3:8.2f} ms off / {med['load_on'] * 1e3:8.2f} ms on "
                f"({row['consumer_pct']:+.1f} % of the load); consumer digest alone {med['digest_s'] * 1e3:7.3f} ms "
                f"= {row['digest_pct_of_read']:.1f} % of the READ")
        if "torch_s" in med:
            row["torch_pct_of_read"] = 100 * med["torch_s"] / med["read"]
            line += f" (torch reduction {med['torch_s'] * 1e3:.3f} ms = {row['torch_pct_of_read']:.1f} %)"
        line += (f"; producer's hold {med['hold_off'] * 1e3:.2f} / {med['hold_on'] * 1e3:.2f} ms "
                 f"(+{row['producer_pct_of_read']:.1f} % of the READ, on the prefill's answer)")
        if "overlap_s" in med:
            row["overlap_pct"] = 100 * (med["overlap_s"] - med["load_off"]) / med["load_off"]
            line += (f"; load with the hash in a second thread {med['overlap_s'] * 1e3:.2f} ms "
                     f"({row['overlap_pct']:+.1f} % of the load)")
        print(line)
        rows.append(row)
    return rows


def _fit_fixed_cost(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares t = fixed + bytes / rate over the sizes: (fixed seconds, bytes per second)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / var
    return my - slope * mx, 1.0 / slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192",
                    help="prompt length in tokens; several comma-separated: each measured in the same run, the "
                         "sizes interleaved, and READ time = fixed cost + bytes / rate fitted over them")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="pool dtype; fp8 = pdserve's --kv-cache-dtype fp8 pool (head_dim fp8 + 2 scale bytes)")
    ap.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (both processes use it)")
    ap.add_argument("--producer-device", default=None,
                    help="the producer's device when it differs (e.g. cuda:1 for a cross-GPU READ)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--scatter", action="store_true", help="shuffle block ids: one descriptor per block")
    ap.add_argument(
        "--copy-threads", type=int, default=1, help="torch threads for the CPU raw copy (cma is 1)"
    )
    ap.add_argument("--digest", choices=("on", "off", "both"), default="off",
                    help="per-block KV digests (enable_kv_digest): off (the raw READ), on, or both interleaved "
                         "(their cost side by side)")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args()
    args.producer_device = args.producer_device or args.device
    token_list = [int(t) for t in str(args.tokens).split(",")]

    import torch

    torch.set_num_threads(max(1, args.copy_threads))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("CUDA is not available; use --device cpu")
    token_bytes = _pool(args, 1, "cpu", 0).numel() * _pool(args, 1, "cpu", 0).element_size() // args.block_size
    block_bytes = token_bytes * args.block_size
    sizes = [(t, -(-t // args.block_size)) for t in token_list]  # (tokens, blocks)
    blocks = max(b for _, b in sizes)
    nbytes = blocks * block_bytes
    num_blocks = blocks * 2  # room to place the prompt at scattered ids
    print(
        f"pool: {args.layers} layers x {args.kv_heads} kv heads x {args.head_dim} x {args.dtype} = "
        f"{token_bytes / 1024:.0f} KiB/token, block {args.block_size} tokens = {block_bytes / 2**20:.2f} MiB; "
        f"prompt {', '.join(str(t) for t in token_list)} tokens = {', '.join(str(b) for _, b in sizes)} blocks = "
        f"{', '.join(f'{b * block_bytes / 2**20:.0f}' for _, b in sizes)} MiB; "
        f"producer {args.producer_device} -> consumer {args.device}"
    )
    # Shared CI boxes are noisy: say how busy this one was.
    print(f"host: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, args, num_blocks), daemon=True)
    proc.start()
    connector = None
    try:
        if not parent.poll(300):
            raise TimeoutError("producer did not start")
        parent.recv()  # the producer is up (its side-channel port travels in the params)
        pool = torch.zeros_like(_pool(args, num_blocks, args.device, 0))
        connector = _connector(args, "kv_consumer", pool, 0)
        digester = connector.consumer.digester
        hold_seconds: list[float] = []
        import random

        rng = random.Random(0)
        remote_ids = list(range(blocks))
        local_ids = list(range(blocks, 2 * blocks))
        if args.scatter:
            remote_ids = rng.sample(range(num_blocks), blocks)
            local_ids = rng.sample(range(num_blocks), blocks)

        raw = _RawCopy(args.producer_device, args.device, nbytes)

        modes = {"on": [True], "off": [False], "both": [False, True]}[args.digest]

        def load(tag: str, n: int, digest: bool = False) -> Any:
            parent.send(("hold", (f"bench-{tag}", remote_ids[:n], digest)))
            params, hold_s = parent.recv()
            consumer = connector.consumer
            consumer.digester = digester if digest else None
            hold_seconds.append(hold_s)
            consumer.start_load(f"d-{tag}", consumer.parse(KVTransferParams.read(params)), local_ids[:n], 0)
            deadline = time.monotonic() + 120
            results: list[Any] = []
            while not results and time.monotonic() < deadline:
                results = consumer.poll_loads()
                time.sleep(0.0005)
            if not results or not results[0].ok:
                raise RuntimeError(f"load {tag} failed: {results}")
            return results[0]

        r = load("first", blocks, modes[-1])  # includes the handshake and connection setup
        parent.send(("checksum", remote_ids))
        if parent.recv() != _checksum(pool, local_ids):
            raise RuntimeError("loaded blocks differ from the producer's")
        print(f"first load (handshake + connect + READ): {r.seconds * 1e3:.1f} ms, bytes verified")
        stats = {n: {"xfer": [], "post": [], "load": [], "copy": [], "descs": 0} for _, n in sizes}
        digest_stats = {(n, d): {"load": [], "hold": []} for _, n in sizes for d in modes}
        alone = {n: {"digest": [], "torch": [], "overlap": []} for _, n in sizes}  # the consumer's digest timed alone
        # Loads and raw copies alternate (and sizes interleave) so that all see the same machine load.
        for i in range(args.iters):
            for _, n in sizes:
                for d in modes:
                    r = load(f"{i}-{n}-{d}", n, d)
                    digest_stats[(n, d)]["load"].append(r.seconds)
                    digest_stats[(n, d)]["hold"].append(hold_seconds[-1])
                st = stats[n]
                st["xfer"].append(r.xfer_seconds)
                st["post"].append(r.post_seconds)
                st["load"].append(r.seconds)
                st["descs"] = r.num_descriptors
                st["copy"].append(raw.run(n * block_bytes))
                if args.digest == "both":
                    _time_digest_alone(alone[n], args, connector, digester, pool, local_ids[:n],
                                       lambda tag=f"{i}-{n}-overlap", n=n: load(tag, n, False))
        parent.send(("stop", None))
        if args.digest == "both":
            report_digest = _report_digest(sizes, block_bytes, digest_stats, alone, stats)
        kind = (
            ("device-to-device copy" if args.producer_device == args.device else "peer GPU-to-GPU copy")
            if args.device.startswith("cuda")
            else f"torch CPU copy ({args.copy_threads} thread)"
        )
        report: dict[str, Any] = {"dtype": args.dtype, "iters": args.iters, "scatter": args.scatter, "sizes": []}
        if args.digest == "both":
            report["digest"] = report_digest
        for tokens, n in sizes:
            st = stats[n]
            size = n * block_bytes
            med = {k: statistics.median(st[k]) for k in ("xfer", "post", "load", "copy")}
            q = statistics.quantiles(st["xfer"], n=10) if len(st["xfer"]) >= 2 else [med["xfer"]] * 9
            report["sizes"].append({"tokens": tokens, "bytes": size, "descriptors": st["descs"],
                                    "median_s": med, "xfer_p10_s": q[0], "xfer_p90_s": q[-1],
                                    "xfer_s": st["xfer"], "copy_s": st["copy"]})
            if len(sizes) > 1:
                print(f"--- {tokens} tokens, {size / 2**20:.0f} MiB")
            nixl_gbps = size / med["xfer"] / 1e9
            copy_gbps = size / med["copy"] / 1e9
            print(f"descriptors per READ: {st['descs']}; iterations: {args.iters}")
            print(
                f"NIXL READ        : {nixl_gbps:8.2f} GB/s  (median {med['xfer'] * 1e3:.3f} ms, p10-p90 "
                f"{q[0] * 1e3:.3f}-{q[-1] * 1e3:.3f} ms, of which post {med['post'] * 1e3:.3f} ms; best "
                f"{size / min(st['xfer']) / 1e9:.2f} GB/s)"
            )
            print(
                f"load end-to-end  : {size / med['load'] / 1e9:8.2f} GB/s  (claim + READ + release, median "
                f"{med['load'] * 1e3:.2f} ms)"
            )
            print(f"raw copy         : {copy_gbps:8.2f} GB/s  ({kind}, same bytes, same run, median "
                  f"{med['copy'] * 1e3:.3f} ms)")
            print(f"ratio NIXL READ / raw copy = {nixl_gbps / copy_gbps:.2f}; load / raw copy = "
                  f"{size / med['load'] / 1e9 / copy_gbps:.2f}")
        if len(sizes) > 1:
            xs = [n * block_bytes for _, n in sizes]
            fits = {}
            for key in ("xfer", "copy", "post"):
                fixed, rate = _fit_fixed_cost(xs, [statistics.median(stats[n][key]) for _, n in sizes])
                fits[key] = {"fixed_s": fixed, "GBps": rate / 1e9}
            report["fit"] = fits
            print(f"fit, time = fixed + bytes / rate: NIXL READ fixed {fits['xfer']['fixed_s'] * 1e3:.3f} ms, "
                  f"{fits['xfer']['GBps']:.0f} GB/s; raw copy fixed {fits['copy']['fixed_s'] * 1e3:.3f} ms, "
                  f"{fits['copy']['GBps']:.0f} GB/s; post {fits['post']['fixed_s'] * 1e3:.3f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        if connector is not None:
            connector.shutdown()
        proc.join(timeout=10)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)


if __name__ == "__main__":
    main()
