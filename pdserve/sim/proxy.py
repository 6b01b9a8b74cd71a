"""The proxy of a simulated deployment: `pdserve proxy`'s own request path up to the legs, on the simulated fleet.

Each request is read by the proxy's `client_request` (its prompt's cached prefix on every instance, from the fleet
index, when instances publish KV events), planned by `plan.decide` (Local / Pair, the prefill instance first,
then push or the early decode leg, and the multi-turn history decision of `turn_history.history_for`), and its
legs' instances come from the same `PairChooser` calls the legs make (legs.send_decode, push_pair). What is not
the proxy's code is I/O: the HTTP legs (the cluster times them from the profile), the KV event subscription
(`SimFleet`: an instance's events reach the index when the step that made them ends) and the health checker
(every instance is admitted; /pdserve/info is what a pdserve instance of the simulated mode answers).

The request body is a completions body: the prompt as token ids when the proxy reads them (to route by cached
prefix: it hashes them as the instances do; with --kv-history: it keys conversations by their content), else as
text of the same length by the proxy's estimate (characters / 4), so that a proxy that does not read the ids
does not scan a 28k-token id list per request. A trace row's ids are unknown: it always goes as text (routed by
load), as a request to a proxy without a tokenizer would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdserve.api.pd import PULL, PUSH
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.conversations import ConversationHistory
from pdserve.proxy.history_decision import RecomputeInfo
from pdserve.proxy.kv_fleet import KVFleet
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pairing import PairChooser
from pdserve.proxy.plan import Local, Pair, Plan, decide
from pdserve.proxy.pool import Instance, Pool
from pdserve.proxy.prompt_tokens import PromptTokenizer
from pdserve.proxy.protocol import CHARS_PER_TOKEN
from pdserve.proxy.request import COMPLETIONS, ClientRequest, client_request
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Upstream
from pdserve.sim.workload import Job

_TEXT: dict[int, str] = {}  # prompt length -> a text prompt the proxy estimates at that many tokens


def text_prompt(tokens: int) -> str:
    """A prompt of `tokens` tokens by the proxy's estimate (proxy/protocol.py: characters // 4 + 1)."""
    text = _TEXT.get(tokens)
    if text is None:
        text = _TEXT[tokens] = "x" * (CHARS_PER_TOKEN * max(tokens - 1, 0))
    return text


class SimFleet(KVFleet):
    """The proxy's fleet index (KVIndex) with every simulated instance of `block_sizes` publishing into it; the
    subscriptions' I/O (ZMQ, replay, snapshots) is not simulated: `publish` applies a step's events at once."""

    def __init__(self, block_sizes: dict[str, int]) -> None:
        super().__init__(lambda: [], _no_session, info_timeout=1.0)
        self._sizes = block_sizes

    def publishing(self, url: str) -> bool:
        return url in self._sizes

    def pins(self, url: str) -> bool:
        return False  # peer pins (peer_pull.py) are not simulated

    def block_size(self, url: str) -> int | None:
        return self._sizes.get(url)

    def any_publishing(self, instances: list[Instance]) -> bool:
        return any(inst.url in self._sizes for inst in instances)

    def publishers(self) -> int:
        return len(self._sizes)


def _no_session() -> Any:
    raise RuntimeError("the simulated fleet has no HTTP session")


@dataclasses.dataclass
class SimRequest:
    """One client request as the proxy read and planned it."""

    body: dict[str, Any]
    req: ClientRequest
    plan: Plan


class SimProxy:
    """A ProxyState over the simulated pools, driven synchronously (`run_now`): every instance is healthy, so
    the proxy's coroutines never wait."""

    def __init__(self, config: ProxyConfig, prefill: Pool, decode: Pool, clock: Callable[[], float],
                 run_now: Callable[[Any], Any], publishers: dict[str, int]) -> None:
        self.run_now = run_now
        # built without the real fleet (its subscriptions are I/O), then given the simulated one
        state = ProxyState(dataclasses.replace(config, kv_routing=False), prefill, decode,
                           ProxyMetrics(lambda: [prefill, decode]))
        state.config = config
        state.history = ConversationHistory(config.kv_history_max_entries, clock=clock)  # leases: simulated time
        if config.kv_routing and publishers:
            state.fleet = SimFleet(publishers)
            state.prompt_tokenizer = PromptTokenizer(config.tokenizer, config.health_timeout)
            state.metrics.register_kv(state.fleet)
            state.pairing = PairChooser(config, prefill, decode, state.metrics, state.readiness, lambda: None,
                                        state.fleet)
        self.state = state
        # the prompt's ids: to route by cached prefix (the proxy hashes them), and to key conversations (--kv-history:
        # conversations.py keys a prompt by its content)
        self._ids = state.fleet is not None or config.kv_history
        self._seq = 0

    @staticmethod
    def learn(inst: Instance, role: str, mode: str) -> None:
        """What the health checker reads from a pdserve instance's /pdserve/info on admission
        (instance_info.apply_info): a pdserve instance of this transfer mode; a decode instance takes its leg
        before the params (kv_params_later); a prefill instance advertises no measured prefill cost (a CPU
        instance's info has none), so the history decision prices recompute at --kv-history-prefill-tps. The
        prefill's kv_recompute_threshold is the engine's own (the simulated instance's KV connector config)."""
        inst.pdserve = True
        inst.transfer_mode = mode if mode in (PULL, PUSH) else None
        inst.params_later = role == "decode"
        inst.recompute = RecomputeInfo() if role == "prefill" else None

    def read(self, job: Job) -> SimRequest:
        """The client's request, read and planned by the proxy."""
        ids = job.token_ids if self._ids and job.token_ids is not None else None
        body: dict[str, Any] = {"prompt": ids if ids is not None else text_prompt(job.prompt_len),
                                "max_tokens": job.output_len}
        self._seq += 1
        up = Upstream.of(f"sim-{job.index}-{self._seq}", auth=None)
        req = self.run_now(client_request(self.state, COMPLETIONS, body, b"", up))
        return SimRequest(body, req, self.run_now(decide(self.state, req)))

    # the legs' own choices, as they make them
    def local_instance(self, sreq: SimRequest) -> Instance:
        """legs.relay_decode -> send_decode: the instance that serves the request whole."""
        plan = sreq.plan
        assert isinstance(plan, Local)
        return self.run_now(self.state.pairing.decode(wait=True, prefix=sreq.req.prefix, computes_prompt=True,
                                                      role=plan.role))

    def pair_decode(self, prefill: Instance) -> Instance:
        """push_pair.start_push_pair, or pull_pair's decode leg after the prefill answered (no early leg): a
        decode instance that pairs with the prefill."""
        return self.run_now(self.state.pairing.decode(wait=True, pair_with=prefill))

    def remember(self, sreq: SimRequest, params: dict[str, Any], decode_url: str, prompt_tokens: int) -> None:
        """turn_history.keep_history's `remember`: the decode answer's held history under the conversation."""
        state = self.state
        if state.history.remember(sreq.req.api_path, sreq.body, params, decode_url, prompt_tokens):
            state.metrics.kv_history["remembered"].inc()

    @staticmethod
    def work(sreq: SimRequest, inst: Instance, tokens: int) -> int:
        """A leg's load as the proxy counts it: its tokens less what the instance caches (legs.py)."""
        prefix = sreq.req.prefix
        return tokens if prefix is None else tokens - prefix.cached_tokens(inst)


__all__ = ["Pair", "SimFleet", "SimProxy", "SimRequest", "text_prompt"]
