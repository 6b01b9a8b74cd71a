"""Real models' config.json files shipped as package data, for `--load-format dummy` runs in their shapes.

`dummy_model_dir("Llama-3.1-8B")` returns a folder holding just that config.json, which the engine
loads like any model folder; with load_format="dummy" the weights are random, allocated directly in the
target dtype. No weights or tokenizer are involved, so this works with no download.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "data" / "configs"


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name: str) -> Path:
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no packaged config {name!r}; available: {', '.join(available())}")
    return path


def dummy_model_dir(name: str, root: Path | None = None) -> Path:
    """A model folder (config.json only) for the packaged config `name`."""
    cfg = json.loads(config_path(name).read_text())
    out = (root or Path(tempfile.gettempdir()) / "pdserve-dummy-models") / name
    out.mkdir(parents=True, exist_ok=True)
    target = out / "config.json"
    text = json.dumps(cfg, indent=2)
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)
    return out
