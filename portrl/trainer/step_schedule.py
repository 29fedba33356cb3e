"""When the RL loop saves a checkpoint and what it does when training diverges (the loop: portrl.trainer.rl_trainer).

After step ``s``'s metrics are logged (a run killed in between resumes from the checkpoint before, never past an
unlogged step), :meth:`StepSchedule.end_step` decides, in this order:

* divergence: when ``trainer.max_nonfinite_steps`` (> 0) steps in a row had their update skipped for a non-finite
  loss or gradient norm, the run stops at once, without a checkpoint of step ``s``: the checkpoints that hold the
  diverged weights are renamed ``global_step_N.diverged`` and :class:`~portrl.trainer.divergence.TrainingDiverged`
  names the newest one left (portrl.trainer.divergence, whose :class:`DivergenceWatch` counts the streak);
* a checkpoint is due after step ``s`` when ``trainer.save_freq`` > 0 divides ``s``, when ``s`` is the last step
  (``trainer.total_steps``) and ``trainer.save_final`` is set, or when an earlier one was put off;
* put off: a due checkpoint of a step whose update was skipped (the streak goes on) waits for the next step whose
  update is taken, so that rotation (``trainer.max_ckpt_to_keep``) keeps the checkpoints from before the streak; at
  the last step the run ends without it. Both say so in a warning;
* a stop asked for by SIGINT / SIGTERM saves the finished step when ``trainer.save_on_interrupt`` is set, put off or
  not (the save itself writes nothing from non-finite weights: RLTrainer.save_checkpoint).

The seconds a save took are logged with the next step's metrics (``timing_s/save``), with the divergence counts
(:meth:`StepSchedule.metrics`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Optional

from portrl.trainer.divergence import DivergenceWatch

if TYPE_CHECKING:  # annotations only
    from portrl.trainer.checkpoint import CheckpointManager

log = logging.getLogger(__name__)


class StepSchedule:
    """The checkpoint cadence and the divergence stop of one run (module docstring). ``watch`` counts the skipped
    updates over the run (a resumed run's earlier steps included); ``ckpt`` is the run's CheckpointManager."""

    def __init__(self, watch: DivergenceWatch, ckpt: Optional[CheckpointManager], *, total_steps: int, save_freq: int, save_final: bool,
                 save_on_interrupt: bool):
        self.watch = watch
        self.ckpt = ckpt
        self.total_steps = int(total_steps)
        self.save_freq = int(save_freq)
        self.save_final = bool(save_final)
        self.save_on_interrupt = bool(save_on_interrupt)
        self.owed = False  # a checkpoint put off at a step whose update was skipped
        self.pending: Dict[str, float] = {}  # what the last save reports with the next step

    def metrics(self, step: int, metrics: Dict[str, float]) -> None:
        """Add to step ``step``'s ``metrics`` the seconds of the save after the step before and the divergence counts
        (DivergenceWatch.observe)."""
        metrics.update(self.pending)
        self.pending = {}
        metrics.update(self.watch.observe(step, metrics))

    def end_step(self, step: int, stop_requested: bool, save: Callable[[], Optional[Path]]) -> Optional[Path]:
        """After step ``step``'s metrics are logged: raise TrainingDiverged when the run diverged, else call ``save``
        when a checkpoint is due (``stop_requested``: a signal asked the run to stop). Returns what ``save``
        returned (None: nothing due, or no checkpoint written)."""
        if self.watch.diverged:
            raise self.watch.stop(self.ckpt)
        last = step == self.total_steps
        due = (self.save_freq > 0 and step % self.save_freq == 0) or (last and self.save_final) or self.owed
        self.owed = due and bool(self.watch.streak)
        if self.owed:
            log.warning("checkpoint of step %d put off: its update was skipped (a non-finite loss or gradient "
                        "norm); %s", step, "the run ends without it" if last else
                        "it is written at the next step whose update is taken")
        if not ((due and not self.owed) or (stop_requested and self.save_on_interrupt)):
            return None
        began = time.perf_counter()
        path = save()
        self.pending["timing_s/save"] = time.perf_counter() - began
        return path


__all__ = ["StepSchedule"]
