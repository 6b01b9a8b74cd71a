"""Token sampling as batched tensor ops on the logits' device: greedy, temperature, top-k, top-p, min-p,
per-request seeds, min_tokens, logprobs.

Everything runs on the device that holds the logits (the GPU when serving on one), for all rows at
once; the host sees one small copy of the chosen ids (and of the logprobs, when asked for). A per-row
loop on the CPU cost ~6 ms per sampled request per step for a 128k vocabulary on the H200 host, more
than the 8B model's whole decode step.

Sampling draws by an exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is token i with
probability p_i / sum(p), so one batched `exponential_` and one argmax sample every row. Rows with a
seed draw their noise from their own generator, so a seeded request repeats whatever else is batched
with it.
"""

from __future__ import annotations

import torch

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._seed = seed
        self._default_gens: dict[torch.device, torch.Generator] = {}  # unseeded requests, per device
        self._generators: dict[str, torch.Generator] = {}  # seeded requests

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._default_gens.get(device)
        if gen is None:
            gen = self._default_gens[device] = torch.Generator(device=device).manual_seed(self._seed)
        return gen

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator(device=device).manual_seed(req.params.seed)
        return gen

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(reqs), vocab] on any device, any float dtype (computed in float32)."""
        raw = logits.float()
        masked = self._mask_early_stops(raw, reqs)
        if all(r.params.greedy for r in reqs):
            chosen = masked.argmax(dim=-1)
        else:
            chosen = self._sample(masked, reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not want:
            return chosen.tolist(), [None] * len(reqs)
        return self._with_logprobs(raw, chosen, reqs, want)

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before min_tokens are out, neither EOS nor stop token ids may be sampled."""
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[1]
        for i, req in enumerate(reqs):
            if len(req.output_token_ids) >= req.params.min_tokens:
                continue
            banned = set(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned |= req.eos_token_ids
            for t in banned:
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        dev = logits.device
        params = [r.params for r in reqs]
        greedy = [p.greedy for p in params]
        # Greedy rows go through the same ops with temperature 1 and take the argmax at the end.
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device=dev)
        x = logits / temps[:, None]
        vocab = x.shape[1]
        if any(0 < p.top_k < vocab for p in params):
            # the k-th largest value per row (k = vocab where unset); ties with it are kept
            ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
            top = torch.topk(x, int(ks.max()), dim=-1).values
            kth = top.gather(1, (ks - 1).clamp(max=top.shape[1] - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs = probs.masked_fill(probs < (min_p * probs.max(dim=-1).values)[:, None], 0.0)
        if any(p.top_p < 1.0 for p in params):
            # keep the smallest prefix (by probability) whose mass reaches top_p, the crossing token included
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p[:, None]
            drop[:, 0] = False
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        noise.exponential_(generator=self._default_generator(dev))
        for i in seeded:
            noise[i].exponential_(generator=self._generator(reqs[i], dev))
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a zero draw would make 0/0 = NaN win the argmax
        sampled = (probs / noise).argmax(dim=-1)
        if not any(greedy):
            return sampled
        return torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, chosen: torch.Tensor, reqs: list[Request],
                       want: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Logprobs of the raw logits (as vLLM reports them), the chosen token's rank, and the top n."""
        rows = torch.tensor(want, device=raw.device)
        lps = torch.log_softmax(raw[rows], dim=-1)
        picked = chosen[rows]
        chosen_lp = lps.gather(1, picked[:, None])
        ranks = (lps > chosen_lp).sum(dim=-1) + 1
        top_n = max(reqs[i].params.logprobs or 0 for i in want)
        top_vals, top_ids = torch.topk(lps, top_n, dim=-1) if top_n else (lps[:, :0], picked[:, None][:, :0])
        # one device->host copy for all of it
        host = torch.cat([chosen_lp, ranks[:, None].to(lps.dtype), top_vals, top_ids.to(lps.dtype)], dim=1).tolist()
        tokens = chosen.tolist()
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for row, i in enumerate(want):
            vals = host[row]
            n = reqs[i].params.logprobs or 0
            top = [(int(vals[2 + top_n + j]), vals[2 + j]) for j in range(n)]
            out[i] = TokenLogprob(token_id=tokens[i], logprob=vals[0], rank=int(vals[1]), top=top)
        return tokens, out
