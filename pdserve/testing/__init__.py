"""Harnesses for tests and benchmarks: HTTP stand-ins for instances, GPU correctness checks. Not used when serving."""
