"""`kv_transfer_params` (what a producer returns, what a consumer accepts) live in `pdserve.api.pd`, the
one home of the P/D wire contract; this module re-exports them for the KV-transfer modules that still
import them from here."""

from pdserve.api.pd import RemotePrefillParams, build_producer_params, parse_remote_prefill_params

__all__ = ["RemotePrefillParams", "build_producer_params", "parse_remote_prefill_params"]
