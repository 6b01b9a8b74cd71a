"""Adopting the producer's sampled first token as a decode request's output 0, so that no model step here
recomputes the last prompt token for it. A pull decode leg adopts it at admission (the params carry it); a push
decode leg, whose params come before the prefill ran, adopts it when the push completes (the prefill sends it
with its completion notice, pdserve/kv_transfer/push_sender.py). Either way the first token and the KV of the
whole prompt come from the same prefill forward: recomputing the last prompt token here in the decode kernels
gives other bf16 roundings on a GPU, and greedy tokens then drift from a collocated run's."""

from __future__ import annotations

from pdserve.api import pd
from pdserve.engine.request import Request
from pdserve.types.outputs import TokenLogprob


def adopt_first_token(req: Request, first: pd.FirstToken, eos_token_ids: frozenset[int]) -> bool:
    """Take `first` as the request's output 0 (True). Declined (False: the request then recomputes the last
    prompt token, as for a vLLM producer) when this request's own parameters might not have produced it
    (min_tokens against a stop token the prefill leg, sent without min_tokens, may have drawn; logprobs the
    producer did not send; structured output, whose matcher would have to take it) or when it would end the
    request (then the KV is still loaded, so a refused lease is still the client's error)."""
    p = req.params
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    if req.grammar is not None or (p.min_tokens > 0 and first.token_id in stops):
        return False
    logprob = None
    if p.logprobs is not None:
        if first.logprob is None or first.rank is None or len(first.top) < p.logprobs:
            return False
        logprob = TokenLogprob(first.token_id, first.logprob, first.rank, list(first.top[: p.logprobs]))
    req.output_token_ids.append(first.token_id)
    if req.check_stop(first.token_id):  # would finish it: leave it to the recompute path
        req.output_token_ids.pop()
        req.finish_reason = req.stop_reason = None
        return False
    req.kv.first_token = first
    if logprob is not None:
        req.output_logprobs.append(logprob)
    return True
