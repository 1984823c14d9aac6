"""Data-parallel replicas: the front that routes requests to them and relays their
outputs, the router, a replica's process and inbox, launched replicas, and a replica's
part in a prefill/decode hand-off (its KV hand-off).

May import: engine.engine and every room below it.
"""
