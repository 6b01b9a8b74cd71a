"""What the prefill's NIXL progress loop cost a push prefill leg on the CPU (issue 41: the push prefill leg was
~1 s slower than pull's at 1024 tokens). Until the fix, every `push_*` side-channel call re-armed the producer's
fast polling for 2 s (`producer._boost_until`), and a decode asks `push_status` every 20 ms for the whole push:
the loop ran `agent.get_notifs()` then slept 50 us, for as long as the prefill computed, on the prefill's own
core. Pull never has that during a prefill (it boosts at the claim, after the prefill).

This measures exactly that: a prefill-shaped compute (SmolLM2-135M's matrix sizes, 1024 tokens, 30 layers, one
thread) pinned to one core, alone and with that loop running on a real NIXL agent beside it, interleaved A/B
so the box's other load hits both alike.

    python benchmarks/push_prefill_spin.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from pdserve.kv_transfer.nixl_agent import NixlAgent, load_nixl

FAST_POLL_S = 0.00005  # the producer's fast-poll sleep


def prefill_like(tokens: int, hidden: int, inter: int, layers: int) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w_up = torch.randn(hidden, inter, generator=g) / hidden**0.5
    w_down = torch.randn(inter, hidden, generator=g) / inter**0.5
    w_qkv = torch.randn(hidden, 3 * hidden, generator=g) / hidden**0.5
    t0 = time.perf_counter()
    for _ in range(layers):
        q, k, v = (x @ w_qkv).split(hidden, dim=1)
        a = torch.softmax((q @ k.T) / hidden**0.5, dim=-1) @ v
        x = x + a
        x = x + torch.nn.functional.silu(x @ w_up) @ w_down
        x = x / x.norm(dim=-1, keepdim=True)
    return time.perf_counter() - t0


def spin(agent: NixlAgent, stop: threading.Event) -> None:
    while not stop.is_set():
        agent.get_notifs()
        time.sleep(FAST_POLL_S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    load_nixl()
    agent = NixlAgent(f"spin-probe-{os.getpid()}", ("UCX",))
    shape = (args.tokens, 576, 1536, 30)  # SmolLM2-135M: hidden 576, MLP 1536, 30 layers
    prefill_like(*shape)  # warm up
    alone, spinning = [], []
    for _ in range(args.rounds):
        alone.append(prefill_like(*shape))
        stop = threading.Event()
        th = threading.Thread(target=spin, args=(agent, stop), daemon=True)
        th.start()
        spinning.append(prefill_like(*shape))
        stop.set()
        th.join()
    agent.close()
    a, s = statistics.median(alone), statistics.median(spinning)
    print(f"prefill-shaped compute, {args.tokens} tokens, one core, {args.rounds} rounds interleaved:")
    print(f"  alone (push prefill now, and pull):           {a * 1e3:8.0f} ms  {[round(x * 1e3) for x in alone]}")
    print(f"  with the boosted progress loop (push before): {s * 1e3:8.0f} ms  {[round(x * 1e3) for x in spinning]}")
    print(f"  slower by {100 * (s / a - 1):.0f}%")


if __name__ == "__main__":
    main()
