"""Speculative decoding's scheduling side: the n-gram proposer and the switch that
prices each step with drafts against a plain one. (Draft models run on the worker,
verification in worker/sampling/.)

May import: engine.config.
"""
