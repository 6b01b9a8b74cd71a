"""Draft-model proposals (vLLM's `{"model": DIR, "num_speculative_tokens": K}`, vllm/v1/spec_decode/
draft_model.py): a smaller model with the target's tokenizer drafts K tokens greedily, one forward per
token; the target verifies them (rejection.py treats them as one-hot, as vLLM's V1 does).

The draft's KV lives in its own pool with the target's block count and block size, addressed by the
target's block tables: a request's blocks hold the target's KV in one pool and the draft's in the other.
The draft's KV is never trusted beyond what this request computed into it (`Request.draft_computed_tokens`):
a request's first proposal runs the draft over its whole prompt (a draft prefill), whether the target's
prompt KV came from this instance's prefill, its prefix cache or a P/D transfer. So a decode instance behind
any prefill drafts without the draft's KV ever crossing the wire (ARCHITECTURE.md, "Speculative decoding",
argues the choice with measurements). Later proposals only catch up on the tokens accepted since. The draft
pool's contents never affect output, only how many drafts are accepted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.request import Request

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.runner.model_runner import ModelRunner
    from pdserve.model.config import ModelConfig
    from pdserve.types.engine_config import EngineConfig


class _At:
    """A request as ModelRunner._prepare sees it (host_batch.HostBatch), with its computed prefix set to `start`
    (the draft's)."""

    __slots__ = ("num_computed_tokens", "token_at", "prompt_token_ids", "token_ids", "spec_token_ids", "block_ids")

    def __init__(self, req: Request, start: int):
        self.num_computed_tokens = start
        self.token_at = req.token_at  # prompt, output, then the drafts made so far
        self.prompt_token_ids = req.prompt_token_ids
        self.token_ids = req.token_ids
        self.spec_token_ids = req.spec_token_ids
        self.block_ids = req.block_ids


def draft_block_bytes(draft_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the draft's KV pool (what the target's pool sizing sets aside per block)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return draft_cfg.num_layers * 2 * block_size * draft_cfg.num_kv_heads * draft_cfg.head_dim * elem


def load_draft_config(model: str, config: EngineConfig) -> tuple[Path, ModelConfig]:
    from pdserve.model.config import load_model_config
    from pdserve.model.model_dir import resolve_model_dir

    draft_dir = resolve_model_dir(model, config.load_format)
    return draft_dir, load_model_config(draft_dir)


class DraftModelProposer:
    def __init__(self, model: str, config: EngineConfig, target_cfg: ModelConfig, num_blocks: int,
                 blocks: BlockManager, max_tokens_per_forward: int):
        from pdserve.engine.runner.model_runner import ModelRunner

        draft_dir, draft_cfg = load_draft_config(model, config)
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft_cfg.vocab_size} tokens) is "
                             f"not the target's ({target_cfg.vocab_size}): a draft model must share its tokenizer")
        draft_engine_cfg = dataclasses.replace(
            config, model=str(draft_dir), tokenizer=None, num_gpu_blocks_override=num_blocks,
            speculative_config=None, kv_cache_dtype="auto", enforce_eager=True, warm_up=False,
            kv_transfer_config=None, kv_events_config=None, kv_offloading_size=None, kv_offloading_backend=None,
            kv_offloading_disk_path=None, kv_offloading_disk_size=None, tensor_parallel_size=1)
        self.runner: ModelRunner = ModelRunner(draft_engine_cfg, draft_cfg, draft_dir)
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_tokens_per_forward = max(1, max_tokens_per_forward)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        """Sets reqs[i].spec_token_ids to up to ks[i] greedy draft tokens (fewer where the pool has no
        blocks for their positions)."""
        todo: list[tuple[Request, int]] = []
        for req, k in zip(reqs, ks, strict=True):
            k = self._fit_blocks(req, k)
            req.spec_token_ids = []
            if k > 0:
                todo.append((req, k))
        if not todo:
            return
        self._catch_up([req for req, _ in todo])
        live = todo
        while live:  # one forward per further draft position, for every request still drafting
            live = [(req, k) for req, k in live if len(req.spec_token_ids) < k]
            if not live:
                break
            batch = [(_At(req, req.num_tokens + len(req.spec_token_ids) - 1), 1) for req, _ in live]
            for (req, _), tok in zip(live, self._forward(batch, list(range(len(batch)))), strict=True):
                req.spec_token_ids.append(tok)

    def _fit_blocks(self, req: Request, k: int) -> int:
        """Draft i is fed back at position num_tokens + i - 1: blocks must cover positions < num_tokens + k - 1
        (the verify step's last row is the scheduler's to allocate). Never at anyone's expense."""
        need = req.num_tokens + k - 1
        if k <= 0 or self.blocks.allocate(req, need):
            return k
        return min(k, len(req.block_ids) * self.block_size - req.num_tokens + 1)

    def _catch_up(self, reqs: list[Request]) -> None:
        """The draft over each request's tokens it has not computed (the whole prompt the first time), in
        forwards of at most max_tokens_per_forward tokens; each request's first draft from its last row."""
        starts = {req.request_id: req.draft_computed_tokens for req in reqs}
        while True:
            batch: list[tuple[_At, int]] = []
            owners: list[Request] = []
            budget = self.max_tokens_per_forward
            for req in reqs:
                start = starts[req.request_id]
                if start < req.num_tokens and budget > 0:
                    n = min(req.num_tokens - start, budget)
                    batch.append((_At(req, start), n))
                    owners.append(req)
                    budget -= n
            if not batch:
                break
            rows, done = [], []
            end = 0
            for (view, n), req in zip(batch, owners, strict=True):
                end += n
                starts[req.request_id] = view.num_computed_tokens + n
                if starts[req.request_id] == req.num_tokens:
                    rows.append(end - 1)
                    done.append(req)
            tokens = self._forward(batch, rows)
            for req, tok in zip(done, tokens, strict=True):
                req.spec_token_ids = [tok]
                req.draft_computed_tokens = req.num_tokens

    def _forward(self, batch: list[tuple[_At, int]], rows: list[int]) -> list[int]:
        """The draft over `batch` (its K/V into the draft pool); the greedy token of each row in `rows`."""
        r = self.runner
        _, input_ids, positions, meta = r._prepare(batch, rows)  # type: ignore[arg-type]
        logits = r._forward_cpu(input_ids, positions, meta, rows)
        return [] if logits is None else logits.argmax(dim=-1).tolist()

    @staticmethod
    def on_verified(req: Request, num_drafts: int, num_accepted: int) -> None:
        """Accepted drafts whose K/V the draft wrote while drafting (drafts 1..k-1 were fed back) are
        computed for it too."""
        req.draft_computed_tokens += min(num_accepted, num_drafts - 1)
