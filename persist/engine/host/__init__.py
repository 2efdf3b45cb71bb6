"""The engine's host-RAM tier."""
