"""KV transfer between prefill and decode instances over NIXL (pull mode, vLLM-compatible params).

Importing this package does not import NIXL or torch; a connector loads NIXL when it is built.
"""

from pdserve.kv_transfer.compat import make_compat
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.connector import KVConnector
from pdserve.kv_transfer.consumer import LoadResult
from pdserve.kv_transfer.errors import (
    CompatibilityError,
    InvalidKVTransferParams,
    KVTransferError,
    NixlUnavailableError,
)

__all__ = [
    "CompatibilityError",
    "InvalidKVTransferParams",
    "KVConnector",
    "KVTransferConfig",
    "KVTransferError",
    "LoadResult",
    "NixlUnavailableError",
    "make_compat",
]
