"""A small progress bar on stderr (tqdm is not a dependency); `--disable-tqdm` turns it off."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Redraws in place on a terminal; on a pipe or file prints a line every 10% instead."""

    def __init__(self, total: int, desc: str = "", stream: TextIO | None = None, min_interval: float = 0.1):
        self.total = max(0, total)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.count = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= self.min_interval or self.count >= self.total:
                self._last_draw = now
                self.stream.write("\r" + self.render(now))
                self.stream.flush()
        else:
            decile = (10 * self.count // self.total) if self.total else 10
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self.render(time.perf_counter()) + "\n")
                self.stream.flush()

    def render(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = now - self._start
        frac = self.count / self.total if self.total else 1.0
        width = 30
        filled = int(round(width * min(frac, 1.0)))
        rate = self.count / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.count) / rate if rate > 0 else float("inf")
        eta_s = f"{eta:5.0f}s" if eta != float("inf") else "    ?s"
        prefix = f"{self.desc}: " if self.desc else ""
        return (
            f"{prefix}{100 * frac:3.0f}%|{'#' * filled}{' ' * (width - filled)}| {self.count}/{self.total} "
            f"[{elapsed:.0f}s<{eta_s}, {rate:.2f} it/s]"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self.stream.write("\r" + self.render() + "\n")
            self.stream.flush()
