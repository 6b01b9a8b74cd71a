"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, min_tokens, logprobs."""

from __future__ import annotations

import torch

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._default_gen = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self._default_gen
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: float32 [len(reqs), vocab] on any device. Sampling runs on the CPU in float32."""
        logits = logits.float().cpu()
        raw = logits
        masked = self._mask_early_stops(logits, reqs)
        tokens: list[int] = []
        if all(r.params.greedy for r in reqs):
            tokens = masked.argmax(dim=-1).tolist()
        else:
            greedy = masked.argmax(dim=-1).tolist()
            for i, req in enumerate(reqs):
                tokens.append(greedy[i] if req.params.greedy else self._sample_one(masked[i], req))
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            lps = torch.log_softmax(raw[want], dim=-1)
            for row, i in enumerate(want):
                logprobs[i] = _token_logprob(lps[row], tokens[i], reqs[i].params.logprobs or 0)
        return tokens, logprobs

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before min_tokens are out, neither EOS nor stop token ids may be sampled."""
        rows = [i for i, r in enumerate(reqs) if len(r.output_token_ids) < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            req = reqs[i]
            banned = set(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned |= req.eos_token_ids
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _sample_one(self, logits: torch.Tensor, req: Request) -> int:
        p = req.params
        x = logits / p.temperature
        if p.top_k and p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=0)
            # keep the smallest prefix whose mass reaches top_p (the crossing token included)
            drop_sorted = (cum - sorted_probs) >= p.top_p
            drop_sorted[0] = False
            probs = probs.clone()
            probs[order[drop_sorted]] = 0.0
        return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())


def _token_logprob(lp: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, idx = torch.topk(lp, top_n)
        top = list(zip(idx.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id=token, logprob=chosen, rank=rank, top=top)
