"""Tiers beyond one machine: Redis/Valkey and S3 clients.  Never mlx."""
