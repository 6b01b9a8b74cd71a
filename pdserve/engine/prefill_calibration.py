"""An instance measures what its prefill steps cost (pdserve/types/prefill_cost.py), once at startup after the
engine's warm-up and before it serves: the `prefill_cost` its /pdserve/info advertises, with which the proxy prices
recomputing a conversation's history at the margin (multi-turn over P/D, issue 42 part 4).

Fresh prompts (random ids: nothing cached) of a few lengths, `max_tokens` 1, each stepped alone through the engine
as a served prompt is (scheduling, block allocation and hashing, the forward, the first token): the wall time of
the steps that prefilled it, the median of `REPEATS` after one untimed run of each length (a length's first run
pays first-use costs a served step does not). The lengths: `FLOOR_TOKENS` for the floor, then two lengths past
any GPU's floor for the per-token line (PrefillCost.fit), and one between for the record. ~0.5 s for the 8B shape
on an H100 (estimated from its step times). Only where it is used: a GPU instance that reads held histories back
(`bidirectional_kv_xfer`, not a kv_consumer); a CPU prefill is priced at the proxy's `--kv-history-prefill-tps`
instead (its steps have no launch floor worth measuring, and measuring would slow every CPU start).

The engine is left as `LLMEngine._warm_up` leaves it: the counters a client sees (finished requests, prefix-cache
queries and hits, step timing) are reset. The prompts' blocks stay in the prefix cache as free blocks, as the
warm-up's do.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from pdserve.types.prefill_cost import PrefillCost
from pdserve.types.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

FLOOR_TOKENS = 32
LINE_TOKENS = (1024, 2048)  # past the 8B shape's floor on an H100 (its ridge: ~600-900 tokens, estimated)
RECORD_TOKENS = 256
REPEATS = 3
MAX_STEPS = 64  # bound per prompt: a 2048-token prompt takes one step, or a few under a small batch budget


def calibration_lengths(max_model_len: int, pool_tokens: int) -> list[int]:
    """The prompt lengths to time, within what the engine admits (a prompt leaves one position for its token;
    the pool keeps the warm-up's margin). A prompt longer than the step budget is chunked: its steps are summed,
    as a served prompt pays them."""
    top = max(1, min(max_model_len - 1, pool_tokens))
    return sorted({min(n, top) for n in (FLOOR_TOKENS, RECORD_TOKENS, *LINE_TOKENS)})


def measure_prefill_cost(engine: Any, device_name: str) -> PrefillCost | None:
    """Times prefill steps of `engine` (an LLMEngine not yet serving) and fits the cost model; None when the
    engine admits too few lengths to fit one (a tiny max_model_len or pool)."""
    bs = engine.config.block_size
    pool_tokens = (engine.blocks.num_blocks // 2 - 1) * bs
    lengths = calibration_lengths(engine.max_model_len, pool_tokens)
    if len(lengths) < 3:
        return None
    rng = random.Random(0x5EED)
    vocab = engine.model_cfg.vocab_size
    t0 = time.perf_counter()
    points = []
    try:
        for n in lengths:
            times = [_time_prompt(engine, [rng.randrange(vocab) for _ in range(n)], f"__prefill_cost_{n}_{i}")
                     for i in range(REPEATS + 1)]
            points.append((n, statistics.median(times[1:])))
    except RuntimeError as e:
        log.warning("prefill cost not measured (%s): the proxy prices recompute at its --kv-history-prefill-tps", e)
        return None
    finally:
        _forget(engine)
    cost = PrefillCost.fit(device_name, points)
    if cost is not None:
        log.info("prefill cost measured in %.1f s: floor %.2f ms, %.2f us a token past %d tokens (%s)",
                 time.perf_counter() - t0, cost.floor_s * 1e3, cost.per_token_s * 1e6, round(cost.ridge_tokens()),
                 ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in points))
    return cost


def _time_prompt(engine: Any, prompt: list[int], request_id: str) -> float:
    """Wall seconds of the steps that prefill `prompt` and sample its one token."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    spent = 0.0
    for _ in range(MAX_STEPS):
        t = time.perf_counter()
        engine.step()
        spent += time.perf_counter() - t
        if not engine.has_unfinished():  # finished, and no step launched ahead left to take in
            return spent
    raise RuntimeError(f"a {len(prompt)}-token prompt did not finish in {MAX_STEPS} steps")


def _forget(engine: Any) -> None:
    """The counters a client sees, as LLMEngine._warm_up leaves them (the calibration's requests are nobody's)."""
    for rid in [r for r in engine.requests if r.startswith("__prefill_cost_")]:
        engine.abort_request(rid)
    for _ in range(MAX_STEPS):  # a step launched ahead for an aborted request: taken in, dropped
        if not engine.has_unfinished():
            break
        engine.step()
    engine.reset_client_counters()
