"""The autoscaler's record: every decision and every event with the numbers behind it, three ways.

- a JSON line per entry in `autoscaler.log` (in the deployment's log directory, on the controller's node);
- the last `keep` entries in memory, for `pdserve up --ray` to print and for GET /pdserve/autoscaler;
- Prometheus metrics on the controller's metrics address:
  `pdserve_autoscaler_replicas{role}`, `pdserve_autoscaler_desired_replicas{role}`,
  `pdserve_autoscaler_signal{role,signal}` (ongoing, waiting, kv_usage, latency_q_seconds),
  `pdserve_autoscaler_decisions_total{action,role}` and `pdserve_autoscaler_events_total{kind}`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.autoscale.policy import Decision, RoleView

logger = logging.getLogger("pdserve.autoscale")

ACTIONS = ("scale_up", "scale_down", "switch")


class AutoscaleRecord:
    def __init__(self, log_path: Path | None, keep: int = 500) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.replicas = Gauge("pdserve_autoscaler_replicas", "Replicas per role (starting ones included)",
                              ["role"], registry=reg)
        self.desired = Gauge("pdserve_autoscaler_desired_replicas", "Replicas the policy wants per role",
                             ["role"], registry=reg)
        self.signal = Gauge("pdserve_autoscaler_signal", "The window's numbers the policy decides on",
                            ["role", "signal"], registry=reg)
        self.decisions = Counter("pdserve_autoscaler_decisions", "Scaling decisions taken",
                                 ["action", "role"], registry=reg)
        self.events = Counter("pdserve_autoscaler_events", "Outcomes and cluster events (done, failed, "
                              "restarted, ...)", ["kind"], registry=reg)
        self._log_path = log_path
        self._entries: deque[dict[str, Any]] = deque(maxlen=keep)
        self._seq = 0
        self._lock = threading.Lock()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)

    def observe(self, views: dict[str, RoleView]) -> None:
        for role, v in views.items():
            s = v.signals
            self.replicas.labels(role).set(s.replicas)
            self.desired.labels(role).set(v.desired)
            self.signal.labels(role, "ongoing").set(s.ongoing)
            self.signal.labels(role, "waiting").set(s.waiting)
            # NaN when the window has no sample, rather than the last value seen long ago
            self.signal.labels(role, "kv_usage").set(math.nan if s.kv_usage is None else s.kv_usage)
            self.signal.labels(role, "latency_q_seconds").set(math.nan if s.latency_q is None else s.latency_q)

    def _append(self, entry: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            entry = {"seq": self._seq, "time": round(time.time(), 3), **entry}
            self._entries.append(entry)
            if self._log_path is not None:
                with open(self._log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
        return entry

    def decision(self, d: Decision) -> dict[str, Any]:
        self.decisions.labels(d.action, d.role).inc()
        logger.warning("autoscale: %s | %s", d.describe(), json.dumps(d.numbers))
        return self._append({"kind": "decision", "text": d.describe(), **d.to_json()})

    def event(self, kind: str, text: str, **details: Any) -> dict[str, Any]:
        """An outcome (`done`, `failed`) or something seen (`restarted`, `placement`, ...)."""
        self.events.labels(kind).inc()
        logger.warning("autoscale %s: %s", kind, text)
        return self._append({"kind": kind, "text": text, **details})

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._entries if e["seq"] > seq]
