"""The engine's speculative decoding hooks: draft before the schedule, verify after the model run.

Which requests get drafts: running requests in their decode phase (every token but the last computed)
without a grammar (structured outputs decode one token at a time: their matcher would have to take and
roll back each draft), with room left under max_tokens / max_model_len for the drafts and the token after
them. While more requests than `disable_by_batch_size` run, nobody drafts (vLLM's rule: a saturated batch
is compute-bound, where verify rows cost as much as the tokens they save).

KV of drafts: the verify step writes K/V at every draft's position. Only the accepted drafts' positions
count as computed (`num_computed_tokens`); a rejected draft's slot lies past the frontier and is written
over by the next step that reaches it, in a block the request owns. Prefix-cache hashes cover computed
positions only (BlockManager.cache_full_blocks), so a block is never registered with a rejected draft in it.
"""

from __future__ import annotations

import numpy as np

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import Sampler
from pdserve.engine.spec_decode.draft import DraftModelProposer
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import propose_ngram
from pdserve.engine.spec_decode.rejection import Verified, verify
from pdserve.types.speculative_config import SpeculativeConfig


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None):
        self.config = config
        self.draft = draft  # None: ngram
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    def propose(self, running: list[Request]) -> None:
        """Sets every running request's `spec_token_ids` for the coming step ([] where it gets none)."""
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
        ks = [0 if off else self._num_drafts(req) for req in running]
        if self.draft is not None:
            for req in running:
                req.spec_token_ids = []
            self.draft.propose([r for r, k in zip(running, ks, strict=True) if k > 0], [k for k in ks if k > 0])
            return
        for req, k in zip(running, ks, strict=True):
            req.spec_token_ids = self._ngram(req, k) if k > 0 else []

    def _num_drafts(self, req: Request) -> int:
        if req.grammar is not None or req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids:
            return 0
        # the verify step emits up to k + 1 tokens: drafting past max_tokens (which max_model_len caps) is waste
        return max(0, min(self.config.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1))

    def _ngram(self, req: Request, k: int) -> list[int]:
        tokens = np.array(req.token_ids(), dtype=np.int64)
        return propose_ngram(tokens, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def verify(self, sampler: Sampler, logits, reqs: list[Request], raw_argmax: list[int] | None = None,
               ) -> list[Verified]:
        out = verify(sampler, logits, reqs, raw_argmax)
        for v in out:
            if v.num_draft_tokens:
                self.stats.observe_draft(v.num_draft_tokens, v.num_accepted)
                if self.draft is not None:
                    self.draft.on_verified(v.req, v.num_draft_tokens, v.num_accepted)
        return out
