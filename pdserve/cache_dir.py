"""Where pdserve keeps what it builds or fetches once per machine (the embedded model, compiled CPU kernels).
Standard library only: every layer may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "pdserve"
    return Path.home() / ".cache" / "pdserve"
