"""Model files to mlx-lm modules: GGUF and MLX/HF directories, checksums, shapes."""
