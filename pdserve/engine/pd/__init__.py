"""The engine's prefill/decode half: what a request's `kv_transfer_params` make the engine do (admission with a
remote load, the params mailbox of early decode legs, first-token adoption, prefix pulls, history handback),
behind the connector seam (`connector_protocol`) that `pdserve.kv_transfer` implements."""
