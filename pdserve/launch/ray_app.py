"""The Ray app behind `pdserve up --ray`: a controller actor that places, supervises and sizes the pools.

Placement: each instance reserves its resources (CPUs, GPUs, the role's custom resources) in a placement
group of one bundle, on whichever node has them, and its actor (pdserve/launch/ray_instance.py) runs in
that bundle. The group outlives the actor: while Ray restarts a crashed instance, or while an instance
switches role, nothing else can take its GPUs. A tensor-parallel instance's bundle holds all its GPUs, so
its ranks share one node.

Supervision is Ray's: instance actors and the proxy actor have `max_restarts`; the proxy follows the
instance set by itself (named actors, pdserve/proxy/discovery.py). The controller only watches, to report
restarts and to feed the autoscaler.

Sizing (when `autoscale` is set): every `interval_s` the controller scrapes each instance's `/metrics`,
reads the proxy's legs in flight, and asks the policy (pdserve/autoscale/policy.py) for at most one
action, which runs on its own thread while decisions pause:
- scale_up: a new placement group and instance of the role, admitted by the proxy once healthy;
- scale_down: drain (the proxy stops routing to it at once, see `drain`) until the engine is idle or
  `drain_timeout_s`, then stop it and free its placement group;
- switch: drain a replica of the other role, stop it, and start the role's instance in the same placement
  group (the resources never leave the app). The new instance asks for exactly what the group's bundle
  holds (its first role's CPUs, GPUs and custom resources: a role resource pins where a role's *new*
  replicas go, not what a reused bundle may run); roles whose instances need different CPUs or GPUs
  (e.g. `--prefill-tp 2 --decode-tp 1`) cannot trade bundles, so then the app never switches.
The controller is owned by the driver (`pdserve up --ray`) and owns everything else, so a driver that
exits takes the whole app with it (Ray's ownership), and no instance outlives its app.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve.autoscale.policy import ROLES as SCALED_ROLES
from pdserve.autoscale.policy import AutoscaleConfig, Autoscaler, Decision
from pdserve.autoscale.record import AutoscaleRecord
from pdserve.autoscale.signals import InstanceSample, SignalWindow, Tick, parse_instance_metrics
from pdserve.launch.ray_instance import InstanceServer
from pdserve.launch.ray_proxy import ProxyServer
from pdserve.launch.ray_spec import InstanceSpec, RayAppSpec, instance_name, instance_prefix, proxy_name

logger = logging.getLogger("pdserve.ray")

InstanceActor = ray.remote(InstanceServer)
ProxyActor = ray.remote(ProxyServer)

CALL_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0  # how often restarts are looked for when the autoscaler is off
PROXY_READY_TIMEOUT_S = 60.0


class PlacementError(RuntimeError):
    """No node can hold an instance's bundle (within the placement timeout)."""


@dataclass
class Slot:
    index: int
    name: str
    role: str
    pg: PlacementGroup
    actor: Any
    shape: str  # the role whose template's bundle `pg` reserved (another role's after a switch)
    state: str = "starting"  # as the actor reports it, or "unavailable" when it does not answer
    url: str | None = None
    pid: int | None = None
    endpoint: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        ep = self.endpoint or {}
        return {"index": self.index, "name": self.name, "role": self.role, "state": self.state, "url": self.url,
                "pid": self.pid, "server_pid": ep.get("server_pid"), "node_ip": ep.get("node_ip"),
                "node_id": ep.get("node_id"), "log_path": ep.get("log_path"), "bundle_of": self.shape}


class AppController:
    """The actor class (created by the driver, threaded: `status` and `events` answer while `start` or an
    autoscaling action runs)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = RayAppSpec.from_json(spec)
        self.node_ip = ray.util.get_node_ip_address()
        self._lock = threading.RLock()
        self.slots: dict[int, Slot] = {}
        self._next_index = 0
        self.proxy: Any = None
        self.proxy_info: dict[str, Any] = {}
        self.record = AutoscaleRecord(Path(self.spec.log_dir) / f"{self.spec.app}-autoscaler.log")
        self.scaling = AutoscaleConfig.from_json(self.spec.autoscale).validate() if self.spec.autoscale else None
        if self.scaling is not None and self.scaling.allow_role_switch and not self._switchable():
            self.scaling.allow_role_switch = False
            self.record.event("no_role_switch", "role switches are off: prefill and decode instances reserve "
                              f"different CPUs/GPUs ({self._shapes()})")
        self.autoscaler = Autoscaler(self.scaling) if self.scaling else None
        self.window = SignalWindow(self.scaling.window_s) if self.scaling else None
        self._last_tick: Tick | None = None
        self._busy = threading.Event()  # an autoscaling action runs
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self._action: threading.Thread | None = None
        self._http: Any = None
        self.metrics_url: str | None = None
        self._client = httpx.Client(timeout=2.0, trust_env=False)

    # -- placement and instances -------------------------------------------------------------------------

    def _new_index(self) -> int:
        with self._lock:
            index = self._next_index
            self._next_index += 1
            return index

    def _reserve(self, templates: list[InstanceSpec]) -> list[PlacementGroup]:
        """One placement group per instance, all ready within the placement timeout (or none kept)."""
        pgs = [placement_group([t.bundle()], strategy="PACK") for t in templates]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=self.spec.placement_timeout)
        except ray.exceptions.GetTimeoutError:
            for pg in pgs:
                remove_placement_group(pg)
            wanted = [t.bundle() for t in templates]
            raise PlacementError(
                f"cannot reserve {wanted} within {self.spec.placement_timeout:g}s; the cluster has "
                f"{_resources(ray.available_resources())} available of {_resources(ray.cluster_resources())} "
                "(add nodes, or lower --cpus-per-instance/--gpus-per-instance/the role resources)"
            ) from None
        return pgs

    def _shapes(self) -> str:
        return ", ".join(f"{r}: {{CPU: {t.num_cpus:g}, GPU: {t.num_gpus:g}}}" for r, t in self.spec.templates.items())

    def _switchable(self) -> bool:
        """Whether an instance of one role fits the bundle of the other (the same CPUs and GPUs)."""
        shapes = {(t.num_cpus, t.num_gpus) for r, t in self.spec.templates.items() if r in SCALED_ROLES}
        return len(shapes) == 1

    def _launch(self, index: int, role: str, pg: PlacementGroup, shape: str | None = None) -> Slot:
        """An instance of `role` in `pg`, asking for what `pg`'s bundle holds: the template of `shape`
        (default: `role`'s own, for a bundle reserved for it)."""
        template = self.spec.templates[role]
        shape = shape or role
        fits = self.spec.templates[shape]
        name = instance_name(self.spec.app, index)
        actor = InstanceActor.options(
            name=name, namespace=self.spec.namespace, max_restarts=self.spec.max_restarts, max_concurrency=8,
            num_cpus=fits.num_cpus, num_gpus=fits.num_gpus, resources=fits.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(name, asdict(template))
        slot = Slot(index, name, role, pg, actor, shape)
        with self._lock:
            self.slots[index] = slot
        return slot

    def _await_ready(self, slot: Slot) -> None:
        """Blocks until the slot's server is healthy; raises with the reason (and its log tail) otherwise."""
        timeout = self.spec.templates[slot.role].startup_timeout
        try:
            ep = ray.get(slot.actor.wait_ready.remote(timeout), timeout=timeout + 30)
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(str(e.cause) if e.cause is not None else str(e)) from None
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"{slot.name} ({slot.role}): {type(e).__name__}: {e}") from None
        self._note(slot, ep)
        self.record.event("ready", f"{slot.name} {slot.role} ready at {slot.url} on node {ep['node_ip']} "
                          f"[{ep['node_id'][:12]}]", instance=slot.to_json())

    def _retire(self, slot: Slot, *, keep_pg: bool = False) -> None:
        """Stop the server, kill the actor for good, free its placement group (unless it is reused)."""
        try:
            ray.get(slot.actor.stop.remote(), timeout=self.spec.templates[slot.role].stop_timeout + 20)
        except ray.exceptions.RayError as e:
            logger.warning("stopping %s: %s (killing its actor)", slot.name, e)
        ray.kill(slot.actor, no_restart=True)  # its server gets SIGKILL too if still there (PDEATHSIG)
        if not keep_pg:
            remove_placement_group(slot.pg)
        with self._lock:
            self.slots.pop(slot.index, None)

    def _note(self, slot: Slot, ep: dict[str, Any] | None) -> None:
        """Update a slot from the actor's endpoint() answer (None: no answer), reporting restarts."""
        if ep is None:
            slot.state = "unavailable"
            return
        if slot.pid is not None and ep["pid"] != slot.pid:
            self.record.event("restarted", f"{slot.name} {slot.role} restarted by Ray: actor pid {slot.pid} -> "
                              f"{ep['pid']}, now at {ep['url']} on node {ep['node_ip']} ({ep['state']})",
                              instance=ep)
        slot.pid, slot.url, slot.state, slot.endpoint = ep["pid"], ep["url"], ep["state"], ep

    # -- start, status, shutdown ---------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Place and start the topology, then the proxy; returns status() once the proxy answers /health."""
        templates = self.spec.instances
        pgs = self._reserve(templates)
        slots = [self._launch(self._new_index(), t.role, pg) for t, pg in zip(templates, pgs, strict=True)]
        errors = []
        for slot in slots:
            try:
                self._await_ready(slot)
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("\n".join(errors))
        self._start_proxy()
        self._watch = threading.Thread(target=self._watch_loop, name="pdserve-controller", daemon=True)
        self._watch.start()
        self._start_http()
        return self.status()

    def _start_proxy(self) -> None:
        urls = {r: [s.url for s in self.slots.values() if s.role == r] for r in ("prefill", "decode", "collocated")}
        config = {**self.spec.proxy, "prefill": urls["prefill"], "decode": urls["decode"] + urls["collocated"]}
        self.proxy = ProxyActor.options(
            name=proxy_name(self.spec.app), namespace=self.spec.namespace, max_restarts=self.spec.max_restarts,
            max_concurrency=4, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.spec.proxy_node_id, soft=False),
        ).remote(config, self.spec.namespace, instance_prefix(self.spec.app), self.spec.discovery_interval)
        try:
            self.proxy_info = ray.get(self.proxy.info.remote(), timeout=PROXY_READY_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
            raise RuntimeError(f"the proxy did not start: {cause}") from None
        wanted = {u for role_urls in urls.values() for u in role_urls}
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        admitted: set[str] = set()
        while time.monotonic() < deadline:  # every instance admitted by the proxy's health checks
            try:
                listing = ray.get(self.proxy.listing.remote(), timeout=CALL_TIMEOUT_S)
                admitted = {i["url"] for insts in listing.values() for i in insts if i["healthy"]}
                if wanted <= admitted:
                    return
            except ray.exceptions.RayError as e:
                logger.warning("proxy listing: %s", e)
            time.sleep(0.2)
        raise RuntimeError(f"the proxy at {self.proxy_info['url']} did not admit {sorted(wanted - admitted)} within "
                           f"{PROXY_READY_TIMEOUT_S:g}s")

    def _start_http(self) -> None:
        """On the controller's node: GET /metrics (Prometheus), GET /pdserve/autoscaler (the policy's last
        numbers and recent decisions, JSON), GET /pdserve/app (status(): instances, nodes, pids, URLs)."""
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app

        metrics = make_wsgi_app(self.record.registry)

        def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
            path = environ.get("PATH_INFO")
            if path in ("/pdserve/autoscaler", "/pdserve/app"):
                data = self.autoscaler_state() if path == "/pdserve/autoscaler" else self.status()
                start_response("200 OK", [("Content-Type", "application/json")])
                return [json.dumps(data).encode()]
            return metrics(environ, start_response)

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

        self._http = make_server(self.node_ip, 0, app, handler_class=Quiet)
        self.metrics_url = f"http://{self.node_ip}:{self._http.server_port}"
        threading.Thread(target=self._http.serve_forever, name="pdserve-controller-http", daemon=True).start()

    def status(self) -> dict[str, Any]:
        with self._lock:
            slots = sorted(self.slots.values(), key=lambda s: s.index)
            return {"app": self.spec.app, "namespace": self.spec.namespace, "model": self.spec.model,
                    "controller_pid": os.getpid(),
                    "topology": self.spec.topology, "proxy": self.proxy_info,
                    "instances": [s.to_json() for s in slots], "metrics_url": self.metrics_url,
                    "autoscale": self.scaling.to_json() if self.scaling else None}

    def autoscaler_state(self) -> dict[str, Any]:
        views = self.autoscaler.last_views if self.autoscaler else {}
        return {"enabled": self.scaling is not None, "busy": self._busy.is_set(),
                "roles": {r: v.to_json() for r, v in views.items()}, "recent": self.record.since(0)[-50:]}

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return self.record.since(since)

    def shutdown(self) -> None:
        """Stop everything this app started: the proxy first (clients get refusals, not errors mid-request),
        then every instance (SIGTERM, bounded wait, SIGKILL), then the placement groups."""
        self._stopping.set()
        if self._action is not None:
            self._action.join(timeout=5)
        if self._watch is not None:
            self._watch.join(timeout=5)
        if self._http is not None:
            self._http.shutdown()
        if self.proxy is not None:
            try:
                ray.get(self.proxy.stop.remote(), timeout=20)
            except ray.exceptions.RayError as e:
                logger.warning("stopping the proxy: %s", e)
            ray.kill(self.proxy, no_restart=True)
        with self._lock:
            slots = list(self.slots.values())
        refs = [s.actor.stop.remote() for s in slots]
        grace = max((t.stop_timeout for t in self.spec.templates.values()), default=15.0)
        ray.wait(refs, num_returns=len(refs), timeout=grace + 20)
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)
            remove_placement_group(slot.pg)
        with self._lock:
            self.slots.clear()
        self._client.close()

    # -- watching and autoscaling --------------------------------------------------------------------------

    def _refresh(self) -> None:
        with self._lock:
            slots = list(self.slots.values())
        refs = {s.index: s.actor.endpoint.remote() for s in slots}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=CALL_TIMEOUT_S) if refs else ([], [])
        done = set(ready)
        for slot in slots:
            ref = refs[slot.index]
            ep = None
            if ref in done:
                try:
                    ep = ray.get(ref)
                except ray.exceptions.RayError:
                    ep = None
            self._note(slot, ep)

    def _watch_loop(self) -> None:
        interval = self.scaling.interval_s if self.scaling else WATCH_INTERVAL_S
        while not self._stopping.wait(interval):
            try:
                self._refresh()
                if self.scaling is not None:
                    self._autoscale_tick()
            except Exception:  # a bug or a transient Ray error must not end supervision
                logger.exception("controller round failed")

    def _measure(self) -> Tick:
        with self._lock:
            slots = [s for s in self.slots.values() if s.url and s.state in ("serving", "draining")]
        samples: dict[str, InstanceSample | None] = {}
        for slot in slots:
            try:
                r = self._client.get(slot.url + "/metrics")
                samples[slot.url] = parse_instance_metrics(r.text) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                samples[slot.url] = None
        in_flight: dict[str, int] = {}
        try:
            listing = ray.get(self.proxy.listing.remote(), timeout=CALL_TIMEOUT_S)
            for insts in listing.values():
                for inst in insts:
                    in_flight[inst["url"]] = in_flight.get(inst["url"], 0) + int(inst["in_flight"])
        except ray.exceptions.RayError as e:
            logger.warning("proxy listing: %s", e)
        return Tick(time.monotonic(), samples, in_flight)

    def _autoscale_tick(self) -> None:
        assert self.scaling is not None and self.autoscaler is not None and self.window is not None
        tick = self._measure()
        self.window.add(tick)
        self._last_tick = tick
        signals = {}
        with self._lock:
            for role in SCALED_ROLES:
                members = [s for s in self.slots.values() if s.role == role and s.state not in
                           ("draining", "stopping", "stopped")]
                urls = [s.url for s in members if s.url and s.state == "serving"]
                signals[role] = self.window.signals(role, urls, len(members), self.scaling.quantile)
        if self._busy.is_set():
            self.autoscaler.reset()  # decide on numbers measured after the running action, not before
            self.record.observe(self.autoscaler.last_views)
            return
        decision = self.autoscaler.step(tick.t, signals)
        self.record.observe(self.autoscaler.last_views)
        if decision is None:
            return
        self.record.decision(decision)
        self._busy.set()
        self._action = threading.Thread(target=self._act, args=(decision,), name="pdserve-autoscale", daemon=True)
        self._action.start()

    def _act(self, d: Decision) -> None:
        t0 = time.monotonic()
        try:
            if d.action == "scale_up":
                slot = self._scale_up(d.role)
                self.record.event("done", f"added {slot.name} ({d.role}) at {slot.url} in {time.monotonic() - t0:.1f}s",
                                  action=d.action, role=d.role, instance=slot.to_json())
            elif d.action == "scale_down":
                name = self._scale_down(d.role)
                self.record.event("done", f"removed {name} ({d.role}) in {time.monotonic() - t0:.1f}s",
                                  action=d.action, role=d.role)
            else:
                assert d.from_role is not None
                slot = self._switch(d.from_role, d.role)
                self.record.event("done", f"switched a {d.from_role} replica to {d.role}: {slot.name} at {slot.url} "
                                  f"in {time.monotonic() - t0:.1f}s", action=d.action, role=d.role,
                                  instance=slot.to_json())
        except Exception as e:  # the decision failed: say why; the next one is made on fresh numbers
            self.record.event("failed", f"{d.action} {d.role}: {e}", action=d.action, role=d.role)
        finally:
            self._busy.clear()

    def _scale_up(self, role: str) -> Slot:
        (pg,) = self._reserve([self.spec.templates[role]])
        return self._launch_ready(role, pg)

    def _launch_ready(self, role: str, pg: PlacementGroup, shape: str | None = None) -> Slot:
        """A new replica of `role` on `pg`, once it serves (retired again when it never gets there)."""
        slot = self._launch(self._new_index(), role, pg, shape=shape)
        try:
            self._await_ready(slot)
        except Exception:
            self._retire(slot)
            raise
        return slot

    def _victim(self, role: str) -> Slot:
        """The least busy serving replica of `role` (the newest on ties)."""
        with self._lock:
            candidates = [s for s in self.slots.values() if s.role == role and s.state == "serving"]
        if not candidates:
            raise RuntimeError(f"no serving {role} replica to take")
        tick = self._last_tick

        def load(s: Slot) -> tuple[float, int]:
            sample = tick.samples.get(s.url) if tick is not None and s.url else None
            busy = (sample.running + sample.waiting + sample.held) if sample is not None else 0.0
            return (busy, -s.index)

        return min(candidates, key=load)

    def _drain(self, slot: Slot) -> None:
        """Take `slot` out of the proxy's pools now, then wait (bounded) until its engine is idle: nothing
        running or queued, and (prefill) no KV held for a decode instance that has not read it yet."""
        assert self.scaling is not None
        self._note(slot, ray.get(slot.actor.drain.remote(), timeout=CALL_TIMEOUT_S))
        ray.get(self.proxy.sync.remote(), timeout=CALL_TIMEOUT_S * 2)  # one discovery round now
        deadline = time.monotonic() + self.scaling.drain_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            try:
                r = self._client.get(f"{slot.url}/metrics")
                if r.status_code == 200 and parse_instance_metrics(r.text).idle:
                    return
            except (httpx.HTTPError, ValueError):
                return  # not answering: nothing left to drain
            time.sleep(0.5)
        self.record.event("drain_timeout", f"{slot.name} still busy after {self.scaling.drain_timeout_s:g}s: "
                          "stopping it anyway (its requests in flight end with an error)")

    def _scale_down(self, role: str) -> str:
        slot = self._victim(role)
        self._drain(slot)
        self._retire(slot)
        return slot.name

    def _switch(self, from_role: str, to_role: str) -> Slot:
        old = self._victim(from_role)
        self._drain(old)
        self._retire(old, keep_pg=True)
        return self._launch_ready(to_role, old.pg, shape=old.shape)


def _resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith("node:") and "_group_" not in k  # (placement groups')
            and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
