"""The engine's prefill/decode half: what a request's `kv_transfer_params` make the engine do, behind the
connector seam (`connector_protocol`) that `pdserve.kv_transfer` implements.

engine_pd   `EnginePD`: the calls the step loop makes; each returns `events` for the loop to apply
events      what the P/D half asks of the loop (schedule, first token adopted, load ended, emit, finish, refused)
kv_handoff  `Request.kv`: a request's one P/D record, the `KVState` machine
admission   params read and checked, early decode legs parked (`params_mailbox`), first token, prefix match
loads       the consumer's reads: started, claims and outcomes polled, the one place a read ends
holds       KV kept after a request: prefill legs' leases, conversations (history), pins for peers
"""
