"""Methods added to every vLLM worker through the engine argument ``worker_extension_cls``
(vLLM's documented route for RLHF weight updates; called with ``LLM.collective_rpc(name, args=...)``).

Imports nothing from vLLM: vLLM mixes this class into its worker class inside the worker process,
where ``self.model_runner`` is the worker's model runner.
"""

from __future__ import annotations

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
    """Worker mixin: receive named tensors (HF names) in buckets, then load them all at once.

    Loading uses the model runner's ``reload_weights(weights_iterator=...)`` where vLLM has it
    (0.2x+: it undoes and redoes the post-load processing, e.g. the CPU backend's repacked linear
    weights, whose parameters no longer carry a ``weight_loader``), else ``model.load_weights``.
    """

    def portrl_stage_weights(self, packed_tensors: list[Any]) -> int:
        """Keep one bucket of :func:`pack_tensor` tuples until :meth:`portrl_commit_weights`."""
        staged = self.__dict__.setdefault("_portrl_staged", [])
        staged.extend(unpack_tensor(p) for p in packed_tensors)
        return len(staged)

    def portrl_commit_weights(self) -> int:
        """Load every staged tensor into the running model; returns how many were loaded."""
        weights = self.__dict__.pop("_portrl_staged", [])
        runner = self.model_runner  # type: ignore[attr-defined]
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=iter(weights))
        else:
            runner.model.load_weights(weights=weights)
        return len(weights)
