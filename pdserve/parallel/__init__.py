"""Tensor parallelism: how a model splits over ranks (`layout`, torch-free), the collectives (`comm`), the
worker processes of ranks 1..N-1 (`worker`) and the engine-side handle on them (`executor`)."""
