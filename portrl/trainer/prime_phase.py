"""PRIME's implicit-reward phase of a step: train the implicit PRM online and put its token rewards in the batch.

PRIME (Cui et al. 2025, arXiv:2502.01456; verl recipe/prime ``prime_ray_trainer.py``). Run after the outcome
reward (the rows' ``acc`` are the PRM's labels) and before the advantages, in the order of
``reward_model.model.update``:

* ``before`` (verl's default): update the PRM on the step's rows, then score them with the updated PRM;
* ``after``: score with the current PRM, then update it. verl scores with the forward of its update pass, which
  is the same scores when the rows make one PRM mini-batch (the recipe's setting); with several mini-batches, its
  later ones are scored by a PRM already stepped on the earlier ones, which portrl does not copy;
* ``none``: score only (the PRM stays as it started).

The scores: ``implicit_rewards = β·(log π_rm − log π_ref)`` on the response tokens (``β`` =
``reward_model.model.beta_train``), divided by the batch's largest absolute return-to-go with
``reward_model.prime_norm=batch_norm`` (verl normalises each data-parallel rank's share; portrl the whole batch,
the same with one worker). The ``prime`` estimator (``portrl/algo/advantages_prime.py``) reads them.

Where the PRM starts: ``reward_model.model.path`` / ``ref_path``; unset, the policy's starting weights. After an
SFT warm start those are the warm-started policy's, handed to the PRM workers at the first step of a fresh run
(a resumed run loads the PRM from its checkpoint instead: :meth:`PrimePhase.load_state_dict`).

With ``reward_model.model.loss_type=dpo`` the rows are scored once more before the update (verl's ``reverse``
order): the dpo loss compares each row with the mean of the other side of its group as scored then.

Metrics (verl's names): ``reward_model/ce_loss`` (or ``dpo_loss``: the loss of each PRM mini-batch before its optimizer step,
mean), ``reward_model/grad_norm``, ``reward_model/lr``, ``reward_model/reward`` (mean summed implicit reward after
normalisation), ``reward_model/raw_reward`` (mean summed log-ratio), ``reward_model/dpo_acc`` and
``reward_model/dpo_acc_abs`` (portrl.algo.implicit_prm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Mapping, Optional, Protocol

import torch

from portrl.algo import implicit_prm_enabled
from portrl.algo.implicit_prm import prime_batch_norm, prm_dpo_abs_accuracy, prm_dpo_accuracy, prm_dpo_others
from portrl.config.checks_mesh import mesh_replicas
from portrl.device.backend import Backend
from portrl.trainer.metrics import Timer
from portrl.trainer.resources import settled_num_workers
from portrl.workers.batch import Batch
from portrl.workers.group import WorkerGroup
from portrl.workers.implicit_prm import ImplicitPRMWorker
from portrl.workers.prm_modes import prm_mode
from portrl.workers.trained_model import TrainedModelWorker

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.workers.actor import ActorRolloutWorker


class PolicyRun(Protocol):
    """What :meth:`PrimePhase.run` reads of the run (an RLTrainer is one): the actor group, for its time limit and
    the warm-started policy's weights."""

    actor: WorkerGroup[ActorRolloutWorker]


class PrimePhase:
    """The implicit PRM's worker group and its step (:meth:`run`); its state goes into the run's checkpoints."""

    def __init__(self, cfg: PortRLConfig, backend: Backend):
        self.cfg = cfg
        self.group = WorkerGroup(ImplicitPRMWorker, cfg, settled_num_workers(cfg), backend,
                                 replicas=mesh_replicas(cfg, "reward_model.model"))
        rm = cfg.reward_model.model
        warm = bool(cfg.model.sft_warm_start)
        self.into_model, self.into_ref = warm and rm.path is None, warm and rm.ref_path is None
        self.pending_policy = self.into_model or self.into_ref  # hand the warm-started policy over at step 1

    def run(self, trainer: PolicyRun, batch: Batch, timer: Timer) -> Dict[str, float]:
        """Update (per ``reward_model.model.update``) and score: ``batch["implicit_rewards"]`` ``(B,T)``; metrics."""
        rm = self.cfg.reward_model
        self.group.timeout_s = trainer.actor.timeout_s  # the same time limit as the actor's calls
        if self.pending_policy:
            weights = trainer.actor.rank0(TrainedModelWorker.state_dict)["model"]
            self.group.run(ImplicitPRMWorker.start_from_policy, weights, self.into_model, self.into_ref)
            self.pending_policy = False
        mode = prm_mode(rm.model)  # the update and loss records (portrl/workers/prm_modes.py)
        m: Dict[str, float] = {}
        with timer("reward_model"):
            q = self._score(batch) if mode.scores_before_update else None
            if mode.update.trains:
                if mode.loss.needs_prior_scores:  # the dpo loss: each row against its group as scored before
                    assert q is not None  # needs_prior_scores implies scores_before_update
                    batch["prm_dpo_others"] = prm_dpo_others(q.sum(-1), batch.tensors["acc"].float(), batch.meta["uid"])
                m.update(self.group.metrics(ImplicitPRMWorker.update_rm, batch))
            if mode.update.score_last:
                q = self._score(batch)
        assert q is not None  # every update mode scores first or last (portrl/workers/prm_modes.py)
        rewards = q * float(rm.model.beta_train)
        if str(rm.prime_norm) == "batch_norm":
            rewards = prime_batch_norm(rewards)
        batch["implicit_rewards"] = rewards
        mask, acc = batch.tensors["response_mask"], batch.tensors["acc"].float()
        m["reward_model/reward"] = float(rewards.sum(-1).mean())
        m["reward_model/raw_reward"] = float(q.sum(-1).mean())
        m["reward_model/dpo_acc"] = prm_dpo_accuracy(rewards, acc, mask, batch.meta["uid"])
        m["reward_model/dpo_acc_abs"] = prm_dpo_abs_accuracy(rewards, acc, mask)
        return m

    def _score(self, batch: Batch) -> torch.Tensor:
        """``log π_rm − log π_ref`` ``(B,T)`` of the PRM as it is now, over all its workers."""
        return self.group.concat(ImplicitPRMWorker.compute_log_ratio, batch).tensors["implicit_log_ratio"]

    def loaded_from_checkpoint(self) -> None:
        """The PRM workers were loaded from a checkpoint (``prm``, written and read like the actor's by
        portrl/trainer/run_checkpoints.py): they do not take the policy's weights at the next step."""
        self.pending_policy = False


def build_prime_phase(cfg: PortRLConfig, backend: Backend) -> Optional[PrimePhase]:
    """The phase when the run has an implicit PRM (``reward_model.enable``, or the algorithm's record), else None."""
    return PrimePhase(cfg, backend) if implicit_prm_enabled(cfg) else None
