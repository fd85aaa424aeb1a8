"""The GPU (Triton) and CPU (C++) kernels of the worker, each beside its torch twin."""
