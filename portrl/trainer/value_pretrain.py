"""Value pretraining (VAPO, Yue et al. 2025, arXiv 2504.05118, Sec. 3.1): before the first RL step the
critic alone trains on rollouts of the starting policy, so that the first advantages do not carry the
bias of a value head that has seen no data.

One pretraining step ``k`` (``k = 1 .. critic.pretrain_steps``)::

    prompts -> generate (the trainer's own rollout, with generation seeds of step -k) -> reward
      -> values -> returns (compute_batch_advantages: the critic's λ, Monte-Carlo for VAPO's λ = 1)
      -> explained variance of those values -> critic update (the LR schedule does not advance)

The rewards are the scores: the policy is still the reference, so a KL term in the reward is 0, and an
adaptive KL controller is not fed that zero. The actor does not change. The explained variance is
measured on each batch before the critic trains on it, so it is a held-out number. Pretraining stops
after ``critic.pretrain_steps`` steps, or as soon as the mean explained variance of the last
PRETRAIN_EV_WINDOW batches reaches ``critic.pretrain_target_ev`` (the paper trains "until value loss and
explained variance attain sufficiently low values"). It runs only on a fresh start: a resumed run's
critic comes from its checkpoint. The prompts come from the training data, which pretraining advances.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Tuple

from portrl.algo import explained_variance
from portrl.trainer.advantage_phase import compute_batch_advantages
from portrl.trainer.metrics import Timer
from portrl.workers.critic import CriticWorker

if TYPE_CHECKING:  # annotations only
    from portrl.config.schema import PortRLConfig
    from portrl.workers.batch import Batch
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)

PRETRAIN_EV_WINDOW = 10
LOG_EVERY = 100


class Rollout(Protocol):
    """The run's rollout of one step (RLTrainer's): ``(batch, metrics)``, batch None when dynamic sampling kept
    no group; generation seeds follow ``step``."""

    def __call__(self, step: int, timer: Timer, for_update: bool = True) -> Tuple[Optional[Batch], Any]: ...


def pretrain_critic(cfg: PortRLConfig, critic: WorkerGroup[CriticWorker], rollout: Rollout) -> Dict[str, float]:
    """Run value pretraining of ``critic`` (the run's critic group) on batches of ``rollout`` (the run's own,
    pretraining step ``k`` as step ``-k``), as ``cfg`` says. Returns ``critic/pretrain_steps``,
    ``critic/pretrain_ev`` (the window's mean explained variance at the end, NaN when no batch had varying
    returns) and ``critic/pretrain_time_s``."""
    steps, target = int(cfg.critic.pretrain_steps), cfg.critic.pretrain_target_ev
    recent: deque = deque(maxlen=PRETRAIN_EV_WINDOW)
    started = time.perf_counter()
    done = 0
    for k in range(1, steps + 1):
        done = k
        batch, _ = rollout(-k, Timer(), for_update=False)
        if batch is None:  # dynamic sampling kept no group
            continue
        batch.union(critic.concat(CriticWorker.compute_values, batch))
        batch["token_level_rewards"] = batch.tensors["token_level_scores"]
        compute_batch_advantages(cfg, batch)
        t = batch.tensors
        ev = float(explained_variance(t["returns"], t["values"], t["response_mask"]))
        if math.isfinite(ev):
            recent.append(ev)
        critic.metrics(CriticWorker.update_critic, batch, advance_schedule=False)
        mean = _mean(recent)
        if k % LOG_EVERY == 0:
            log.info("value pretraining: step %d/%d, explained variance %.3f (mean of the last %d batches)",
                     k, steps, mean, len(recent))
        if target is not None and len(recent) == PRETRAIN_EV_WINDOW and mean >= float(target):
            break
    return {"critic/pretrain_steps": float(done), "critic/pretrain_ev": _mean(recent),
            "critic/pretrain_time_s": time.perf_counter() - started}


def _mean(values: deque) -> float:
    return sum(values) / len(values) if values else float("nan")
