"""Token sampling as batched tensor ops on the logits' device: greedy, temperature, top-k, top-p, min-p,
per-request seeds, min_tokens, allowed_token_ids, logit_bias, presence/frequency/repetition penalties,
logprobs.

Everything runs on the device that holds the logits (the GPU when serving on one), for all rows at
once; the host sees one small copy of the chosen ids (and of the logprobs, when asked for). A per-row
loop on the CPU cost ~6 ms per sampled request per step for a 128k vocabulary on the H200 host, more
than the 8B model's whole decode step.

The logits are adjusted in vLLM's (V1) order before the choice: allowed_token_ids (every other token to
-inf), logit_bias, the min_tokens ban on EOS and stop ids, then the penalties: repetition (HF style, on
tokens of the prompt or the output), frequency (per occurrence in the output) and presence (once per
token in the output). Last, structured outputs: each grammar row's bitmask (filled on the host by the
grammar engine, one copy for the batch) masks every token its grammar does not allow; should the other
bans have left a grammar row nothing, the grammar alone decides. Greedy rows take the argmax of the adjusted logits. Logprobs are those of the raw
logits (vLLM's default). A batch where nothing adjusts is not copied; token counts are built only for
the rows with a penalty.

Sampling draws by an exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is token i with
probability p_i / sum(p), so one batched `exponential_` and one argmax sample every row. Rows with a
seed draw their noise from their own generator, so a seeded request repeats whatever else is batched
with it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.engine.request import Request
from pdserve.types.outputs import TokenLogprob


def _pairs(rows: Iterable[int], id_lists: Iterable[Iterable[int]],
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors for `index_put_`: each row paired with every id of its list."""
    r: list[int] = []
    c: list[int] = []
    for row, ids in zip(rows, id_lists, strict=True):
        before = len(c)
        c.extend(ids)
        r.extend([row] * (len(c) - before))
    return torch.tensor(r, dtype=torch.long, device=device), torch.tensor(c, dtype=torch.long, device=device)


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}  # [256, 8]: byte value -> its 8 tokens' 0 / -inf


def grammar_bias(grammars: list, vocab: int, device: torch.device) -> torch.Tensor:
    """[len(grammars), vocab] float32 of 0 (allowed) or -inf: what adding to the logits leaves only the tokens
    each row's grammar allows (rows without one allow all). The grammar engine writes packed bitmasks into
    one host tensor (bit i of word i // 32 = token i), which moves to the device in one copy; each byte is
    unpacked there through a 256-row table (on CPU a masked_fill over [64, 49k] costs 12 ms, this 3)."""
    from pdserve.structured.grammar import fill_bitmasks

    words = next(g for g in grammars if g is not None).mask_bytes // 4
    packed = torch.full((len(grammars), words), -1, dtype=torch.int32)
    fill_bitmasks(grammars, packed.data_ptr(), words * 4)
    table = _BYTE_BIAS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_BIAS[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    as_bytes = packed.to(device).view(torch.uint8).int()  # little-endian: byte k of word w = tokens 32w+8k..
    bias = torch.nn.functional.embedding(as_bytes, table).view(len(grammars), words * 32)
    if bias.shape[1] >= vocab:
        return bias[:, :vocab]
    pad = torch.full((len(grammars), vocab - bias.shape[1]), float("-inf"), device=device)
    return torch.cat([bias, pad], dim=1)


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

    def skip_draw(self, req: Request, device: torch.device, vocab_size: int) -> None:
        """Advance a seeded request's generator past one sampling step, as if this sampler had drawn the token
        the request already has (a decode leg that adopted the prefill's first token): its next draws are
        then those a collocated run makes, so seeded outputs match. Unseeded and greedy requests: nothing."""
        if req.params.seed is None or req.params.greedy:
            return
        torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=self._generator(req, device))

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(reqs), vocab] on any device, any float dtype (computed in float32)."""
        raw = logits.float()
        adjusted = self.adjust(raw, reqs)
        if all(r.params.greedy for r in reqs):
            chosen = adjusted.argmax(dim=-1)
        else:
            chosen = self._sample(adjusted, reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not want:
            return chosen.tolist(), [None] * len(reqs)
        return self._with_logprobs(raw, chosen, reqs, want)

    @classmethod
    def adjust(cls, raw: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The logits the choice is made from: `raw` itself when nothing applies (the common case costs no
        copy), else an adjusted copy (`raw` stays as it is for the logprobs)."""
        bans = cls._early_stop_bans(reqs, raw.shape[1])
        if not bans[0] and not any(r.params.adjusts_logits for r in reqs):
            return raw
        x = raw.clone()
        cls._restrict(x, reqs)
        cls._bias(x, reqs)
        if bans[0]:
            x[torch.tensor(bans[0], device=x.device), torch.tensor(bans[1], device=x.device)] = float("-inf")
        cls._penalize(x, reqs)
        cls._constrain(x, raw, reqs)
        return x

    @staticmethod
    def _early_stop_bans(reqs: list[Request], vocab: int) -> tuple[list[int], list[int]]:
        """(rows, cols) to mask: before min_tokens are out, neither EOS nor stop token ids may be sampled."""
        rows: list[int] = []
        cols: list[int] = []
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
        return rows, cols

    @staticmethod
    def _restrict(x: torch.Tensor, reqs: list[Request]) -> None:
        """In place: rows with allowed_token_ids keep only those tokens."""
        restricted = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        if not restricted:
            return
        dev = x.device
        keep = torch.zeros(len(restricted), x.shape[1], dtype=torch.bool, device=dev)
        r, c = _pairs(range(len(restricted)), (ids for _, ids in restricted), dev)
        keep.index_put_((r, c), torch.ones_like(r, dtype=torch.bool))
        rows = torch.tensor([i for i, _ in restricted], device=dev)
        x[rows] = x[rows].masked_fill(~keep, float("-inf"))

    @staticmethod
    def _bias(x: torch.Tensor, reqs: list[Request]) -> None:
        """In place: adds each row's logit_bias."""
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if not biased:
            return
        dev = x.device
        r, c = _pairs((i for i, _ in biased), (bias.keys() for _, bias in biased), dev)
        v = torch.tensor([b for _, bias in biased for b in bias.values()], dtype=x.dtype, device=dev)
        x.index_put_((r, c), v, accumulate=True)

    @staticmethod
    def _penalize(x: torch.Tensor, reqs: list[Request]) -> None:
        """In place, on the rows with a penalty only: repetition (prompt and output tokens), then frequency
        and presence (output tokens), as vLLM applies them."""
        pen = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not pen:
            return
        dev = x.device
        params = [reqs[i].params for i in pen]
        outputs = [reqs[i].output_token_ids for i in pen]
        rows = torch.tensor(pen, device=dev)
        sub = x[rows]
        counts = torch.zeros_like(sub)  # occurrences of each token in the output so far
        if any(outputs):
            r, c = _pairs(range(len(pen)), outputs, dev)
            counts.index_put_((r, c), torch.ones(len(c), dtype=sub.dtype, device=dev), accumulate=True)
        in_output = counts > 0
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [reqs[i].prompt_token_ids for i in pen]
            seen = in_output.clone()
            r, c = _pairs(range(len(pen)), prompts, dev)
            seen.index_put_((r, c), torch.ones_like(r, dtype=torch.bool))
            rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
            # divided (vLLM multiplies by 1/p) as transformers does: the same float32 results as its
            # RepetitionPenaltyLogitsProcessor
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
            sub = sub - freq * counts - pres * in_output
        x[rows] = sub

    @staticmethod
    def _constrain(x: torch.Tensor, raw: torch.Tensor, reqs: list[Request]) -> None:
        """In place: rows with a grammar keep only the tokens it allows next (one mask for the whole batch:
        rows without a grammar allow everything)."""
        grammars = [r.grammar for r in reqs]
        if all(g is None for g in grammars):
            return
        bias = grammar_bias(grammars, x.shape[1], x.device)
        # allowed_token_ids or the min_tokens ban on EOS may have removed every token the grammar allows
        # (EOS at its end): those rows take the grammar's mask over the raw logits instead
        clash = [i for i, r in enumerate(reqs) if r.grammar is not None and (
            r.params.allowed_token_ids or len(r.output_token_ids) < r.params.min_tokens)]
        x.add_(bias)
        if clash:
            idx = torch.tensor(clash, device=x.device)
            dead = torch.isneginf(x[idx]).all(dim=-1, keepdim=True)
            x[idx] = torch.where(dead, raw[idx] + bias[idx], x[idx])

    @staticmethod
    def probs(logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The distribution each row samples from: the (adjusted) logits under the row's temperature, top-k,
        min-p and top-p (greedy rows at temperature 1; their argmax is taken elsewhere). The speculative
        decoding rejection sampler (pdserve.engine.spec_decode.rejection) accepts drafts against these."""
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
        return probs

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        dev = logits.device
        params = [r.params for r in reqs]
        greedy = [p.greedy for p in params]
        probs = self.probs(logits, reqs)
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
        got = token_logprobs(raw[rows], chosen[rows], [reqs[i].params.logprobs or 0 for i in want])
        tokens = chosen.tolist()
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for lp, i in zip(got, want, strict=True):
            out[i] = lp
        return tokens, out


def token_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[TokenLogprob]:
    """Per row of raw logits: the given token's logprob (float32 log_softmax) and rank, and the row's top n
    (top_ns[i]) ids and logprobs. One device->host copy for all of it. Shared by the sampled tokens'
    logprobs and the prompt's."""
    lps = torch.log_softmax(raw.float(), dim=-1)
    token_lp = lps.gather(1, token_ids[:, None])
    ranks = (lps > token_lp).sum(dim=-1) + 1
    top_n = max(top_ns, default=0)
    top_vals, top_ids = torch.topk(lps, top_n, dim=-1) if top_n else (lps[:, :0], token_ids[:, None][:, :0])
    host = torch.cat([token_lp, ranks[:, None].to(lps.dtype), top_vals, top_ids.to(lps.dtype)], dim=1).tolist()
    ids = token_ids.tolist()
    out: list[TokenLogprob] = []
    for vals, tok, n in zip(host, ids, top_ns, strict=True):
        top = [(int(vals[2 + top_n + j]), vals[2 + j]) for j in range(n)]
        out.append(TokenLogprob(token_id=tok, logprob=vals[0], rank=int(vals[1]), top=top))
    return out
