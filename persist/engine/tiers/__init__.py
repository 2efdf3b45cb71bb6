"""The engine's remote tiers: push after a commit, pull on a miss."""
