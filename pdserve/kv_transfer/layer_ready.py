"""When a layer's K/V of a step is in the pool: the seam between the forward and the push writer thread.

Layer-pipelined push (pdserve/kv_transfer/push_sender.py) queues a layer's WRITEs from the forward's per-layer
callback. On the CPU the forward is synchronous: when the callback runs, the layer's K/V is in memory
(`READY`). On a GPU the callback runs when the host has *launched* the layer's kernels, usually long before
they ran, so the callback records a CUDA event on the compute stream (`CudaLayerEvent`) and the writer thread
waits on it before posting that layer's WRITEs. The forward itself never waits: recording an event is a few
microseconds of host time and no device sync. The decode side needs no such barrier: it starts on the
completion notification, which the sender sends after every WRITE of the request completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class LayerReady(Protocol):
    """A layer's K/V of one step, as of the moment the forward's per-layer callback ran."""

    def ready(self) -> bool:
        """True when the K/V is in the pool now (never blocks)."""
        ...

    def wait(self) -> float:
        """Block until the K/V is in the pool; the seconds spent waiting. Called by the writer thread only."""
        ...


class ReadyNow:
    """The CPU forward's marker: the layer's K/V was written before the callback ran."""

    def ready(self) -> bool:
        return True

    def wait(self) -> float:
        return 0.0


READY = ReadyNow()


class CudaLayerEvent:
    """A CUDA event recorded on the device's current stream (the forward's) when the per-layer callback runs.

    Recording it in the forward thread queues it behind the layer's kernels; `wait` (the writer thread) blocks
    in cudaEventSynchronize with the GIL released, so the forward thread keeps launching meanwhile."""

    __slots__ = ("_event",)

    def __init__(self, device: int) -> None:
        import torch  # only on a CUDA pool, where torch is loaded already

        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> float:
        if self._event.query():
            return 0.0
        t0 = time.perf_counter()
        self._event.synchronize()
        return time.perf_counter() - t0


def marker_for(mem_type: str, device_id: int = 0) -> Callable[[], LayerReady]:
    """What the per-layer callback records for a pool of NIXL memory type `mem_type` ("DRAM" or "VRAM")."""
    if mem_type == "VRAM":
        return lambda: CudaLayerEvent(device_id)
    return lambda: READY
