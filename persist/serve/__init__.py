"""``persist serve``: mlx-lm's server with a durable, tiered prompt cache."""
