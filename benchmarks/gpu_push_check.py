"""GPU check of layer-pipelined push's event seam, and where a GPU WRITE's time goes (issue 41). Needs CUDA and
NIXL; one GPU, two processes (this one the prefill, a spawned child the decode), NIXL over UCX as configured
(CUDA IPC by default). About 20-40 s.

1. Events (correctness): this process queues each "layer" on the GPU (a deliberately slow matmul chain, then
   the layer's K/V values into the pool) and calls the PushSender's per-layer callback right after queuing,
   as the GPU step runner's eager forward does; the callback records a CUDA event and the writer thread
   waits on it before WRITEing that layer into the child's pool. The child then compares every (block,
   layer) slab with the expected values, bit for bit: PASS or FAIL (exit code 1). A control run with the
   CPU's always-ready marker shows what the event prevents (slabs written before the GPU computed them:
   reported, not asserted, since it is a race).
2. WRITE cost (where the 30x goes): one 8k-token request of the 8B shape (512 blocks x 32 layers x 64 KiB
   slabs) written as today's per-(block, layer) descriptors, as one layer's worth (what a layer-pipelined
   post carries), as one descriptor per block spanning all layers, as one coalesced descriptor, and (NIXL >=
   1.5 compressed lists) as per-layer strided rows; each with its host post time and its time to complete,
   and a READ of the coalesced run for comparison.

    python benchmarks/gpu_push_check.py [--blocks 512] [--iters 3] [--skip-cost]
    python benchmarks/gpu_push_check.py --device cpu --blocks 64 --spin 2   # the script's own dry run, DRAM
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
import uuid

import numpy as np
import torch

SHAPE_8B = (32, 2, 16, 8, 128)  # per block: layers, K|V, tokens, KV heads, head dim (Llama-3.1-8B, bf16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def mem(device: str) -> str:
    return "VRAM" if device == "cuda" else "DRAM"


def pattern(n: int, seed: int, i: int, layer: int, device: str) -> torch.Tensor:
    """A slab's expected values: small integers, exact in bf16, different for every (seed, block, layer)."""
    return ((torch.arange(n, device=device, dtype=torch.int64) * 7 + seed * 1009 + i * 131 + layer * 17) % 251
            ).to(torch.bfloat16)


# ---- the decode process -------------------------------------------------------------------------------------

def decode_side(conn, num_blocks: int, per_block: tuple[int, ...], device: str) -> None:
    from pdserve.kv_transfer.nixl_agent import NixlAgent, apply_env_defaults
    from pdserve.kv_transfer.pool import region_of

    if device == "cuda":
        torch.cuda.set_device(0)
    apply_env_defaults(loopback=True, gpu=device == "cuda")
    pool = torch.zeros((num_blocks, *per_block), dtype=torch.bfloat16, device=device)
    agent = NixlAgent(f"gpc-d-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    region = region_of(pool)
    agent.register(region)
    notifs: list[bytes] = []
    stop = threading.Event()

    def progress() -> None:  # a target that lands data through the host (TCP) needs progress
        if device == "cuda":
            torch.cuda.set_device(0)
        while not stop.is_set():
            for msgs in agent.get_notifs().values():
                notifs.extend(msgs)
            time.sleep(0.0005)

    thread = threading.Thread(target=progress, daemon=True)
    thread.start()
    conn.send({"name": agent.name, "metadata": agent.metadata(), "pool": region.describe()})
    slab = int(np.prod(per_block[1:]))
    while True:
        cmd, *rest = conn.recv()
        if cmd == "check":
            blocks, seed = rest
            sync(device)
            bad = 0
            for i, b in enumerate(blocks):
                for layer in range(per_block[0]):
                    if not torch.equal(pool[b, layer].reshape(-1), pattern(slab, seed, i, layer, device)):
                        bad += 1
            conn.send(bad)
        elif cmd == "zero":
            pool.zero_()
            sync(device)
            conn.send(True)
        elif cmd == "notifs":
            conn.send(list(notifs))
        else:
            break
    stop.set()
    thread.join(2)
    agent.close()


# ---- part 1: the event seam --------------------------------------------------------------------------------

def run_events(conn, peer: dict, pool: torch.Tensor, agent, *, control: bool, blocks: int, spin: int) -> dict:
    from pdserve.api import pd
    from pdserve.engine.pd.kv_handoff import KVHandoff
    from pdserve.engine.request import Request
    from pdserve.kv_transfer.layer_ready import READY
    from pdserve.kv_transfer.messages import PushRegister, PushStatus
    from pdserve.kv_transfer.pool import region_of
    from pdserve.kv_transfer.push_sender import PushSender
    from pdserve.types.sampling_params import SamplingParams

    layers = pool.shape[1]
    bs = pool.shape[3]
    device = pool.device.type
    region = region_of(pool)
    released: list = []
    sender = PushSender(agent=agent, region=region, num_layers=layers, block_size=bs, layerwise=True,
                        layerwise_min_tokens=0, transfer_timeout_s=60.0, lease_duration_s=120.0,
                        release_lease=lambda *a: released.append(a), auth=None,
                        layer_ready=(lambda: READY) if control else None)
    try:
        pool.zero_()
        conn.send(("zero",))
        conn.recv()
        key = uuid.uuid4().hex
        local = list(range(blocks))
        remote = list(range(blocks, 2 * blocks))[::-1]  # scattered the other way: no run to coalesce
        tokens = blocks * bs
        msg = PushRegister(push_key=key, generation=0, engine_id="gpu-push-check", agent_name=peer["name"],
                           agent_metadata=peer["metadata"], seal_nonce=b"", pool=peer["pool"], block_ids=tuple(remote),
                           first_block=0, num_tokens=tokens, timeout_s=60.0)
        assert sender.handle(msg).state == "registered"
        kv = KVHandoff(send=True, push=pd.parse_push_prefill_params(pd.push_prefill_params(key)))
        req = Request(f"check-{key[:6]}", list(range(tokens)), SamplingParams(), frozenset(), tokens + 16, kv=kv)
        req.block_ids = local
        on_layer = sender.step_hook([(req, tokens)])
        assert on_layer is not None
        slab = int(np.prod(pool.shape[2:]))
        values = [torch.stack([pattern(slab, 1, i, layer, device).view(pool.shape[2:]) for i in range(blocks)])
                  for layer in range(layers)]
        idx = torch.tensor(local, device=device)
        n = 4096 if device == "cuda" else 256
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16) / n**0.5
        sync(device)
        t0 = time.perf_counter()
        for layer in range(layers):  # the "forward": queued, not run, when the callback fires
            x = a
            for _ in range(spin):  # the layer's compute: the values below are stored after it (stream order)
                x = x @ a
            pool[idx, layer] = values[layer]
            on_layer(layer)
        host_s = time.perf_counter() - t0
        sync(device)
        gpu_s = time.perf_counter() - t0
        sender.finish(req.request_id, req.kv.push, local, tokens, (req.request_id, "lease"))
        deadline = time.monotonic() + 60
        while sender.handle(PushStatus(push_keys=(key,))).states != ("done",):
            if time.monotonic() > deadline:
                raise TimeoutError("the push did not complete in 60 s")
            time.sleep(0.002)
        conn.send(("check", remote, 1))
        bad = conn.recv()
        snap = sender.stats.snapshot()
        return {"bad_slabs": bad, "slabs": blocks * layers, "host_queue_ms": host_s * 1e3, "gpu_ms": gpu_s * 1e3,
                "writes": snap.posts, "writes_during_prefill": snap.posts_during_prefill, "waits": snap.ready_waits,
                "wait_ms": snap.ready_wait_seconds * 1e3, "descriptors": snap.descriptors,
                "tail_ms": snap.tail_seconds * 1e3}
    finally:
        sender.shutdown()


# ---- part 2: WRITE cost ------------------------------------------------------------------------------------

def time_xfer(agent, post, iters: int) -> dict:
    """post() -> handle; median host post time and time to DONE over `iters` runs."""
    posts, totals = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        handle = post()
        t1 = time.perf_counter()
        while (state := agent.xfer_state(handle)) == "PROC":
            pass
        t2 = time.perf_counter()
        agent.release_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended in state {state}")
        posts.append(t1 - t0)
        totals.append(t2 - t0)
    return {"post_ms": statistics.median(posts) * 1e3, "total_ms": statistics.median(totals) * 1e3}


def run_cost(peer: dict, pool: torch.Tensor, agent, blocks: int, iters: int) -> list[dict]:
    from pdserve.kv_transfer.pool import coalesce_block_runs, descriptor_arrays, region_of

    region = region_of(pool)
    mt = region.mem_type
    remote = peer["pool"]  # a RemotePool
    layers = pool.shape[1]
    bb = region.block_bytes
    lb = bb // layers
    ids = list(range(blocks))
    rows = []

    def descs(base: int, dev: int, addrs: np.ndarray, length: int) -> np.ndarray:
        d = np.empty((len(addrs), 3), dtype=np.uint64)
        d[:, 0] = np.uint64(base) + addrs.astype(np.uint64)
        d[:, 1] = np.uint64(length)
        d[:, 2] = np.uint64(dev)
        return d

    def write(local_d: np.ndarray, remote_d: np.ndarray):
        return lambda: agent.post_write(local_descs=local_d, local_mem=mt, remote_descs=remote_d,
                                        remote_mem=mt, remote_name=peer["name"])

    slab_off = (np.arange(blocks)[:, None] * bb + np.arange(layers)[None, :] * lb).reshape(-1)
    layer0_off = np.arange(blocks) * bb
    block_off = np.arange(blocks) * bb
    cases = [
        ("per (block, layer) slab: today's push", slab_off, lb),
        ("one layer's slabs: one layer-pipelined post", layer0_off, lb),
        ("per block, all layers", block_off, bb),
    ]
    total = blocks * bb
    for name, off, length in cases:
        ld = descs(region.base_addr, region.device_id, off, length)
        rd = descs(remote.base_addr, remote.device_id, off, length)
        r = time_xfer(agent, write(ld, rd), iters)
        nbytes = len(off) * length
        rows.append({"case": name, "descriptors": len(off), "mib": nbytes / 2**20, **r,
                     "gb_s": nbytes / (r["total_ms"] / 1e3) / 1e9})
    ld, rd = descriptor_arrays(coalesce_block_runs(ids, ids), region, remote)
    r = time_xfer(agent, write(ld, rd), iters)
    rows.append({"case": "coalesced run (whole-request after a fix)", "descriptors": len(ld), "mib": total / 2**20,
                 **r, "gb_s": total / (r["total_ms"] / 1e3) / 1e9})
    # per-layer strided rows (NIXL >= 1.5 compressed lists: address, length, device, stride, count). post_write
    # takes Nx5 rows itself (prep_xfer_dlist on both sides + make_prepped_xfer, the lists kept in its WriteHandle
    # and released with it), so the post time includes preparing the lists, as a layer-pipelined push would.
    try:
        lsd = np.array([[region.base_addr + layer * lb, lb, region.device_id, bb, blocks] for layer in range(layers)],
                       dtype=np.uint64)
        rsd = np.array([[remote.base_addr + layer * lb, lb, remote.device_id, bb, blocks] for layer in range(layers)],
                       dtype=np.uint64)
        r = time_xfer(agent, write(lsd, rsd), iters)
        rows.append({"case": "per-layer strided rows (prepped)", "descriptors": layers, "mib": total / 2**20, **r,
                     "gb_s": total / (r["total_ms"] / 1e3) / 1e9})
    except Exception as exc:  # noqa: BLE001 - an older NIXL: reported
        rows.append({"case": "per-layer strided rows (prepped)", "error": f"{type(exc).__name__}: {exc}"})
    try:
        t0 = time.perf_counter()
        st = agent.read(local_descs=ld, local_mem=mt, remote_descs=rd, remote_mem=mt,
                        remote_name=peer["name"], notif=b"", deadline=time.monotonic() + 60)
        rows.append({"case": "READ, coalesced run (pull)", "descriptors": len(ld), "mib": total / 2**20,
                     "post_ms": st.post_s * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3,
                     "gb_s": total / st.xfer_s / 1e9})
    except Exception as exc:  # noqa: BLE001
        rows.append({"case": "READ, coalesced run (pull)", "error": f"{type(exc).__name__}: {exc}"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=512, help="part 2: blocks of 16 tokens (512: an 8k prompt)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--spin", type=int, default=40, help="part 1: matmuls queued before each layer's values")
    ap.add_argument("--skip-cost", action="store_true", help="part 1 only")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of this script over DRAM (the marker is then always ready)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu for a dry run)")
        return 2
    from pdserve.kv_transfer.nixl_agent import NixlAgent, apply_env_defaults
    from pdserve.kv_transfer.pool import region_of

    if dev == "cuda":
        torch.cuda.set_device(0)
    apply_env_defaults(loopback=True, gpu=dev == "cuda")  # before either agent exists (the child inherits it)
    num_blocks = max(2 * 32, args.blocks)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, num_blocks, SHAPE_8B, dev), daemon=True)
    proc.start()
    pool = torch.zeros((num_blocks, *SHAPE_8B), dtype=torch.bfloat16, device=dev)
    agent = NixlAgent(f"gpc-p-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    agent.register(region_of(pool))
    ok = True
    try:
        if not parent.poll(120):
            raise RuntimeError("the decode process did not start")
        peer = parent.recv()
        agent.add_remote(peer["metadata"], peer["name"])
        print("part 1: layer-pipelined push waits on each layer's CUDA event", flush=True)
        res = run_events(parent, peer, pool, agent, control=False, blocks=32, spin=args.spin)
        ok = res["bad_slabs"] == 0
        print(f"  events : {'PASS' if ok else 'FAIL'} {res}", flush=True)
        ctl = run_events(parent, peer, pool, agent, control=True, blocks=32, spin=args.spin)
        print(f"  control (no event, always-ready marker): {ctl['bad_slabs']} of {ctl['slabs']} slabs written before "
              f"the GPU computed them {ctl}", flush=True)
        if not args.skip_cost:
            print(f"part 2: one request's WRITE, {args.blocks} blocks of the 8B shape "
                  f"({args.blocks * 16} tokens), median of {args.iters}", flush=True)
            for row in run_cost(peer, pool, agent, args.blocks, args.iters):
                if "error" in row:
                    print(f"  {row['case']:<48} {row['error']}")
                else:
                    print(f"  {row['case']:<48} {row['descriptors']:>7} descs {row['mib']:>8.1f} MiB  post "
                          f"{row['post_ms']:>8.2f} ms  total {row['total_ms']:>8.2f} ms  {row['gb_s']:>8.1f} GB/s",
                          flush=True)
    finally:
        parent.send(("stop",))
        proc.join(30)
        agent.close()
    print("gpu_push_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
