"""How a run whose loop raised ends: the one-line error to raise instead of a traceback, where there is one.

:func:`run_failure` maps what ended ``RLTrainer.fit``'s loop to the error the command prints (portrl.cli.main):

* anything, after a stop signal: the step could not finish, RunStopped naming the last good checkpoint (checked
  first: whatever failed, the user asked the run to stop);
* non-finite logits (portrl.rollout.sampling.NonFiniteLogitsError): the divergence stop
  (portrl.trainer.divergence.logits_stop), which sets aside the checkpoints of the diverged weights;
* TrainingDiverged (too many skipped updates in a row): itself;
* a worker that died: WorkerDiedError naming the last good checkpoint;
* a tool whose environment broke (portrl.agent.tools.base.ToolUnusable: the python tool's sandbox cannot start
  programs any more): RunFailed with its reason and the last good checkpoint, instead of training on error messages;
* a write that failed for want of space or permission: RunFailed (portrl.trainer.storage_faults).

In that order. Every case but the dead worker (whose group is already shut down) stops the run's workers first. Anything else
is an internal error, re-raised as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from portrl.agent.tools.base import ToolUnusable
from portrl.errors import RunFailed, RunStopped
from portrl.rollout.sampling import NonFiniteLogitsError
from portrl.trainer.checkpoint import CheckpointManager
from portrl.trainer.divergence import TrainingDiverged, logits_stop
from portrl.trainer.fault_chain import exception_chain, run_stopped_message
from portrl.trainer.interrupts import stopped_message
from portrl.trainer.storage_faults import storage_error, storage_stopped_message
from portrl.workers.group import WorkerDiedError

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


class EndingRun(Protocol):
    """What :func:`run_failure` reads of a run whose loop raised (an RLTrainer is one)."""

    cfg: PortRLConfig
    global_step: int  # the last step that finished
    ckpt: CheckpointManager

    def shutdown_workers(self) -> None: ...


def run_failure(trainer: EndingRun, exc: BaseException, stop: Any) -> Optional[BaseException]:
    """The error ``trainer`` ends with when ``exc`` ended its loop (``stop``: its StopSignals, or None); ``exc``
    itself when it is already that error, None for an internal error (see the module docstring)."""
    t = trainer.cfg.trainer
    if stop is not None and stop.requested:  # the step could not finish after the signal: abandoned
        trainer.shutdown_workers()
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        line = stopped_message(stop.name, trainer.global_step, int(t.total_steps), str(t.resume),
                               trainer.ckpt.latest_valid(), abandoned=why)
        return RunStopped("portrl: " + line, stop.exit_code)
    if isinstance(exc, NonFiniteLogitsError):  # the policy's weights diverged
        trainer.shutdown_workers()
        return logits_stop(trainer.ckpt, trainer.global_step, exc)
    if isinstance(exc, TrainingDiverged):
        trainer.shutdown_workers()
        return exc
    if isinstance(exc, WorkerDiedError):  # its group is shut down already
        latest = trainer.ckpt.latest_valid()
        return exc.with_checkpoint(str(latest) if latest else None)
    unusable = tool_unusable(exc)
    if unusable is not None:  # the python tool's sandbox stopped working: no call can work any more
        trainer.shutdown_workers()
        return RunFailed("portrl: " + tool_stopped_message(unusable, trainer.global_step, int(t.total_steps),
                                                           trainer.ckpt.latest_valid()))
    fault = storage_error(exc)
    if fault is None:
        return None
    trainer.shutdown_workers()  # disk full, read-only folder: the earlier checkpoints are intact
    return RunFailed("portrl: " + storage_stopped_message(fault, trainer.global_step, int(t.total_steps),
                                                         trainer.ckpt.latest_valid()))


def tool_unusable(exc: BaseException) -> Optional[ToolUnusable]:
    """The ToolUnusable behind ``exc`` (itself, its ``__cause__`` / ``__context__`` chain, or a Ray task error's
    ``cause``: a tool that ran in a Ray worker), else None."""
    return next((e for e in exception_chain(exc) if isinstance(e, ToolUnusable)), None)


def tool_stopped_message(exc: ToolUnusable, step: int, total: int, checkpoint: Optional[Path]) -> str:
    """One line: the tool's reason, after which step, and where the run continues from."""
    return run_stopped_message(" ".join(str(exc).split()) or type(exc).__name__, step, total, checkpoint)


__all__ = ["run_failure", "tool_stopped_message", "tool_unusable"]
