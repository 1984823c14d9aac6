"""The engine: requests in, scheduled steps on the ranks, outputs out.

Rooms, each importing only the rooms below it (the import-linter contract in
pyproject.toml checks it):

    llm.py          the offline API (`LLM.generate`)
    build.py        the one factory: a resolved run -> its EngineClient
    client.py       EngineClient, the interface every front speaks
    disagg/         the prefill/decode front: hops a request between replicas
    replicas/       data-parallel replicas: the front, the router, a replica process,
                    a replica's part in a KV hand-off
    engine.py       one replica's step loop (Engine)
    executor/       moves a scheduled step to the ranks: in process, or to spawned ranks
    timing/         step clocks, the step log, and the cost model's priors
    worker/         the one worker type every rank runs; sampling/ in a room of its own
    kv_transfer/    where KV blocks cross processes: connectors, wires, leases, handshake
    core/           pure Python: sequences, block manager, prefix cache, scheduler, outputs
    spec/           speculative decoding's scheduling side: proposers and the switch
    config/         every engine-side configuration, and the run resolved from them

Where what comes next lands: a mixture-of-experts layer and its expert dispatch in
models/ over parallel/comm (the worker runs it like any layer); quantized linear methods
in parallel/layers/; KV cache groups per attention kind in core/ (the block manager) and
worker/kv_cache.py; KV tiers (host memory, disk) as a room of their own beside
kv_transfer/, below the worker.
"""
