"""Exception types of the KV transfer layer.

They are separate from the modules that raise them so that the engine and the server can catch them
without importing NIXL (which is only loaded when a connector is built).
"""

from __future__ import annotations

from pdserve.api.pd import InvalidKVTransferParams  # the wire contract's error, re-exported here

__all__ = [
    "CompatibilityError", "InvalidKVTransferParams", "KVTransferError", "NixlUnavailableError", "ProtocolError",
    "SideChannelError", "SideChannelRefused", "SideChannelTimeout", "TransferFailed", "TransferTimeout",
]


class KVTransferError(RuntimeError):
    """Base class of KV transfer failures (handshake, claim, transfer, release)."""


class NixlUnavailableError(KVTransferError):
    """No NIXL Python package could be imported."""


class CompatibilityError(KVTransferError):
    """Producer and consumer disagree on model/KV layout; the message names the differing fields."""


class SideChannelError(KVTransferError):
    """The side channel could not be used: connection refused or reset, protocol violation."""


class ProtocolError(SideChannelError):
    """A frame or message that does not follow the side channel's protocol (`messages.py`)."""


class SideChannelTimeout(SideChannelError):
    """A side-channel call got no reply in time (frozen or overloaded peer)."""


class SideChannelRefused(SideChannelError):
    """The peer answered the call with an error reply.

    `reason` is a short machine-readable code (`unknown`, `expired`, `already_claimed`,
    `stale_generation`, `incompatible`, `bad_request`, `internal`).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TransferTimeout(KVTransferError):
    """A NIXL transfer did not complete before its deadline (e.g. a SIGSTOPped peer)."""


class TransferFailed(KVTransferError):
    """NIXL raised or reported an error for a transfer (e.g. the peer died)."""
