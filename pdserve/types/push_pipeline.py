"""Which push WRITEs a prefill posts (`kv_connector_extra_config` `push_pipeline`, `push_layerwise_min_tokens`):
layer by layer as each chunk is computed, or the whole request after its prefill. Torch-free, so that the
simulator (pdserve/sim) decides as the connector (pdserve/kv_transfer/connector.py) does."""

from __future__ import annotations

PUSH_PIPELINES = ("auto", "layer", "request")
# push_pipeline "layer": prompts shorter than this are pushed whole after the prefill, where per-layer posting
# costs more than it hides (SGLang's layerwise PR: +18 % TTFT at 256 tokens, -48 to -68 % at 1k-8k; on the CPU
# namespace bed layer push hid 101 % of the wire at 1024 tokens).
DEFAULT_PUSH_LAYERWISE_MIN_TOKENS = 512


def push_layer_by_layer(pipeline: str, mem_type: str) -> bool:
    """Whether a push prefill WRITEs layer by layer (prompts of at least push_layerwise_min_tokens) or the whole
    request after its prefill. "auto" (the default) decides by where the pool lives, from measurements
    (BENCHMARKS.md, "Push transfer on the GPU"): layer by layer on a CPU pool, where the wire is as slow as
    the prefill and per-layer WRITEs hid it; whole-request on a GPU pool, where on the H100 layer push lost to
    whole-request push at every measured length (256 and 8k over CUDA IPC: +22 and +11 ms against +0 and +6;
    8k over TCP: +2455 against +2246), since one layer of a block-major pool is one range per block and posting
    them cost ~100 ms of host time per 8k request against a 1 GiB WRITE of 0.75 ms."""
    if pipeline == "auto":
        return mem_type != "VRAM"
    return pipeline == "layer"
