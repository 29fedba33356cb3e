"""The ``sglang`` rollout engine (SGLang's offline ``sglang.Engine``), offered on the cuda and rocm backends."""

from portrl.backends.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]
