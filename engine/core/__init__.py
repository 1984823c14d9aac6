"""Who decides what runs this step: sequences, the block manager and prefix cache, the
scheduler and what it hands the worker, request outputs. Plain Python, no torch.

May import: engine.spec, engine.config.
"""
