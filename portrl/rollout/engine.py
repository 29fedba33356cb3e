"""The RolloutEngine contract every engine implements (the ``hf`` engine here; others in ``backends/``).

An engine turns prompt token ids into sampled responses with per-token log-probs
(:mod:`portrl.rollout.types` states the log-prob convention), takes the trainer's weights after
every update, and can release its memory between rollouts.
"""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from portrl.rollout.types import RolloutOutput, SamplingParams


class RolloutEngine(abc.ABC):
    """Base class of rollout engines.

    Subclasses are built by :func:`portrl.rollout.make_engine` with the keywords
    ``model``, ``model_path``, ``tokenizer``, ``backend`` plus their own options.
    """

    #: registry name ("hf", ...); set by subclasses
    name: str = ""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses for every prompt (token ids, unpadded).

        Rows come back prompt-major: row ``i * n + j`` is sample ``j`` of prompt ``i``.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights (HF parameter names) into the engine; later ``generate`` calls use them."""

    def sleep(self) -> None:
        """Free the memory the engine holds between rollouts, where it can (default: nothing to free)."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next ``generate``."""


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate prompts (a non-empty list of non-empty token-id lists) and return them as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")
        ids = [int(t) for t in p]
        if min(ids) < 0:
            raise ValueError(f"prompt {i} has a negative token id (left padding must be removed): {ids[:8]}...")
        out.append(ids)
    return out
