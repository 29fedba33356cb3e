"""An RL run of the trainer in this process, its Ray worker groups shut down after it, and its logged metrics:
what the Ray trainer tests (tests/test_checkpoint_shards.py, tests/test_trainer_mesh.py) share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

VOLATILE = ("timing_s/", "perf/", "memory/")  # measurements of the machine, not of the run


def fit(cfg) -> Dict[str, Any]:
    """``RLTrainer(settle_config(cfg)).fit()``; the actor, critic and PRM groups are shut down after it."""
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(settle_config(cfg))
    try:
        return trainer.fit()
    finally:
        for group in (trainer.actor, trainer.critic, trainer.prm.group if trainer.prm is not None else None):
            if group is not None:
                group.shutdown()


def logged_metrics(out: Path) -> Dict[int, Dict[str, Any]]:
    """``metrics.jsonl`` of run folder ``out`` by step, the machine's measurements (:data:`VOLATILE`) left out."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}
