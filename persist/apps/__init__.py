"""Applications on the engine: generate and prime, demo models, speculative
decoding, and ``persist serve`` (mlx-lm's server with a durable prompt cache)."""
