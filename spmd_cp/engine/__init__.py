"""The engine: the model's forward pass over a sharded KV cache, prefill, decode, generation."""
