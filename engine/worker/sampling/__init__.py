"""Sampling on the device, batched: the sampler, logit adjustments (penalties, bias),
structured-output grammars, the rejection sampler for drafts, and the sampled tokens
handed back.

May import: engine.worker.step_inputs, engine.core, engine.config.
"""
