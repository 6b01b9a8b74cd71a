"""Shared fixtures: tiny random-weight models built locally (no downloads)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")

# CI runs property tests with a fixed seed, so a red build is reproducible and never a coin flip.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass
