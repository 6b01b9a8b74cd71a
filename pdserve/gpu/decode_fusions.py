"""The switch for issue 21's batch-1 decode fusions (no triton import: the CPU side reads it too).

What it covers: the GEMV epilogues (pdserve.gpu.gemv), the split-KV merge inside the decode kernel
(pdserve.attention.triton_backend) and the RoPE cos/sin table (DecoderLM.rope_table_len). On the H200 they
took P1's ITL from 4.53-4.61 ms to 4.37 ms in one run (BENCHMARKS.md, "Decode, batch 1 (P1)");
PDSERVE_DECODE_FUSIONS=0 turns them off (benchmarks/gpu_suite.py measures them on and off in one run).
"""

from __future__ import annotations

import os

DECODE_FUSIONS_ENV = "PDSERVE_DECODE_FUSIONS"


def decode_fusions_from_env() -> bool:
    return os.environ.get(DECODE_FUSIONS_ENV, "1") != "0"
