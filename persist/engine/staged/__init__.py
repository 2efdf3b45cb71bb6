"""The staged restore on MLX's CUDA backend: lanes, slots and reader processes."""
