"""What a run is: the configuration groups (engine, speculative, disagg, the runtime that
holds them all) and the run resolved from them once at start-up.

May import: parallel/, models/ (to resolve the architecture), nothing else of the engine.
"""
