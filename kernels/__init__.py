"""The NVFP4 kernel suite on MLX: the reference format, the cases and their arms (paths)."""
