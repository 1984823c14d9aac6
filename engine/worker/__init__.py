"""The one worker type every rank runs, and what it owns: model runner, KV cache, draft
model, CUDA graphs, warm-up; sampling/ holds the batched sampler.

May import: engine.kv_transfer, engine.core, engine.spec, engine.config, models/.
"""
