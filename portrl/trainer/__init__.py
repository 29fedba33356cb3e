"""The single-controller RL loop, SFT, checkpoints and metrics.

``run_training(cfg) -> summary`` runs RL as configured (portrl.trainer.rl_trainer); ``RLTrainer`` takes a config
``settle_config(cfg)`` returned (its resources resolved, read-only: portrl.trainer.resources);
``run_sft(cfg, model, tokenizer, rows, steps, lr, batch_size)`` is the supervised warm start.
Names are resolved lazily so importing the package does no work.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run_training": "portrl.trainer.rl_trainer",
    "RLTrainer": "portrl.trainer.rl_trainer",
    "settle_config": "portrl.trainer.resources",
    "run_sft": "portrl.workers.sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'portrl.trainer' has no attribute {name!r}")
