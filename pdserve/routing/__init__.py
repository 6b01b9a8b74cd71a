"""The instance-choice policy every tier that routes requests shares: the proxy (proxy/pairing.py, the one place
it chooses a prefill and a decode instance) and the render tier's orchestrator (render/engine_client.py).

Its own package because those two tiers import each other never (server, render, proxy and bench import api/, not
one another), and the policy is neither a wire contract (api/) nor shared vocabulary of the engine (types/): it is
the rule "least loaded, ties rotated; or the cheapest by a cost the caller knows; or prefix affinity" over anything
that says how loaded it is. Torch-free and aiohttp-free; it imports nothing of pdserve.
"""
