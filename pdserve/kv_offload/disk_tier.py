"""The disk tier: one file per block under a directory, bounded in bytes, evicted LRU, each file carrying a
checksum so that a corrupted or truncated file is detected and dropped (the block is then recomputed),
never loaded into the KV cache.

File layout (little-endian): magic `PDKVBLK1`, u32 header version, 32-byte block hash, u64 payload bytes,
u32 CRC-32 of the payload, u32 fingerprint length, the fingerprint (KV dtype and block shape, UTF-8), then
the payload (the block exactly as the pool stores it). Writes go to `NAME.tmp` and are renamed into place.
The tier does not survive a restart: files of ours (`*.pdkv`, `*.pdkv.tmp`) found at start are deleted.

Writes run on a writer thread (the engine thread only hands over a copy); reads run on the caller's thread
(the tier manager's reader). The index is shared under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.kv_offload.block_meta import BlockMeta

log = logging.getLogger("pdserve.kv_offload")

MAGIC = b"PDKVBLK1"
VERSION = 1
_HEADER = struct.Struct("<8sI32sQII")
SUFFIX = ".pdkv"


def as_bytes(t: torch.Tensor):
    """A writable byte view (numpy) of a contiguous CPU tensor of any dtype."""
    return t.reshape(-1).view(torch.uint8).numpy()


class DiskTier:
    def __init__(self, path: str | Path, max_bytes: int, block_nbytes: int, fingerprint: str,
                 on_change: Callable[[str, bytes, BlockMeta | None], None] | None = None,
                 max_pending_writes: int = 256):
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint.encode()
        self.block_nbytes = block_nbytes
        self.file_bytes = _HEADER.size + len(self.fingerprint) + block_nbytes
        if max_bytes < self.file_bytes:
            raise ValueError(f"--kv-offloading-disk-size holds no block (one block file is {self.file_bytes} bytes)")
        self.max_bytes = max_bytes
        self._on_change = on_change  # ("stored" | "removed", hash, meta) from whichever thread changed it
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, BlockMeta] = OrderedDict()  # least recently used first
        self._writing: set[bytes] = set()
        self.num_corrupt = 0  # files that failed verification (dropped, never used)
        self.num_write_dropped = 0  # writes refused because the writer was too far behind
        self.bytes_written = 0
        self.write_seconds = 0.0
        removed = 0
        for f in self.dir.iterdir():
            if f.name.endswith((SUFFIX, SUFFIX + ".tmp")):
                f.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("KV disk tier %s: removed %d block files of an earlier run", self.dir, removed)
        self._queue: queue.Queue[tuple[bytes, BlockMeta, torch.Tensor] | None] = queue.Queue(max_pending_writes)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- index ---------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.max_bytes // self.file_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._index

    def meta(self, h: bytes) -> BlockMeta | None:
        with self._lock:
            return self._index.get(h)

    def path_of(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    def _drop_locked(self, h: bytes) -> BlockMeta | None:
        meta = self._index.pop(h, None)
        self.path_of(h).unlink(missing_ok=True)
        return meta

    # ---- writes ------------------------------------------------------------------------------
    def submit(self, h: bytes, meta: BlockMeta, data: torch.Tensor) -> None:
        """Queues a block (a CPU tensor the caller no longer uses) for writing; never blocks the caller."""
        with self._lock:
            if h in self._index or h in self._writing:
                return
            self._writing.add(h)
        try:
            self._queue.put_nowait((h, meta, data))
        except queue.Full:
            with self._lock:
                self._writing.discard(h)
            self.num_write_dropped += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Waits until every queued write is on disk (tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writing:
                    return
            time.sleep(0.005)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            h, meta, data = item
            try:
                self._write(h, meta, data)
            except OSError as e:
                log.warning("KV disk tier: writing a block failed: %s", e)
            finally:
                with self._lock:
                    self._writing.discard(h)

    def _write(self, h: bytes, meta: BlockMeta, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        payload = as_bytes(data.contiguous())
        header = _HEADER.pack(MAGIC, VERSION, h, payload.nbytes, zlib.crc32(payload), len(self.fingerprint))
        evicted: list[tuple[bytes, BlockMeta | None]] = []
        with self._lock:  # room first, so the directory never holds more than max_bytes of our files
            while self._index and (len(self._index) + 1) * self.file_bytes > self.max_bytes:
                old = next(iter(self._index))
                evicted.append((old, self._drop_locked(old)))
        for old, old_meta in evicted:
            if self._on_change is not None:
                self._on_change("removed", old, old_meta)
        final = self.path_of(h)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(self.fingerprint)
            f.write(payload)
        os.replace(tmp, final)
        with self._lock:
            self._index[h] = meta
        self.bytes_written += self.file_bytes
        self.write_seconds += time.perf_counter() - t0
        if self._on_change is not None:
            self._on_change("stored", h, meta)

    # ---- reads -------------------------------------------------------------------------------
    def read_into(self, h: bytes, dst: torch.Tensor) -> bool:
        """Fills `dst` (a contiguous CPU block) from h's file after verifying it; False (and the file dropped)
        when it is missing, truncated, foreign or fails its checksum."""
        with self._lock:
            if h not in self._index:
                return False
            self._index.move_to_end(h)
        problem = self._read_verified(h, as_bytes(dst))
        if problem is None:
            return True
        self.num_corrupt += problem != "missing"
        log.warning("KV disk tier: block file %s is unusable (%s); the block will be recomputed",
                    self.path_of(h).name, problem)
        with self._lock:
            meta = self._drop_locked(h)
        if meta is not None and self._on_change is not None:
            self._on_change("removed", h, meta)
        return False

    def _read_verified(self, h: bytes, out) -> str | None:
        try:
            with open(self.path_of(h), "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return "truncated header"
                magic, version, fh, nbytes, crc, fp_len = _HEADER.unpack(head)
                if magic != MAGIC or version != VERSION:
                    return "not a block file"
                if fh != h or nbytes != out.nbytes or f.read(fp_len) != self.fingerprint:
                    return "another block or layout"
                n = f.readinto(out)
                if n != nbytes:
                    return f"truncated payload ({n} of {nbytes} bytes)"
                if f.read(1):
                    return "trailing bytes"
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable: {e}"
        if zlib.crc32(out) != crc:
            return "checksum mismatch"
        return None

    def clear(self) -> list[bytes]:
        self.flush()
        with self._lock:
            gone = list(self._index)
            for h in gone:
                self._drop_locked(h)
        return gone

    def shutdown(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._writer.join(timeout=5.0)
