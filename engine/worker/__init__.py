"""The one worker type every rank runs, the executors that move its messages, and what
it owns: model runner, KV cache, sampler, CUDA graphs."""
