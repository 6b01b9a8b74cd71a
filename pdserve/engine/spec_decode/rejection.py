"""The acceptance rule for drafted tokens (vLLM's vllm/v1/sample/rejection_sampler.py, for drafts without
a draft distribution, as ngram's are: one-hot on the draft token).

For a request with drafts d_1..d_k the verify step gives k + 1 target distributions p_0..p_k (p_j: after
the request's tokens and d_1..d_j). Position by position:
- greedy: d_j+1 is accepted while it is argmax p_j; the first mismatch emits argmax p_j instead;
- random: d_j+1 is accepted with probability p_j(d_j+1); a rejection emits a draw from the residual
  max(p_j - onehot(d_j+1), 0), normalized, i.e. p_j without d_j+1.
When every draft is accepted, one more token (the bonus) is drawn from p_k. Each emitted token then has
exactly the target's distribution: P(t) = p(d) [t = d] + (1 - p(d)) p(t) / (1 - p(d)) [t != d] = p(t).

Every per-position adjustment the plain sampler makes (penalties over the output so far, the min_tokens ban,
logit_bias, allowed_token_ids, temperature, top-k/p, min-p) is made at each position as if the drafts
before it were already output (`_Ahead`). Logprobs are those of the raw logits at the emitted token's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import Sampler
from pdserve.types.outputs import TokenLogprob


class _Ahead:
    """A request as the sampler sees it at a later position: its drafts so far taken as output."""

    __slots__ = ("request_id", "params", "prompt_token_ids", "output_token_ids", "eos_token_ids", "grammar")

    def __init__(self, req: Request, drafts: list[int]):
        self.request_id = req.request_id
        self.params = req.params
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = req.output_token_ids + drafts
        self.eos_token_ids = req.eos_token_ids
        self.grammar = None  # requests with a grammar get no drafts (engine.spec_decode.decoder)


@dataclass
class Verified:
    req: Request
    token_ids: list[int]  # accepted drafts, then the target's own token: 1..k+1 tokens
    logprobs: list[TokenLogprob | None]
    num_draft_tokens: int
    num_accepted: int  # drafts accepted (token_ids[:num_accepted] are drafts)


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list[Request],
           raw_argmax: list[int] | None = None) -> list[Verified]:
    """logits: [sum over reqs of len(spec_token_ids) + 1, vocab], rows in `reqs` order (spec_decode.rows).
    raw_argmax: the argmax of each row of `logits`, already on the host (a verify CUDA graph computes it);
    used where no adjustment applies, saving the device argmax and its copy."""
    raw = logits.float()
    views: list = []
    for req in reqs:
        drafts = req.spec_token_ids
        views.extend([req] + [_Ahead(req, drafts[:j]) for j in range(1, len(drafts) + 1)])
    adjusted = Sampler.adjust(raw, views)
    if raw_argmax is not None and adjusted is raw:
        assert len(raw_argmax) == raw.shape[0]
        argmax = raw_argmax
    else:
        argmax = adjusted.argmax(dim=-1).tolist()
    random_rows = not all(r.params.greedy for r in reqs)
    if random_rows:
        accept_p, uniform, resampled = _random_draws(sampler, adjusted, reqs, views)
    out: list[Verified] = []
    row = 0
    for req in reqs:
        drafts = req.spec_token_ids
        greedy = req.params.greedy
        tokens: list[int] = []
        for j, d in enumerate(drafts):
            r = row + j
            if argmax[r] == d if greedy else accept_p[r] > uniform[r]:
                tokens.append(d)
                continue
            tokens.append(argmax[r] if greedy else resampled[r])
            break
        else:
            r = row + len(drafts)
            tokens.append(argmax[r] if greedy else resampled[r])
        accepted = len(tokens) - 1
        out.append(Verified(req, tokens, [None] * len(tokens), len(drafts), accepted))
        row += len(drafts) + 1
    if any(r.params.logprobs is not None for r in reqs):
        _fill_logprobs(raw, views, out)
    return out


def _random_draws(sampler: Sampler, adjusted: torch.Tensor, reqs: list[Request],
                  views: list) -> tuple[list[float], list[float], list[int]]:
    """Per row: the target probability of the row's draft (0 past the last draft), a uniform draw, and a
    draw from the residual (the target without the draft; the bonus row: the target itself). Seeded
    requests draw from their own generator, so they repeat whatever else is batched with them."""
    dev = adjusted.device
    probs = Sampler.probs(adjusted, views)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # top-p / min-p leave the kept mass unnormalized
    draft_rows: list[int] = []
    draft_ids: list[int] = []
    row = 0
    for req in reqs:
        for j, d in enumerate(req.spec_token_ids):
            draft_rows.append(row + j)
            draft_ids.append(d)
        row += len(req.spec_token_ids) + 1
    accept = torch.zeros(probs.shape[0], device=dev)
    residual = probs
    if draft_rows:
        r = torch.tensor(draft_rows, device=dev)
        c = torch.tensor(draft_ids, device=dev)
        accept[r] = probs[r, c]
        residual = probs.clone()
        residual[r, c] = 0.0
    noise = torch.empty_like(probs).exponential_(generator=sampler._default_generator(dev))
    uniform = torch.rand(probs.shape[0], device=dev, generator=sampler._default_generator(dev))
    row = 0
    for req in reqs:
        n = len(req.spec_token_ids) + 1
        if req.params.seed is not None and not req.params.greedy:
            gen = sampler._generator(req, dev)
            noise[row : row + n].exponential_(generator=gen)
            if n > 1:  # none for a row without drafts: it then draws exactly what a plain step draws
                uniform[row : row + n - 1] = torch.rand(n - 1, device=dev, generator=gen)
        row += n
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    resampled = (residual / noise).argmax(dim=-1)
    host = torch.stack([accept, uniform, resampled.to(accept.dtype)]).tolist()  # one device->host copy
    return host[0], host[1], [int(t) for t in host[2]]


def _fill_logprobs(raw: torch.Tensor, views: list, verified: list[Verified]) -> None:
    """The raw logits' logprobs of each emitted token, at its own row (as the plain sampler reports them)."""
    rows: list[int] = []
    chosen: list[int] = []
    where: list[tuple[Verified, int]] = []
    row = 0
    for v in verified:
        if v.req.params.logprobs is not None:
            for j, t in enumerate(v.token_ids):
                rows.append(row + j)
                chosen.append(t)
                where.append((v, j))
        row += v.num_draft_tokens + 1
    sub = raw[torch.tensor(rows, device=raw.device)]
    picked = torch.tensor(chosen, device=raw.device)
    _, lps = Sampler._with_logprobs(sub, picked, [views[r] for r in rows], list(range(len(rows))))
    for (v, j), lp in zip(where, lps, strict=True):
        v.logprobs[j] = lp
