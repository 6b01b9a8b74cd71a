"""KV cache events, wire-compatible with vLLM's `--kv-events-config` (ZMQ PUB + replay, msgpack batches),
and the block hash they carry. `block_hash` and `events` are importable without torch or zmq (a router
computes the same hashes from token ids and decodes the batches); `publisher` needs pyzmq."""
