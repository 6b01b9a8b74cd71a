"""Authentication of side-channel messages with a per-deployment secret (see ARCHITECTURE.md, "KV side
channel security").

Every request and every reply is signed: HMAC-SHA256, keyed by a key derived from the secret, over the
message's exact bytes with a direction label (a request can never pass for a reply, or the other way round).
A request carries a wall-clock timestamp and a random nonce inside the signed bytes; the producer refuses
timestamps outside a bounded skew and nonces it has already seen within that window (`ReplayGuard`), and a
reply names the nonce of the request it answers. The secret itself never travels.

The handshake reply's NIXL agent metadata is also sealed (`MessageAuth.seal_parts`): whoever holds it can READ
the producer's registered memory, and a signed request can be obtained without the secret by making a decode
instance dial an address of one's choosing (forged `kv_transfer_params`) and relaying its handshake to the
producer. Sealed, the relayed reply is useless without the secret. Sealing is ChaCha20-Poly1305 (an AEAD from
the `cryptography` package, not a construction of our own): a fresh random 96-bit nonce per sealed part, the
associated data binds the part to the request nonce, the producer generation and the part's index, so a part
cannot be moved to another reply, another rank, or another incarnation of the producer without failing its tag.

Both keys (the MAC's and the AEAD's) are derived from the secret with HKDF-SHA256, one `info` label each: the
secret itself keys nothing directly.

The secret comes from `kv_connector_extra_config.side_channel_secret` or the environment variable
`PDSERVE_KV_SECRET` (what `pdserve up` uses: the environment of a process is not visible to other users,
its command line is).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "PDSERVE_KV_SECRET"
SECRET_KEY = "side_channel_secret"  # in kv_connector_extra_config
MIN_SECRET_CHARS = 16
DEFAULT_MAX_SKEW_S = 30.0

REQUEST = b"pdserve-kv-request\x00"
REPLY = b"pdserve-kv-reply\x00"
_MAC_KEY_LABEL = b"pdserve kv side channel v3 mac"
_SEAL_KEY_LABEL = b"pdserve kv side channel v3 seal (chacha20-poly1305)"
_SEAL_AAD_LABEL = b"pdserve-kv-sealed-metadata\x00"
_HKDF_SALT = b"pdserve kv side channel"
AEAD_NONCE_BYTES = 12
AEAD_TAG_BYTES = 16
SEAL_OVERHEAD = AEAD_NONCE_BYTES + AEAD_TAG_BYTES  # bytes a sealed part carries beyond its plaintext
NONCE_BYTES = 16
# Nonces remembered at most; beyond it (only authenticated peers get this far) messages are refused.
_MAX_NONCES = 1_000_000
# Clocks of one host agree; a consumer on another host whose clock is behind by more than this is refused for
# that long after a producer (re)starts.
_START_MARGIN_S = 2.0


class AuthRefused(Exception):
    """A message that must not be acted on; `reason` is the side channel's refusal code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve_secret(extra: Mapping[str, object], env: Mapping[str, str]) -> str | None:
    """The deployment secret: the config key wins over the environment; empty means none."""
    value = extra.get(SECRET_KEY)
    source = f"kv_connector_extra_config.{SECRET_KEY}"
    if value is None:
        value = env.get(SECRET_ENV) or None
        source = SECRET_ENV
    if value is None:
        return None
    if not isinstance(value, str) or len(value.strip()) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{source} must be a string of at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 32`)"
        )
    return value.strip()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _derive_key(secret: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=label).derive(secret)


class MessageAuth:
    """Signs and verifies side-channel messages with the deployment secret, and seals what only holders of the
    secret may read."""

    def __init__(self, secret: str) -> None:
        raw = secret.encode("utf-8")
        self._mac_key = _derive_key(raw, _MAC_KEY_LABEL)
        self._aead = ChaCha20Poly1305(_derive_key(raw, _SEAL_KEY_LABEL))

    def sign(self, direction: bytes, payload: bytes) -> bytes:
        return hmac.new(self._mac_key, direction + payload, hashlib.sha256).digest()

    def verify(self, direction: bytes, payload: bytes, mac: object) -> bool:
        return isinstance(mac, bytes) and hmac.compare_digest(self.sign(direction, payload), mac)

    @staticmethod
    def _aad(nonce: bytes, generation: int, index: int) -> bytes:
        return _SEAL_AAD_LABEL + nonce + generation.to_bytes(8, "big", signed=True) + index.to_bytes(4, "big")

    def seal_parts(self, parts: Sequence[bytes], nonce: bytes, generation: int) -> list[bytes]:
        """Each part encrypted and authenticated, bound to (request nonce, producer generation, its index);
        every part is `SEAL_OVERHEAD` bytes longer (its AEAD nonce in front, its tag behind)."""
        sealed = []
        for index, part in enumerate(parts):
            aead_nonce = secrets.token_bytes(AEAD_NONCE_BYTES)  # random 96 bits: no reuse in any realistic count
            sealed.append(aead_nonce + self._aead.encrypt(aead_nonce, part, self._aad(nonce, generation, index)))
        return sealed

    def open_parts(self, parts: Sequence[bytes], nonce: bytes, generation: int) -> list[bytes]:
        """The inverse of `seal_parts`; `AuthRefused("bad_seal")` if any part was altered, moved or truncated."""
        opened = []
        for index, part in enumerate(parts):
            if not isinstance(part, bytes) or len(part) < SEAL_OVERHEAD:
                raise AuthRefused("bad_seal", f"sealed part {index} is too short to be sealed")
            try:
                opened.append(
                    self._aead.decrypt(
                        part[:AEAD_NONCE_BYTES], part[AEAD_NONCE_BYTES:], self._aad(nonce, generation, index)
                    )
                )
            except InvalidTag:
                raise AuthRefused(
                    "bad_seal", f"sealed part {index} fails authentication (altered, or sealed for another reply)"
                ) from None
        return opened

    def conceal(self, data: bytes, nonce: bytes, generation: int) -> bytes:
        """One blob sealed (`seal_parts` of one part)."""
        return self.seal_parts([data], nonce, generation)[0]

    def reveal(self, data: bytes, nonce: bytes, generation: int) -> bytes:
        """The inverse of `conceal`; `AuthRefused("bad_seal")` if the blob is not one this reply's sealing made."""
        return self.open_parts([data], nonce, generation)[0]


class ReplayGuard:
    """Producer side: a signed request is fresh (timestamp within `max_skew_s` of this host's clock, and not
    from before this producer started) and its nonce has not been seen while the timestamp is acceptable.

    Nonces are remembered until their timestamp leaves the window, so memory is bounded by the request rate
    times twice the skew. The start-time floor closes the window a restart would otherwise open: a request
    captured before the restart cannot be replayed to the new incarnation (whose nonce memory is empty).
    """

    def __init__(
        self,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        *,
        clock: Callable[[], float] = time.time,
        max_nonces: int = _MAX_NONCES,
    ) -> None:
        self.max_skew_s = max_skew_s
        self._clock = clock
        self._started_at = clock()
        self._max_nonces = max_nonces
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten

    def check(self, ts: float, nonce: bytes) -> None:
        now = self._clock()
        if not math.isfinite(ts) or abs(now - ts) > self.max_skew_s:
            raise AuthRefused(
                "stale",
                f"message timestamp is {ts - now:+.1f}s from this host's clock (at most ±{self.max_skew_s:g}s "
                "allowed: a replayed message, or clocks out of sync)",
            )
        if ts < self._started_at - _START_MARGIN_S:
            raise AuthRefused("stale", "message is older than this producer (sent before it started)")
        if len(nonce) != NONCE_BYTES:
            raise AuthRefused("bad_request", f"nonce must be {NONCE_BYTES} bytes")
        with self._lock:
            self._forget_locked(now)
            if nonce in self._seen:
                raise AuthRefused("replay", "message already received (replayed)")
            if len(self._seen) >= self._max_nonces:
                self._sweep_locked(now)
            if len(self._seen) >= self._max_nonces:
                raise AuthRefused("busy", "too many recent side-channel messages; retry later")
            self._seen[nonce] = ts + self.max_skew_s

    def _forget_locked(self, now: float) -> None:
        # Insertion order is nearly timestamp order; an entry stuck behind a later one is dropped a little
        # late, which only costs memory, never safety (its timestamp check would refuse it anyway).
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until >= now:
                break
            del self._seen[nonce]

    def _sweep_locked(self, now: float) -> None:
        for nonce in [n for n, until in self._seen.items() if until < now]:
            del self._seen[nonce]

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
