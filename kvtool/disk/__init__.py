"""A namespace on disk, MLX-free: names, confined file ops, lock, segment format, index, chain forest, eviction planner, byte budget, the SSD store (`namespace.SSDStore`)."""
