"""Executes a scheduled batch on the model: the model runner (CPU path and its sampler), the GPU step runner
(CUDA graphs, Triton ops, GEMV decode), async decode and the tensor-parallel executor/worker that drive ranks
1..N-1. Knows nothing of P/D: KV transfer reaches it only as the pool it reads and writes."""
