"""The engine: paged KV cache, continuous batching scheduler, model runner, sampler, step loop."""
