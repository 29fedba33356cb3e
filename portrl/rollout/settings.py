"""RolloutSettings: what a run asks of its rollout engine, in no engine's terms.

The workers build one record from the config sections (:func:`portrl.workers.rollout_worker.rollout_settings`);
the engine class chosen translates it into its own constructor options
(:meth:`portrl.rollout.engine.RolloutEngine.translate_settings`; the ``hf`` engine in
``portrl/rollout/hf_engine.py``, the engines under ``backends/`` in their own folder), and the backend then
adjusts those options (:meth:`portrl.device.backend.Backend.check_and_update_engine_options`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSettings:
    """Engine-neutral rollout settings. An engine uses what it can and ignores the rest."""

    dtype: str = "float32"  # compute dtype of a model the engine loads itself (a shared module keeps its own)
    seed: int = 0  # the engine's own random state (sampling seeds still come with SamplingParams)
    memory_fraction: float = 0.5  # share of device memory the engine may take
    tensor_parallel: int = 1  # devices one engine shards its model over
    eager: bool = False  # run without graph capture / compilation
    max_sequence_length: int | None = None  # longest prompt + response, in tokens; None = the engine's default
    max_batched_tokens: int | None = None  # token budget of one scheduler step; None = the engine's default
    sleep_between_rollouts: bool = True  # free the engine's memory between rollouts where it can
