"""Disaggregated serving's front: prefill replicas and decode replicas behind one front,
each request hopping from one to the other with its KV.

May import: engine.replicas and every room below it.
"""
