"""The switch for issue 21's batch-1 decode fusions (no triton import: the CPU side reads it too).

What it covers: the GEMV epilogues (pdserve.engine.runner.gemv) and the RoPE cos/sin table (DecoderLM.rope_table_len).
On the H200 they took P1 from 76.4-77.1 % to 81.1-83.2 % of copy bandwidth, each pair in one run
(BENCHMARKS.md, "Decode, batch 1 (P1)"); PDSERVE_DECODE_FUSIONS=0 turns them off (benchmarks/gpu_suite.py
measures them on and off in one run). The split merge inside the decode kernel is a separate switch
(TritonAttention.fused_decode_merge), off: it measured slower past ~330 keys.
"""

from __future__ import annotations

import os

DECODE_FUSIONS_ENV = "PDSERVE_DECODE_FUSIONS"


def decode_fusions_from_env() -> bool:
    return os.environ.get(DECODE_FUSIONS_ENV, "1") != "0"
