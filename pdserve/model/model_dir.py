"""Which folder holds a model: one home for the engine and the speculative draft model alike."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str | None, load_format: str = "auto") -> Path:
    """A folder as given; with load_format "dummy" also a packaged config's name (its shapes, random weights:
    pdserve.model.packaged_configs); else what pdserve.model.default_model.resolve_model takes (an embedded
    model's name, None for the default)."""
    if model is not None and Path(model).is_dir():
        return Path(model)
    if model is not None and load_format == "dummy":
        # Real models' shapes ship as package data (e.g. Llama-3.1-8B): random weights, no download.
        from pdserve.model.packaged_configs import available, dummy_model_dir

        if model in available():
            return dummy_model_dir(model)
    from pdserve.model.default_model import resolve_model  # converts the embedded default on first use

    return resolve_model(model)
