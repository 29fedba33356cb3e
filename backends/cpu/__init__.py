from portrl.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
