"""Batch sizes that follow the user's ``data.train_batch_size``, and the message when the user's sizes conflict.

The presets set ``data.train_batch_size`` (prompts per step) and ``actor.ppo_mini_batch_size`` (prompts per
optimizer step; the critic's updates use it too) together; ``reward_model.mini_batch_size`` (PRIME's PRM,
null = the actor's) may be set with them. When the user YAML or an override sets ``data.train_batch_size`` and
not a mini-batch size, :func:`follow_train_batch` sets that mini-batch size to the divisor of the user's batch
that keeps about the presets' number of optimizer steps per RL step (the tiny model's 64 / 64: one; gsm8k's
1024 / 256: four), as the preflight does when it lowers a preset's batch to a small dataset
(portrl.trainer.data_fit.fit_train_batch). So ``portrl train data.train_batch_size=4`` trains 4 prompts a step in
one mini-batch. A mini-batch size the user set is kept; one that does not divide the batch is refused by
:func:`batch_problem` with the key to set and a valid value. Micro-batch sizes (sequences or tokens per forward)
do not depend on the batch: a mini-batch smaller than one micro-batch is one micro-batch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

#: the mini-batch sizes that follow data.train_batch_size (prompts; a null one means "the actor's")
FOLLOWERS = ("actor.ppo_mini_batch_size", "reward_model.mini_batch_size")


def mini_batch_for(n: int, steps: int) -> int:
    """The divisor of ``n`` (a mini-batch size) that gives the number of mini-batches closest to ``steps``; the
    larger mini-batch on a tie."""
    return min((k for k in range(1, n + 1) if n % k == 0), key=lambda k: (abs(n // k - steps), -k))


def batch_sizes(cfg: DictConfig) -> Dict[str, Optional[int]]:
    """``data.train_batch_size`` and the :data:`FOLLOWERS` of ``cfg`` (as the presets left them; read by dotted key,
    so ``cfg`` is the container)."""
    return {k: OmegaConf.select(cfg, k) for k in ("data.train_batch_size", *FOLLOWERS)}


def follow_train_batch(cfg: DictConfig, explicit: set, preset: Dict[str, Optional[int]], origins: Any = None) -> None:
    """With ``data.train_batch_size`` in ``explicit`` (the keys the user set), each follower the user did not set,
    not null, that the presets set, is set to :func:`mini_batch_for` the user's batch and the presets' number of
    mini-batches per step (recorded in ``origins``, a :class:`portrl.config.preset_layers.Origins`). ``cfg`` is the
    container: the followers are read and set by dotted key."""
    if "data.train_batch_size" not in explicit:
        return
    batch, preset_batch = int(cfg.data.train_batch_size), int(preset["data.train_batch_size"] or 0)
    if batch < 1:
        return  # refused by the checks (must be >= 1)
    for key in FOLLOWERS:
        mini = preset.get(key)
        if key in explicit or mini is None or OmegaConf.select(cfg, key) is None or int(mini) < 1:
            continue
        new = mini_batch_for(batch, max(1, preset_batch // int(mini)))
        if new != OmegaConf.select(cfg, key):
            OmegaConf.update(cfg, key, new, merge=False)
            if origins is not None:
                origins.derived(key, new, f"following data.train_batch_size={batch}")


def batch_problem(batch: int, mini: int, key: str = "actor.ppo_mini_batch_size") -> Optional[str]:
    """The one-line problem when mini-batch size ``mini`` (of ``key``) does not divide ``batch`` prompts, naming
    the keys to set and a valid value of each; None when it divides."""
    if batch < 1 or mini < 1 or batch % mini == 0:
        return None
    divisor = max(k for k in range(1, min(batch, mini) + 1) if batch % k == 0)
    multiple = -(-batch // mini) * mini
    return (f"data.train_batch_size={batch} must be a multiple of {key}={mini} (prompts): set {key}={divisor} "
            f"(a divisor of {batch}) or data.train_batch_size={multiple}")
