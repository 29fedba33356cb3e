"""AMD ROCm backend (registered as entry point ``portrl.backends: rocm``)."""
from portrl.backends.rocm.backend import ROCmBackend

__all__ = ["ROCmBackend"]
