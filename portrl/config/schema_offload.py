"""The memory levers of a trained model (part of the structured config of portrl/config/schema.py).

What each part is and which phases it lowers: portrl/workers/offload.py and docs/performance.md; ``portrl plan``
prints their effect on a run's peaks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OffloadConfig:
    """Parts of a trained model kept in host memory between the calls that use them (verl's ``fsdp_config``
    ``param_offload`` / ``optimizer_offload`` and ``enable_activation_offload`` are aliases)."""

    params: bool = False  # the float32 weights the optimizer steps (FSDP2's shards, or a 16-bit run's masters)
    optimizer: bool = False  # AdamW's moments: on the device only for the update and the checkpoint
    activations: bool = False  # a training forward's saved tensors wait in host memory until backward reads them
