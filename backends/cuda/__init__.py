"""NVIDIA CUDA backend (registered as entry point ``portrl.backends: cuda``)."""
from portrl.backends.cuda.backend import CUDABackend

__all__ = ["CUDABackend"]
