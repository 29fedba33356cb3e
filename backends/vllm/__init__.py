"""The vLLM rollout engine adapter, shared by the cuda, rocm, npu and cpu backends. vLLM is imported lazily."""

from portrl.backends.vllm.engine import VLLMEngine, import_vllm

__all__ = ["VLLMEngine", "import_vllm"]
