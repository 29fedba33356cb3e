"""Methods added to every vLLM worker through the engine argument ``worker_extension_cls``
(vLLM's documented route for RLHF weight updates; called with ``LLM.collective_rpc(name, args=...)``).

Imports nothing from vLLM: vLLM mixes this class into its worker class inside the worker process,
where ``self.model_runner`` is the worker's model runner.
"""

from __future__ import annotations

from typing import Any


class PortrlWeightSync:
    """Worker mixin: load named tensors (HF names) into the running model."""

    def portrl_load_weights(self, named_tensors: list[Any]) -> int:
        """``model.load_weights`` on ``[(name, tensor), ...]`` (tuples may arrive as lists); returns how many were given."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        weights = [(str(name), tensor) for name, tensor in named_tensors]
        model.load_weights(weights=weights)
        return len(weights)

    def portrl_weight_sum(self, name: str) -> float:
        """Sum of one parameter, by vLLM's (possibly fused) parameter name; for tests and debugging."""
        params = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        return float(params[name].float().sum())
