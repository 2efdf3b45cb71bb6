"""The engine: ``Store`` and the data path of save, lookup and restore, single
files, and prefill with checkpoints.  Builds on codecs, store, policy and format."""
