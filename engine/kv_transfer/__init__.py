"""Where KV blocks cross processes: the handshake, which rank's piece goes where, the
connectors (torch.distributed, NIXL) and their wires, a streamed prompt's listing, the
leases on held blocks, and the agent that fans a replica's pull out to its ranks.

May import: engine.config, parallel.comm. Never the worker or anything above it.
"""
