"""The HTTP-level contracts every tier shares (engine server, proxy, render tier, bench).

Torch-free by rule: the proxy, the render tier and the benchmark client import this package without an
engine. `pd` is the one home of the prefill/decode wire contract.
"""
