"""CUDA transport: the driver, kernels, pinned staging and reader processes."""
