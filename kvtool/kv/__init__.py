"""The MLX side: blocks of a cache, sliding windows, restore buffers, the model's KV layout, prefill and decode."""
