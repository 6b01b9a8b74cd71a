"""One client request as each of its legs meets its instances, derived once where the request is read
(`request.read_request`): its id and the headers every leg sends (`Upstream`), and the instances its legs are on
now, so that an abort (`POST /inference/v1/abort_requests`, app.py) reaches them (`InFlight`).

The id is the client's `X-Request-Id`, else a generate body's `request_id`, else a fresh one: an instance names
a generate request `generate-tokens-{X-Request-Id or request_id}` (vLLM's `ServingTokens`), so through the proxy the
request keeps the id a single instance would give it, and a client aborts it by that id. Every leg carries it as its
`X-Request-Id`; a leg's functions take the `Upstream`, never read the id back out of the headers.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.api.scale_out_routes import GENERATE_ID_PREFIX
from pdserve.proxy.errors import error_response
from pdserve.proxy.pool import Instance

# An aborted request that no instance answered: nginx's "client closed request", as pdserve's server answers a
# request whose client left (pdserve.api.http.CLIENT_CLOSED; not imported here: starlette)
ABORTED_STATUS = 499


@dataclass(eq=False)
class _Legs:
    """Where one client request's legs are (shared by its prompts' pairs when a batch is split)."""

    on: Counter[Instance] = field(default_factory=Counter)  # instance -> its legs in flight there
    aborted: bool = False  # the client asked for an abort: no leg is retried or sent after it


@dataclass(eq=False)
class Upstream:
    rid: str
    headers: dict[str, str]  # what every leg sends: X-Request-Id (= rid), Content-Type, Authorization
    legs: _Legs = field(default_factory=_Legs)

    @classmethod
    def of(cls, rid: str, auth: str | None) -> Upstream:
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        if auth is not None:
            headers["Authorization"] = auth
        return cls(rid, headers)

    def prompt(self, k: int) -> Upstream:
        """Prompt k of a split batch: its own id (`{rid}-{k}`), the same auth and the same legs' record."""
        rid = f"{self.rid}-{k}"
        return Upstream(rid, {**self.headers, "X-Request-Id": rid}, self.legs)

    def hold(self, inst: Instance, tokens: int) -> None:
        """A leg of this request goes to `inst` (counted in its load until `release`)."""
        inst.acquire(tokens)
        self.legs.on[inst] += 1

    def release(self, inst: Instance, tokens: int) -> None:
        inst.release(tokens)
        self.legs.on[inst] -= 1
        if self.legs.on[inst] <= 0:
            del self.legs.on[inst]

    @property
    def instances(self) -> list[Instance]:
        """The instances this request's legs are on now."""
        return list(self.legs.on)

    @property
    def aborted(self) -> bool:
        return self.legs.aborted

    def aborted_response(self, status: int = 0, content_type: str = "application/json", data: bytes = b""
                         ) -> web.Response:
        """What the client gets for a request it aborted: the instance's answer when one came (a generate leg
        answers 200 with finish_reason "abort"), else a 499 saying so."""
        if status:
            return web.Response(status=status, body=data, headers={"Content-Type": content_type,
                                                                   "X-Request-Id": self.rid})
        return error_response(ABORTED_STATUS, f"request {self.rid} was aborted (abort_requests)", "RequestAborted",
                              request_id=self.rid)


def request_id(header: str | None, api_path: str, body: dict[str, Any], generate_path: str) -> str:
    """The request's one id (module docstring)."""
    if header:
        return header
    rid = body.get("request_id") if api_path == generate_path else None
    return rid if isinstance(rid, str) and rid else uuid.uuid4().hex


class InFlight:
    """The requests whose legs an abort can reach (the tokens-only route's), by id."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[Upstream]] = {}

    @contextmanager
    def track(self, up: Upstream) -> Iterator[None]:
        self._by_id.setdefault(up.rid, []).append(up)
        try:
            yield
        finally:
            ups = self._by_id[up.rid]
            ups.remove(up)
            if not ups:
                del self._by_id[up.rid]

    def find(self, request_id: str) -> list[Upstream]:
        """The requests a client's id names: as the instances answer it (`generate-tokens-{id}`) or bare."""
        bare = request_id.removeprefix(GENERATE_ID_PREFIX)
        return list(self._by_id.get(request_id) or self._by_id.get(bare) or ())

    def abort(self, request_id: str) -> list[Upstream]:
        """The requests `request_id` names, marked aborted (no leg of theirs is retried or sent from now on)."""
        found = self.find(request_id)
        for up in found:
            up.legs.aborted = True
        return found
