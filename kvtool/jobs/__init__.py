"""Work that loads a model or moves blocks: warm, import/export of mlx-lm prompt-cache files, remote push."""
