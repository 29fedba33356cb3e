"""Methods added to every vLLM worker through the engine argument ``worker_extension_cls``
(vLLM's documented route for RLHF weight updates; called with ``LLM.collective_rpc(name, args=...)``).

Imports nothing from vLLM at module level: vLLM mixes this class into its worker class inside the worker
process, where ``self.model_runner`` is the worker's model runner; vLLM's reload module is imported when a
sync starts.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch


def pack_tensor(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """``(name, dtype, shape, raw bytes)`` of a host tensor: survives any of vLLM's RPC serialisers
    (a tensor inside a collective_rpc argument can arrive as a nested list)."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def unpack_tensor(packed: Any) -> tuple[str, torch.Tensor]:
    name, dtype, shape, raw = packed
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return str(name), flat.view(getattr(torch, dtype)).reshape([int(s) for s in shape])


class PortrlWeightSync:
    """Worker mixin: load named tensors (HF names) bucket by bucket, each worker keeping its own part of each
    (the model's ``load_weights`` and its parameters' ``weight_loader`` narrow a full tensor to this worker's
    tensor-parallel shard), so a worker holds at most a bucket and the layers it has not finished beside its model.

    * :meth:`portrl_begin_weights`: where vLLM has its layer-wise in-place reload
      (``vllm.model_executor.model_loader.reload``, 0.2x+, what ``reload_weights`` runs), it starts one: each
      layer is re-processed once all its tensors arrived (the CPU backend's repacked linear weights, whose
      parameters no longer carry a ``weight_loader``, included); else buckets load straight into the parameters.
    * :meth:`portrl_load_weights`: one bucket of :func:`pack_tensor` tuples, loaded now.
    * :meth:`portrl_finish_weights`: ends the reload (layers still open are processed) and resets what the worker
      derived from the old weights.
    """

    def portrl_begin_weights(self) -> str:
        """Start an update; returns how it loads ("layerwise" or "direct")."""
        reload = _layerwise_reload()
        mode = "direct"
        if reload is not None and hasattr(self.model_runner, "reload_weights"):  # type: ignore[attr-defined]
            with _current_config(self):
                reload.initialize_layerwise_reload(self.model_runner.model)  # type: ignore[attr-defined]
            mode = "layerwise"
        self.__dict__["_portrl_load"] = mode
        return mode

    def portrl_load_weights(self, packed_tensors: list[Any]) -> int:
        """Load one bucket into the running model; returns how many tensors it held."""
        weights = [unpack_tensor(p) for p in packed_tensors]
        with _current_config(self):
            self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)

    def portrl_finish_weights(self) -> str:
        """End the update :meth:`portrl_begin_weights` started; returns its mode."""
        mode = self.__dict__.pop("_portrl_load", "direct")
        runner = self.model_runner  # type: ignore[attr-defined]
        if mode == "layerwise":
            with _current_config(self):
                _layerwise_reload().finalize_layerwise_reload(runner.model, runner.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return mode


def _layerwise_reload() -> Any:
    """vLLM's layer-wise reload module, or None where this vLLM has none."""
    try:
        return importlib.import_module("vllm.model_executor.model_loader.reload")
    except ImportError:
        return None


def _current_config(worker: Any) -> Any:
    """vLLM's ``set_current_vllm_config(worker.vllm_config)`` (its loaders read the current config), or a context
    that does nothing where the worker or vLLM has none."""
    config = getattr(worker, "vllm_config", None)
    try:
        set_current = getattr(importlib.import_module("vllm.config"), "set_current_vllm_config", None)
    except ImportError:
        set_current = None
    return contextlib.nullcontext() if config is None or set_current is None else set_current(config)
