"""One push pair's WRITEs as the push connector posts them (ARCHITECTURE.md, "Push transfer"), in tokens of the
prompt: which range goes on the link when.

- The decode instance allocates the prompt's blocks on admission and registers the ones its own prefix cache lacks
  (`[registered_from, load_tokens)`: the whole prompt, since it adopts the prefill's first token); the
  registration reaches the prefill a side-channel hop later (the cluster: `handoff.claim_s`).
- Layer by layer (`push_layer_by_layer`, prompts of at least `push_layerwise_min_tokens`): each chunk's KV is
  written while the chunk is computed, so its WRITE is posted when the chunk's step starts (the prefill's own
  cache hit goes with the first chunk); a registration that arrives late catches up at once with everything
  computed so far. Not modelled: the last layer's WRITE after the last step (1/num_layers of the last chunk).
- Whole request: one WRITE of the registered range once the prefill finished (and the registration arrived).
- The push completes when the prefill finished and every WRITE posted has landed (the completion notification:
  its own latency is not modelled); the prefill's blocks are then freed and the decode adopts the first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class PushTransfer:
    load_tokens: int  # the prompt tokens whose KV the decode registers up to
    layerwise: bool
    post: Callable[[PushTransfer, int], None]  # (self, tokens): a WRITE of that many tokens' KV goes out now
    complete: Callable[[PushTransfer], None]
    pair: Any = None  # the cluster's (prefill, its request, decode, its request, client)
    registered_from: int | None = None  # the decode's first token it lacks, once its registration arrived
    computed: int = 0  # the prefill's tokens whose KV exists (its cache hit and the chunks under way)
    queued: int = 0  # tokens up to which WRITEs were posted
    prefill_done: bool = False
    in_flight: int = 0
    done: bool = False

    def _post_upto(self, upto: int) -> None:
        start = max(self.queued, self.registered_from or 0)
        upto = min(upto, self.load_tokens)
        if upto > start:
            self.in_flight += 1
            self.queued = upto
            self.post(self, upto - start)
        else:
            self.queued = max(self.queued, upto)

    def chunk(self, computed_before: int, tokens: int) -> None:
        """The prefill's step computing `tokens` after `computed_before` starts."""
        self.computed = computed_before + tokens
        if self.layerwise and self.registered_from is not None:
            self._post_upto(self.computed)

    def registered(self, decode_cached: int) -> None:
        self.registered_from = decode_cached
        self.queued = max(self.queued, decode_cached)
        if self.layerwise:
            self._post_upto(self.computed)
        elif self.prefill_done:
            self._post_upto(self.load_tokens)
        self._check()

    def prefill_finished(self) -> None:
        self.prefill_done = True
        self.computed = max(self.computed, self.load_tokens)
        if self.registered_from is not None:
            self._post_upto(self.load_tokens)
        self._check()

    def landed(self) -> None:
        self.in_flight -= 1
        self._check()

    def _check(self) -> None:
        if (not self.done and self.prefill_done and self.registered_from is not None and self.in_flight == 0
                and self.queued >= self.load_tokens):
            self.done = True
            self.complete(self)
