"""`kv_transfer_params`: what a producer returns (vLLM 0.33 pull-mode shape) and what a consumer accepts.

The proxy copies the producer's dict verbatim into the decode request, so the consumer must validate it
as untrusted input: a malformed dict is a 400, never a half-scheduled request (vLLM's own failure mode).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.errors import InvalidKVTransferParams

_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class RemotePrefillParams:
    """The validated subset of a decode request's `kv_transfer_params` the consumer acts on."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    remote_num_tokens: int | None
    generation: int | None  # remote_registration_generation: which producer incarnation issued them

    @property
    def address(self) -> tuple[str, int]:
        return (self.remote_host, self.remote_port)


def build_producer_params(
    *,
    request_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    num_cached_tokens: int,
    engine_id: str,
    host: str,
    port: int,
    generation: int,
    lease_duration_s: float,
) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        # One KV-cache group (plain decoder): a list holding one list of block ids.
        "remote_block_ids": [[int(b) for b in block_ids]],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": int(num_tokens),
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": generation,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": int(num_cached_tokens),
        # Ours: wall-clock end of the lease as issued (heartbeats extend it on the producer).
        "lease_expires_at": time.time() + lease_duration_s,
    }


def _bad(msg: str) -> InvalidKVTransferParams:
    return InvalidKVTransferParams(f"invalid kv_transfer_params: {msg}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_remote_prefill_params(params: Any) -> RemotePrefillParams:
    """Validate the params of a decode (D) request; raise InvalidKVTransferParams naming the problem."""
    if not isinstance(params, Mapping):
        raise _bad(f"expected a JSON object, got {type(params).__name__}")
    if not params.get("do_remote_prefill"):
        raise _bad("do_remote_prefill is not true (nothing to load)")
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        raise _bad(
            f"missing {', '.join(missing)} (send the complete kv_transfer_params the prefill instance returned)"
        )
    mode = params.get("transfer_mode", "pull")
    if mode != "pull":
        raise _bad(f"transfer_mode {mode!r} is not supported (pull only)")

    groups = params["remote_block_ids"]
    if not isinstance(groups, list) or not groups:
        raise _bad("remote_block_ids must be a non-empty list of per-group block id lists")
    if all(_is_int(b) for b in groups):
        # vLLM < HMA (schema v1) sent one flat list; accept it as the single group.
        groups = [groups]
    if len(groups) != 1:
        raise _bad(
            f"remote_block_ids has {len(groups)} KV-cache groups; only single-group models are supported"
        )
    blocks = groups[0]
    if not isinstance(blocks, list) or not all(_is_int(b) and b >= 0 for b in blocks):
        raise _bad("remote_block_ids[0] must be a list of non-negative integers")

    engine_id = params["remote_engine_id"]
    request_id = params["remote_request_id"]
    host = params["remote_host"]
    for name, value in (
        ("remote_engine_id", engine_id),
        ("remote_request_id", request_id),
        ("remote_host", host),
    ):
        if not isinstance(value, str) or not value:
            raise _bad(f"{name} must be a non-empty string, got {value!r}")
    port = params["remote_port"]
    if not _is_int(port) or not 1 <= port <= 65535:
        raise _bad(f"remote_port must be an integer in 1..65535, got {port!r}")

    for name in ("tp_size", "pp_size", "dcp_size"):
        value = params.get(name, 1)
        if value is None:
            value = 1
        if not _is_int(value) or value < 1:
            raise _bad(f"{name} must be a positive integer, got {value!r}")
        if value != 1:
            raise _bad(
                f"{name}={value}: producers with tensor/pipeline/context parallelism are not supported"
            )

    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (not _is_int(num_tokens) or num_tokens < 0):
        raise _bad(f"remote_num_tokens must be a non-negative integer, got {num_tokens!r}")
    generation = params.get("remote_registration_generation")
    if generation is not None and not _is_int(generation):
        raise _bad(f"remote_registration_generation must be an integer, got {generation!r}")

    return RemotePrefillParams(
        remote_engine_id=engine_id,
        remote_request_id=request_id,
        remote_host=host,
        remote_port=port,
        remote_block_ids=tuple(blocks),
        remote_num_tokens=num_tokens,
        generation=generation,
    )
