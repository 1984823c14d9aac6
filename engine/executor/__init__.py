"""Executors move a scheduled step to the workers that run it and its tokens back: in this
process, or to ranks it spawned (or a launcher started), and each rank's own loop.

May import: engine.worker, engine.kv_transfer, engine.core, engine.config.
"""
