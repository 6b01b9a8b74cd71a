"""The instance registry under Ray is Ray itself: the app's named actors, as the GCS lists them.

`list_members` is the proxy's discovery source (pdserve/proxy/discovery.py): it lists the named actors
whose name starts with the app's instance prefix and asks each for its `endpoint()` (role, URL, state).
An actor that does not answer within `timeout` (Ray is restarting it: calls fail with
ActorUnavailableError; or it is busy) is reported with `url=None`, which the reconciler tolerates for a
round or two. No dashboard or state API is needed: named actors and actor calls go through the GCS.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from pdserve.proxy.discovery import Member

logger = logging.getLogger("pdserve.ray")


def named_actors(namespace: str, prefix: str) -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == namespace and a.get("name", "").startswith(prefix)
    )


def endpoints(namespace: str, names: list[str], timeout: float) -> dict[str, dict[str, Any] | None]:
    """name -> the actor's endpoint() answer, or None when it did not answer within `timeout`."""
    refs: dict[str, Any] = {}
    for name in names:
        try:
            refs[name] = ray.get_actor(name, namespace=namespace).endpoint.remote()
        except ValueError:  # gone between the listing and now
            continue
    out: dict[str, dict[str, Any] | None] = {name: None for name in refs}
    if not refs:
        return out
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    for name, ref in refs.items():
        if ref not in done:
            continue
        try:
            out[name] = ray.get(ref)
        except ray.exceptions.RayError as exc:  # restarting (ActorUnavailableError) or dead
            logger.debug("instance %s did not answer: %s", name, type(exc).__name__)
    return out


def list_members(namespace: str, prefix: str, timeout: float = 2.0) -> list[Member]:
    answers = endpoints(namespace, named_actors(namespace, prefix), timeout)
    members = []
    for name, ep in answers.items():
        if ep is None:
            members.append(Member(name=name, role="unknown", url=None, state="unknown"))
        else:
            members.append(Member(name=name, role=ep["role"], url=ep.get("url"), state=ep["state"]))
    return members
