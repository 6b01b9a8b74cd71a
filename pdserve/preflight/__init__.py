"""`pdserve preflight` (go/no-go checks, GPU probes, metrics scraping) and `pdserve plan` (KV arithmetic)."""
