"""Sizing the prefill and decode pools to the load: signals (what is measured), policy (when to add,
remove or switch a replica), record (decisions logged and exported). The actuation lives with the
deployment that owns the replicas (pdserve/launch/ray_app.py)."""
