"""A second (host memory) and third (disk) KV tier behind the engine's KV pool: full blocks evicted from the
pool are kept by their chained hash, LRU, and loaded back when a prompt's prefix continues into them
(`--kv-offloading-size GiB --kv-offloading-backend native`, `--kv-offloading-disk-path DIR
--kv-offloading-disk-size GiB`). See ARCHITECTURE.md, "KV offload tiers"."""
