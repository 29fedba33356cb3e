"""A step's time floor on one device: the config's worst step at the device's peaks (its roofline).

    update  >= executed training FLOPs x ppo_epochs / peak FLOP/s
    rollout >= max(generation FLOPs / peak FLOP/s, (weight bytes / rollout TP + KV cache bytes) / peak bytes/s)

with the counts of portrl/plan/flops.py over the device's share of the step (every prompt and response at its
longest), a prompt its ``n`` samples share counted once (the update's packed forward and the hf engine's prefill
both run it once), and the recomputed forward under gradient checkpointing. A floor, not a forecast: a run
reaches a fraction of it, which its ``perf/roofline/*`` metrics then measure (portrl/trainer/speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from portrl.device.peaks import PeakThroughput
from portrl.plan.flops import executed_train_flops, prefill_flops, rollout_flops, rollout_read_bytes
from portrl.plan.memory import Workload
from portrl.plan.shape import ModelShape

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


@dataclass(frozen=True)
class StepFloor:
    """Seconds the update and the rollout of one device's step take at least, and what bounds the rollout."""

    update_s: float
    rollout_s: float
    rollout_bound: str  # "memory reads" or "FLOPs"


def step_floor(cfg: PortRLConfig, shape: ModelShape, w: Workload, peak: PeakThroughput, dtype_bytes: int,
               checkpointing: bool) -> StepFloor:
    """The module docstring's floors for workload ``w`` (one device's share) at ``peak``."""
    seqlens = [w.prompt_len + w.response_len] * w.rows
    shared = bool(cfg.model.share_prompts) and bool(cfg.model.use_packing)
    run = sum(seqlens) - (w.rows - w.prompts) * w.prompt_len if shared else sum(seqlens)
    update = executed_train_flops(shape, seqlens, checkpointing, tokens=run) * int(cfg.actor.ppo_epochs)
    prompts, responses = [w.prompt_len] * w.rows, [w.response_len] * w.rows
    flops = rollout_flops(shape, prompts, responses) - (w.rows - w.prompts) * prefill_flops(shape, w.prompt_len)
    weights, cache = rollout_read_bytes(shape, prompts, responses, dtype_bytes)
    compute_s = flops / peak.flops_per_s
    read_s = (weights / int(cfg.rollout.tensor_model_parallel_size) + cache) / peak.bytes_per_s
    return StepFloor(update / peak.flops_per_s, max(compute_s, read_s),
                     "memory reads" if read_s >= compute_s else "FLOPs")
