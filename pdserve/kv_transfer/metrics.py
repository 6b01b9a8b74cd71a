"""Transfer statistics: vLLM's periodic `KV Transfer metrics: ...` log line and its `vllm:nixl_*` metrics.

Transfers are recorded by the side that initiates them (the consumer, in pull mode); lease expiries and late
notifications by the producer. Two series of our own, labelled by reason, keep client mistakes and attacks
out of the failure counts: `pdserve:kv_lease_rejected_total` (consumer: the producer refused the lease a
request's params name, answered with a 4xx) and `pdserve:kv_side_channel_refused_total` (producer: every
side-channel message it refused: unauthenticated, replayed, stale, wrong token, ...). Prometheus objects live on the registry passed in, so several connectors in
one process (tests) never collide on the global registry.

Multi-turn history (`bidirectional_kv_xfer`): a decode instance's held conversation histories
(`pdserve:kv_history_leases_held`, and how each ended: `pdserve:kv_history_leases_ended_total{outcome}` with
pulled / aborted / evicted / expired) and, on the instance that reads a prefix from a peer, the prefix pulls
(`pdserve:kv_prefix_pulls_total{outcome}`: loaded / recomputed / failed / declined, and the tokens they
brought).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("pdserve.kv_transfer")

XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
POST_TIME_BUCKETS = (0.001, *XFER_TIME_BUCKETS)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")


@dataclass
class _Interval:
    xfer_s: list[float] = field(default_factory=list)
    post_s: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    failed_transfers: int = 0
    failed_notifications: int = 0
    kv_expired: int = 0
    notifs_after_expiry: int = 0

    def active(self) -> bool:
        return bool(
            self.xfer_s
            or self.failed_transfers
            or self.failed_notifications
            or self.kv_expired
            or self.notifs_after_expiry
        )


def format_log_line(iv: _Interval) -> str:
    """vLLM's line: times in ms (3 decimals), MB = 2**20 bytes, descriptors to 1 decimal; 0 when no successes."""
    n = len(iv.xfer_s)
    if n:
        xfer_ms = np.asarray(iv.xfer_s) * 1e3
        post_ms = np.asarray(iv.post_s) * 1e3
        total_mb = sum(iv.nbytes) / 2**20
        total_s = sum(iv.xfer_s)
        values = {
            "Avg xfer time (ms)": round(float(xfer_ms.mean()), 3),
            "P90 xfer time (ms)": round(float(np.percentile(xfer_ms, 90)), 3),
            "Avg post time (ms)": round(float(post_ms.mean()), 3),
            "P90 post time (ms)": round(float(np.percentile(post_ms, 90)), 3),
            "Avg MB per transfer": round(total_mb / n, 3),
            "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
            "Avg number of descriptors": round(sum(iv.descriptors) / n, 1),
        }
    else:
        values = dict.fromkeys(
            (
                "Avg xfer time (ms)",
                "P90 xfer time (ms)",
                "Avg post time (ms)",
                "P90 post time (ms)",
                "Avg MB per transfer",
                "Throughput (MB/s)",
                "Avg number of descriptors",
            ),
            0,
        )
    parts = {
        "Num successful transfers": n,
        **values,
        "Num failed transfers": iv.failed_transfers + iv.failed_notifications,
        "Num KV expired reqs": iv.kv_expired,
        "Num notifs after expiry": iv.notifs_after_expiry,
    }
    return "KV Transfer metrics: " + ", ".join(f"{k}={v}" for k, v in parts.items())


class TransferMetrics:
    def __init__(
        self,
        *,
        model_name: str,
        engine: str = "0",
        registry: CollectorRegistry | None = None,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._next_log = clock() + log_interval_s
        self._lock = threading.Lock()
        self._interval = _Interval()
        self.totals = {
            "successful_transfers": 0,
            "failed_transfers": 0,
            "failed_notifications": 0,
            "kv_expired_reqs": 0,
            "notifications_after_expiry": 0,
            "bytes": 0,
            "lease_rejected": 0,
            "side_channel_refused": 0,
            "history_held": 0,
            "history_pulled": 0,
            "history_aborted": 0,
            "history_evicted": 0,
            "history_expired": 0,
            "prefix_pulls_loaded": 0,
            "prefix_pulls_recomputed": 0,
            "prefix_pulls_failed": 0,
            "prefix_pulls_declined": 0,
            "prefix_pulled_tokens": 0,
            "digest_verified_blocks": 0,
            "digest_mismatches": 0,
            "digest_unverified": 0,
        }
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        reg = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        self._xfer = histogram("vllm:nixl_xfer_time_seconds",
                               "Histogram of transfer duration for NIXL KV Cache transfers.", XFER_TIME_BUCKETS)
        self._post = histogram("vllm:nixl_post_time_seconds",
                               "Histogram of transfer post time for NIXL KV Cache transfers.", POST_TIME_BUCKETS)
        self._bytes = histogram("vllm:nixl_bytes_transferred",
                                "Histogram of bytes transferred per NIXL KV Cache transfers.", BYTES_BUCKETS)
        self._descs = histogram("vllm:nixl_num_descriptors",
                                "Histogram of number of descriptors per NIXL KV Cache transfers.", DESCRIPTOR_BUCKETS)
        self._failed = counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.")
        self._failed_notifs = counter("vllm:nixl_num_failed_notifications",
                                      "Number of failed NIXL KV Cache notifications.")
        self._expired = counter("vllm:nixl_num_kv_expired_reqs",
                                "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.")
        self._after_expiry = counter("vllm:nixl_num_notifications_after_expiry",
                                     "Number of notifications that arrived after their KV lease expired (tracked on the P instance).")
        self._lease_rejected = Counter(
            "pdserve:kv_lease_rejected",
            "Decode requests whose kv_transfer_params named a lease the producer refused (client errors, by reason).",
            [*labels, "reason"],
            registry=reg,
        )
        self._side_channel_refused = Counter(
            "pdserve:kv_side_channel_refused",
            "KV side-channel messages this producer refused, by reason (unauthenticated, replay, bad_token, ...).",
            [*labels, "reason"],
            registry=reg,
        )
        self._label_values = values
        stages = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Decode requests fetching remote KV, by stage.",
            [*labels, "stage"],
            registry=reg,
        )
        self._stages = {stage: stages.labels(*values, stage) for stage in FETCH_STAGES}
        self._history_held = Gauge(
            "pdserve:kv_history_leases_held",
            "Conversation histories this (decode) instance holds for the next turn's prefill "
            "(bidirectional_kv_xfer).",
            labels,
            registry=reg,
        ).labels(*values)
        self._history_ended = Counter(
            "pdserve:kv_history_leases_ended",
            "Held conversation histories that ended, by outcome: pulled (read by a prefill), aborted (the "
            "prefill needed none of it), evicted (the blocks were needed), expired (decoder_kv_blocks_ttl).",
            [*labels, "outcome"],
            registry=reg,
        )
        self._prefix_pulls = Counter(
            "pdserve:kv_prefix_pulls",
            "Prompt prefixes this instance was asked to read from a peer's held KV, by outcome: loaded, "
            "recomputed (the peer refused or failed; computed here instead), failed (the request failed) or "
            "declined (not read: nothing matched, the local prefix cache had it, or under kv_recompute_threshold).",
            [*labels, "outcome"],
            registry=reg,
        )
        self._prefix_tokens = counter("pdserve:kv_prefix_pulled_tokens",
                                      "Prompt tokens whose KV was read from a peer's held prefix instead of being computed.")
        self._push_bytes = Counter(
            "pdserve:kv_push_written_bytes",
            "Push mode (NixlPushConnector), prefill side: KV bytes WRITTEN into decode instances' blocks, by "
            "phase: during_prefill (layer-pipelined, posted before the prefill finished) or after_prefill.",
            [*labels, "phase"],
            registry=reg,
        )
        self._push_jobs = Counter(
            "pdserve:kv_push_jobs_ended",
            "Push mode, prefill side: push jobs by how they ended: done, failed or cancelled (by the decode).",
            [*labels, "outcome"],
            registry=reg,
        )

        self._digest_mismatch = Counter(
            "pdserve:kv_digest_mismatch",
            "KV loads whose bytes did not match the producer's per-block digests (remote_block_digests), by where "
            "they were caught (read, push, host_tier) and what became of the request (recomputed or failed: "
            "kv_load_failure_policy). Never an answer.",
            [*labels, "where", "outcome"],
            registry=reg,
        )
        self._digest_verified = counter("pdserve:kv_digest_verified_blocks",
                                        "KV blocks whose digest was checked after a READ or push and matched.")
        self._digest_unverified = Counter(
            "pdserve:kv_digest_unverified",
            "KV loads that could not be (wholly) checked against digests, by reason: absent (the producer sent none), "
            "tp_mismatch (one digest list per producer rank missing), tp_split (XXH3 digests of a producer rank "
            "whose heads several consumer ranks hold), algo (an unknown algorithm).",
            [*labels, "reason"],
            registry=reg,
        )
    @property
    def labels(self) -> dict[str, str]:
        """This instance's label values by name (for collectors registered beside these metrics)."""
        return dict(zip(("model_name", "engine"), self._label_values, strict=True))

    # ---- recording ---------------------------------------------------------------------------------

    def record_digest_mismatch(self, where: str, outcome: str) -> None:
        self._digest_mismatch.labels(*self._label_values, where, outcome).inc()
        with self._lock:
            self.totals["digest_mismatches"] += 1

    def record_digest_verified(self, num_blocks: int) -> None:
        self._digest_verified.inc(num_blocks)
        with self._lock:
            self.totals["digest_verified_blocks"] += num_blocks

    def record_digest_unverified(self, reason: str) -> None:
        self._digest_unverified.labels(*self._label_values, reason).inc()
        with self._lock:
            self.totals["digest_unverified"] += 1

    def record_push_write(self, nbytes: int, during_prefill: bool) -> None:
        self._push_bytes.labels(*self._label_values, "during_prefill" if during_prefill else "after_prefill"
                                ).inc(nbytes)

    def record_push_job(self, outcome: str) -> None:
        self._push_jobs.labels(*self._label_values, outcome).inc()

    def record_transfer(self, *, xfer_s: float, post_s: float, nbytes: int, num_descriptors: int) -> None:
        self._xfer.observe(xfer_s)
        self._post.observe(post_s)
        self._bytes.observe(nbytes)
        self._descs.observe(num_descriptors)
        with self._lock:
            iv = self._interval
            iv.xfer_s.append(xfer_s)
            iv.post_s.append(post_s)
            iv.nbytes.append(nbytes)
            iv.descriptors.append(num_descriptors)
            self.totals["successful_transfers"] += 1
            self.totals["bytes"] += nbytes

    def record_failed_transfer(self) -> None:
        self._failed.inc()
        with self._lock:
            self._interval.failed_transfers += 1
            self.totals["failed_transfers"] += 1

    def record_failed_notification(self) -> None:
        self._failed_notifs.inc()
        with self._lock:
            self._interval.failed_notifications += 1
            self.totals["failed_notifications"] += 1

    def record_kv_expired(self) -> None:
        self._expired.inc()
        with self._lock:
            self._interval.kv_expired += 1
            self.totals["kv_expired_reqs"] += 1

    def record_notification_after_expiry(self) -> None:
        self._after_expiry.inc()
        with self._lock:
            self._interval.notifs_after_expiry += 1
            self.totals["notifications_after_expiry"] += 1

    def record_lease_rejected(self, reason: str) -> None:
        self._lease_rejected.labels(*self._label_values, reason).inc()
        with self._lock:
            self.totals["lease_rejected"] += 1

    def record_side_channel_refused(self, reason: str) -> None:
        self._side_channel_refused.labels(*self._label_values, reason).inc()
        with self._lock:
            self.totals["side_channel_refused"] += 1

    def set_history_held(self, n: int) -> None:
        self._history_held.set(n)
        with self._lock:
            self.totals["history_held"] = n

    def record_history_ended(self, outcome: str) -> None:
        self._history_ended.labels(*self._label_values, outcome).inc()
        with self._lock:
            self.totals[f"history_{outcome}"] += 1

    def record_prefix_pull(self, outcome: str, tokens: int = 0) -> None:
        self._prefix_pulls.labels(*self._label_values, outcome).inc()
        if tokens:
            self._prefix_tokens.inc(tokens)
        with self._lock:
            self.totals[f"prefix_pulls_{outcome}"] += 1
            self.totals["prefix_pulled_tokens"] += tokens

    def set_fetch_stages(self, *, waiting_to_start: int, in_progress: int, completed_waiting: int) -> None:
        self._stages["waiting_to_start"].set(waiting_to_start)
        self._stages["in_progress"].set(in_progress)
        self._stages["completed_waiting"].set(completed_waiting)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)

    # ---- periodic log ------------------------------------------------------------------------------

    def maybe_log(self) -> str | None:
        """Emit (and return) the log line if the interval is over and anything happened in it."""
        now = self._clock()
        with self._lock:
            if now < self._next_log:
                return None
            self._next_log = now + self._log_interval_s
            iv, self._interval = self._interval, _Interval()
        if not iv.active():
            return None
        line = format_log_line(iv)
        logger.info("%s", line)
        return line
