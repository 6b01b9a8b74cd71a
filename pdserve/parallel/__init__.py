"""Tensor-parallel communication only: the collectives between ranks (`comm`) and the RPC the engine uses to
drive ranks 1..N-1 (`rank_rpc`). The layout (how a model splits) is `pdserve.types.tp_layout`; the executor
and worker processes are `pdserve.engine.runner`."""
