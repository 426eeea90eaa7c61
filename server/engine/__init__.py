"""The serving engine: KV blocks, prefix cache, scheduler, sampler and the engine loop."""
