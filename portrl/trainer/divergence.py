"""A run whose training diverges stops with one line naming the checkpoint to resume from.

Three signs of divergence, each handled once:

* a non-finite loss or gradient norm: the shared update loop skips that optimizer step and reports
  ``<role>/nonfinite_skipped`` (roles: ``actor``, ``critic``, ``reward_model``: PRIME's implicit PRM;
  portrl.workers.update_loop). :class:`DivergenceWatch` adds ``<role>/nonfinite_skipped_total`` (over the whole run,
  a resumed run's earlier steps included) and ``train/nonfinite_streak`` (steps in a row with a skipped update) to
  each step's metrics. A step counts for the streak when any of its optimizer steps was skipped; a step whose updates
  were all taken ends it; a step without an update (dynamic sampling found no group, the critic's warm-up) leaves it
  as it is. After ``trainer.max_nonfinite_steps`` such steps in a row (0 = never) the run stops;
* logits that are not finite in a rollout or a validation (portrl.rollout.sampling.NonFiniteLogitsError): the
  weights the policy has now diverged (finite weights can overflow the forward: one AdamW step at lr=1e20 leaves
  weights near 1e16, whose loss at that step was finite); the run stops at once;
* weights that are not finite when a checkpoint is due: no checkpoint is written (:func:`nonfinite_roles`, asked
  of every worker, each checking its own weights or shards), with a warning.

Which checkpoints hold the diverged weights: a streak that starts at step ``s`` had its updates skipped because the
weights of step ``s-1`` (the last update taken) gave non-finite losses on every batch since, so every checkpoint of
step ``s-1`` or later holds them; logits that are not finite after step ``k`` condemn the checkpoints of step ``k``
on. A checkpoint due at a step whose update was skipped is put off to the next step whose update is taken
(portrl.trainer.rl_trainer), so that rotation (``trainer.max_ckpt_to_keep``) keeps the checkpoints from before a
streak. On the stop those are renamed ``global_step_N.diverged`` (kept for a look, never resumed from), so that
``trainer.resume=auto`` starts from the newest checkpoint left, which the one line names (:class:`TrainingDiverged`,
a UserError: exit code 2, no traceback; the metrics of the finished steps are already in metrics.jsonl).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Protocol

from portrl.errors import UserError

if TYPE_CHECKING:  # annotations only: this module stays free of the worker group's imports
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)

#: the roles whose updates report ``<role>/nonfinite_skipped``, and the learning rate that drives each
ROLES = (("actor", "actor.optim.lr"), ("critic", "critic.optim.lr"), ("reward_model", "reward_model.model.optim.lr"))
SUFFIX = ".diverged"


class TrainingDiverged(UserError):
    """The run stopped because its training diverged; the message names the checkpoint to resume from."""


class DivergenceWatch:
    """Counts the steps whose update was skipped for a non-finite loss or gradient norm (module docstring).
    ``earlier``: the metrics records of a resumed run's steps so far (their counts carry on)."""

    def __init__(self, max_steps: int, earlier: Iterable[Mapping[str, Any]] = ()):
        self.max_steps = int(max_steps)
        self.totals: Dict[str, float] = {}
        self.streak: List[int] = []  # the steps of the current streak
        self.roles: List[str] = []  # the roles that skipped an update in it
        for record in earlier:
            if int(record.get("step", 0)) > 0:
                self._count(int(record["step"]), record)

    def _count(self, step: int, metrics: Mapping[str, Any]) -> None:
        skipped = {role: float(metrics[f"{role}/nonfinite_skipped"]) for role, _ in ROLES
                   if metrics.get(f"{role}/nonfinite_skipped") is not None}
        if not skipped:  # no update this step
            return
        for role, n in skipped.items():
            self.totals[role] = self.totals.get(role, 0.0) + n
        bad = [role for role, n in skipped.items() if n > 0]
        if bad:
            self.streak.append(step)
            self.roles += [r for r in bad if r not in self.roles]
        else:
            self.streak, self.roles = [], []

    def observe(self, step: int, metrics: Mapping[str, Any]) -> Dict[str, float]:
        """Count step ``step``'s metrics; returns the metrics to log with them (the running counts)."""
        self._count(step, metrics)
        out = {f"{role}/nonfinite_skipped_total": n for role, n in self.totals.items()}
        out["train/nonfinite_streak"] = float(len(self.streak))
        return out

    @property
    def diverged(self) -> bool:
        """Whether ``max_steps`` (> 0) steps in a row had a skipped update."""
        return self.max_steps > 0 and len(self.streak) >= self.max_steps

    def stop(self, ckpt: Any) -> TrainingDiverged:
        """The error that ends a run whose streak reached ``max_steps``, after the checkpoints of the weights that
        gave those losses were set aside (:func:`diverged_stop`)."""
        first, last = self.streak[0], self.streak[-1]
        steps = f"steps {first}-{last} in a row" if last > first else f"step {first}"
        roles = ", ".join(self.roles)
        what = (f"{steps} had a non-finite loss or gradient norm ({roles}), so their updates were skipped "
                f"(trainer.max_nonfinite_steps={self.max_steps})")
        lr = [key for role, key in ROLES if role in self.roles]
        return diverged_stop(ckpt, first - 1, what, lr)


def logits_stop(ckpt: Any, step: int, exc: BaseException) -> TrainingDiverged:
    """The error that ends a run whose policy gave non-finite logits (``exc``, a NonFiniteLogitsError, raised in a
    worker) while it held the weights of step ``step`` (0: the starting weights)."""
    cause = getattr(exc, "cause", None) or exc  # a Ray task error carries the worker's own exception
    decode = getattr(cause, "step", None)
    weights = f"the weights after step {step}'s update" if step > 0 else "the starting weights"
    what = (f"the policy's logits are not finite (NaN or inf{'' if decode is None else f' at decode step {decode}'}) "
            f"with {weights}")
    return diverged_stop(ckpt, step, what, ["actor.optim.lr"])


def diverged_stop(ckpt: Any, bad_from: int, what: str, lr_keys: List[str]) -> TrainingDiverged:
    """Rename the checkpoints of step ``bad_from`` and later (they hold the diverged weights) to
    ``global_step_N.diverged`` and return the one-line error naming the newest intact checkpoint left."""
    moved = set_aside(ckpt, bad_from)
    good: Optional[Path] = ckpt.latest_valid() if ckpt is not None else None
    aside = f" ({', '.join(moved)} hold{'s' if len(moved) == 1 else ''} the diverged weights)" if moved else ""
    lower = " / ".join(lr_keys) or "the learning rate"
    then = ("resume from it (trainer.resume=auto)" if good is not None
            else "start again (trainer.resume=auto starts over when there is no checkpoint)")
    return TrainingDiverged(f"training diverged: {what}; last good checkpoint: "
                            f"{good if good is not None else 'none'}{aside}; lower {lower} and {then}")


def set_aside(ckpt: Any, bad_from: int) -> List[str]:
    """Rename every checkpoint of step ``bad_from`` or later under ``ckpt`` (a CheckpointManager) to
    ``global_step_N.diverged`` (``.diverged-2``, ... when taken); returns the new names."""
    moved = []
    for step, path in (ckpt.checkpoints() if ckpt is not None else []):
        if step < bad_from:
            continue
        target = path.with_name(path.name + SUFFIX)
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}{SUFFIX}-{n}")
        path.rename(target)
        log.warning("checkpoint %s holds diverged weights: renamed to %s", path, target.name)
        moved.append(target.name)
    return moved


class ChecksWeights(Protocol):
    """What :func:`nonfinite_roles` asks of a trained worker (portrl.workers.trained_model.TrainedModelWorker)."""

    def weights_finite(self) -> bool: ...


class TrainedRoles(Protocol):
    """What :func:`nonfinite_roles` reads of a run (an RLTrainer is one): its trained worker groups, None where the
    run has no such role (``prm``: PRIME's phase, whose ``group`` is the implicit PRM's workers)."""

    @property
    def actor(self) -> WorkerGroup[ChecksWeights]: ...

    @property
    def critic(self) -> Optional[WorkerGroup[ChecksWeights]]: ...

    prm: Optional[Any]


def nonfinite_roles(trainer: TrainedRoles) -> List[str]:
    """The roles (actor, critic, reward_model) whose trained weights are not all finite on some worker: every worker
    checks its own (``weights_finite``: one fused check, portrl.workers.master_weights.MasterWeights.finite)."""
    prm = trainer.prm
    groups = (("actor", trainer.actor), ("critic", trainer.critic),
              ("reward_model", prm.group if prm is not None else None))
    return [role for role, group in groups
            if group is not None and not all(group.gather(ChecksWeights.weights_finite))]


__all__ = ["DivergenceWatch", "TrainingDiverged", "diverged_stop", "logits_stop", "nonfinite_roles", "set_aside"]
