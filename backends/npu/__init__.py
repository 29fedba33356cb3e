"""Huawei Ascend NPU backend (registered as entry point ``portrl.backends: npu``)."""
from portrl.backends.npu.backend import NPUBackend

__all__ = ["NPUBackend"]
