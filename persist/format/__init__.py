"""The file format: the safetensors container with a msgpack manifest, tensor I/O,
token packing.  What every persist file and store blob is made of (docs/FORMAT.md)."""
