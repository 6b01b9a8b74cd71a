"""The compatibility dict both sides exchange in the handshake.

A mismatch in any field means the consumer would read bytes it cannot interpret, so both the consumer
(on the handshake reply) and the producer (on the handshake request) refuse, naming the fields.
Block counts may differ between instances: they are not part of the dict.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.kv_transfer.errors import CompatibilityError
from pdserve.version import __version__

# A compatibility field's value (what msgpack and JSON carry as a scalar), and the dict of them.
CompatValue = str | int | float | bool | None
Compat = dict[str, CompatValue]

# Bumped whenever the side-channel messages or the transfer semantics change incompatibly.
PROTOCOL_VERSION = 2  # 2: signed envelopes, lease tokens (issue 15)

# A GPU pool is [num_blocks, num_layers, 2 (K,V), block_size, num_kv_heads, head_dim] (token-major
# regions, vLLM's NHD); a CPU float pool [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
# (head-major regions, vLLM's CPU backend's HND: see pdserve.engine.runner.model_runner).
POOL_LAYOUT = "block,layer,kv,token,head,dim"
HEAD_MAJOR_LAYOUT = "block,layer,kv,head,token,dim"

REQUIRED_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def make_compat(
    *,
    model: str,
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_layout: str = POOL_LAYOUT,
    kv_cache_dtype: str | None = None,
    kv_scales: str = "none",
) -> Compat:
    """Build the dict the engine passes to `KVConnector` (model = a stable identity of the weights).

    dtype is the model's compute dtype; kv_cache_dtype what the pool stores (default: dtype) and kv_scales
    where its quantization scales live (pdserve.attention.fp8_kv.SCALE_SCHEME for fp8). A producer and a
    consumer that differ in either would read each other's bytes as something else, so they are refused.
    """
    return normalize_compat(
        {
            "model": model,
            "dtype": dtype,
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "kv_layout": kv_layout,
            "kv_cache_dtype": kv_cache_dtype or str(dtype).removeprefix("torch."),
            "kv_scales": kv_scales,
        }
    )


def normalize_compat(compat: Mapping[str, object]) -> Compat:
    """Validate the engine-provided fields (`dtype` may be a torch.dtype) and add the version fields this build
    speaks."""
    missing = [k for k in REQUIRED_FIELDS if k not in compat]
    if missing:
        raise ValueError(f"compatibility dict lacks {', '.join(missing)}")
    out: Compat = {}
    for key, value in compat.items():
        if key == "dtype":
            value = str(value).removeprefix("torch.")
        if not isinstance(value, str | int | float | bool | None):
            raise ValueError(f"compatibility field {key} must be a scalar, got {type(value).__name__}")
        out[key] = value
    out.setdefault("kv_layout", POOL_LAYOUT)
    out.setdefault("kv_cache_dtype", out["dtype"])
    out.setdefault("kv_scales", "none")
    # push (NixlPushConnector) or pull: a pair must agree (the KVConnector sets its own; absent means pull)
    out.setdefault("kv_transfer_mode", "pull")
    out["pdserve_version"] = __version__
    out["protocol_version"] = PROTOCOL_VERSION
    for key in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"compatibility field {key} must be a positive int, got {value!r}")
    if not isinstance(out["model"], str) or not out["model"]:
        raise ValueError("compatibility field model must be a non-empty string")
    return out


def compat_differences(
    ours: Mapping[str, CompatValue], theirs: Mapping[str, CompatValue], labels: tuple[str, str] = ("ours", "theirs")
) -> list[str]:
    """Human-readable `field: ours=X theirs=Y` entries for every field that differs."""
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, "<missing>"), theirs.get(key, "<missing>")
        if a != b:
            diffs.append(f"{key}: {labels[0]}={a!r} {labels[1]}={b!r}")
    return diffs


def check_compat(
    ours: Mapping[str, CompatValue],
    theirs: Mapping[str, CompatValue],
    *,
    peer: str,
    labels: tuple[str, str] = ("ours", "theirs"),
) -> None:
    diffs = compat_differences(ours, theirs, labels)
    if diffs:
        raise CompatibilityError(f"KV layout/model mismatch with {peer}: " + "; ".join(diffs))
