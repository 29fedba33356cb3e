"""Collecting the results of Ray actor calls, naming the worker that failed.

:func:`wait_results` waits on ``(group, rank, ObjectRef)`` items; ``group`` is anything with ``describe(rank)``,
``shutdown()``, ``info`` and ``timeout_s`` (a :class:`~portrl.workers.group.WorkerGroup`). Shared by the Ray
launcher (portrl.workers.ray_launcher) and the weight-sync link, so neither imports the other for it.

A time limit (``timeout_s``, or the smallest ``timeout_s`` attribute of the groups involved; None = none) bounds
the wait for the whole call: when it passes with results missing, :class:`WorkerTimeoutError` names the
workers that did not answer (a process found stopped, e.g. by SIGSTOP, is named first and marked so) and the
groups are shut down, as for a dead worker. While waiting, a local Ray whose own processes have ended (a
SIGTERM sent to the whole process group reaches them) raises WorkerDiedError: no answer can come. This check
runs between 1 s waits; when Ray's own client blocks inside a wait instead (seen on a loaded 2-core machine),
Ray ends the driver itself once its GCS has been unreachable for 60 s.
"""

from __future__ import annotations

import os
import time
from typing import Any, List, Optional, Sequence


class WorkerDiedError(RuntimeError):
    """A worker process of a group died. ``worker`` names it (role, rank, node, pid); ``cause`` is Ray's error;
    ``checkpoint`` is the last good checkpoint, added by the controller with :meth:`with_checkpoint`."""

    def __init__(self, worker: str, cause: BaseException | str, checkpoint: Optional[str] = None):
        self.worker, self.cause, self.checkpoint = worker, cause, checkpoint
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        tail = (f"; resume from the last good checkpoint {checkpoint}" if checkpoint
                else "; no checkpoint was written yet" if checkpoint == "" else "")
        super().__init__(f"worker {worker} died ({type(cause).__name__}: {first}){tail}")

    def with_checkpoint(self, path: Optional[str]) -> "WorkerDiedError":
        """The same error with the last good checkpoint named (``None`` -> "no checkpoint was written yet")."""
        return WorkerDiedError(self.worker, self.cause, str(path) if path else "")


class WorkerTimeoutError(WorkerDiedError):
    """Workers gave no answer within the time limit (``trainer.worker_timeout_s``); ``worker`` names them."""

    def __init__(self, worker: str, cause: BaseException | str, checkpoint: Optional[str] = None):
        self.worker, self.cause, self.checkpoint = worker, cause, checkpoint
        tail = (f"; resume from the last good checkpoint {checkpoint}" if checkpoint
                else "; no checkpoint was written yet" if checkpoint == "" else "")
        RuntimeError.__init__(self, f"worker {worker} stopped answering: {cause}{tail}")

    def with_checkpoint(self, path: Optional[str]) -> "WorkerTimeoutError":
        return WorkerTimeoutError(self.worker, self.cause, str(path) if path else "")


def process_state(pid: Any) -> Optional[str]:
    """The state letter of a process on this machine (``/proc/<pid>/stat``: R, S, D, T = stopped, Z, ...),
    None when it cannot be read (another node, no procfs, gone)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError, TypeError):
        return None


def _pid_of(group: Any, rank: int) -> Any:
    info = getattr(group, "info", None) or []
    return info[rank].get("pid") if rank < len(info) and isinstance(info[rank], dict) else None


def _shutdown_all(items: Sequence[tuple]) -> None:
    for g in {id(g): g for g, _, _ in items}.values():
        g.shutdown()


def _timeout_error(items: Sequence[tuple], missing: List[int], timeout_s: float, method: str) -> WorkerTimeoutError:
    """Name the workers that did not answer; one whose process is found stopped (SIGSTOP, a debugger) first."""
    stopped: List[str] = []
    others: List[str] = []
    for i in missing:
        group, rank, _ = items[i]
        pid = _pid_of(group, rank)
        is_stopped = pid is not None and pid != os.getpid() and process_state(pid) == "T"
        (stopped if is_stopped else others).append(group.describe(rank))
    named = stopped + others
    what = f"`{method}`" if method else "a call"
    state = "its process is stopped (SIGSTOP or a debugger); " if stopped else ""
    rest = f"; no answer either from {'; '.join(named[1:])}" if len(named) > 1 else ""
    return WorkerTimeoutError(named[0], f"{state}no result from {what} within {timeout_s:.0f}s "
                                        f"(trainer.worker_timeout_s{rest})")


POLL_S = 1.0  # how often a wait checks that the local Ray is still running


def local_ray_alive() -> bool:
    """False when this process started a local Ray whose own processes (raylet, GCS, ...) have exited."""
    import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

    node = getattr(ray._private.worker, "_global_node", None)
    for procs in (getattr(node, "all_processes", None) or {}).values():
        for info in procs:
            proc = getattr(info, "process", None)
            if proc is not None and proc.poll() is not None:
                return False
    return True


def _describe_missing(items: Sequence[tuple], pending: dict) -> str:
    return "; ".join(items[i][0].describe(items[i][1]) for i in sorted(pending.values()))


def _limit(items: Sequence[tuple], timeout_s: Optional[float]) -> Optional[float]:
    if timeout_s is not None:
        return float(timeout_s) if timeout_s > 0 else None
    limits = [float(t) for g, _, _ in items if (t := getattr(g, "timeout_s", None)) is not None and t > 0]
    return min(limits) if limits else None


def wait_results(items: Sequence[tuple], timeout_s: Optional[float] = None, method: str = "",
                 watch: Sequence[tuple] = ()) -> List[Any]:
    """Results of ``(group, rank, ObjectRef)`` items, in order. The first dead actor raises WorkerDiedError
    naming it (its group is shut down: the others' collectives cannot complete); the first failing call
    re-raises the worker's error with the worker named in a note. Past the time limit (module docstring)
    :class:`WorkerTimeoutError` names the workers still missing (``method`` names the call in the message).
    ``watch``: more ``(group, rank, ObjectRef)`` of calls that never return while their worker lives (a rollout
    worker's weight listener): not waited for, but one that ends (its worker died, or it raised) is raised the same
    way, and one that returns is an error."""
    import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

    everything = list(items) + list(watch)
    pending = {ref: i for i, (_, _, ref) in enumerate(everything)}
    results: List[Any] = [None] * len(everything)
    limit = _limit(items, timeout_s)
    deadline = None if limit is None else time.monotonic() + limit
    items = everything
    waiting = len(everything) - len(watch)  # results still missing among the calls waited for
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S if left is None else min(left, POLL_S))
        if not ready and deadline is not None and limit is not None and time.monotonic() >= deadline:
            err = _timeout_error(items, sorted(pending.values()), limit, method)
            _shutdown_all(items)
            raise err
        if not ready and not local_ray_alive():  # no answer can come; and removing a pool would wait forever
            raise WorkerDiedError(_describe_missing(items, pending), RuntimeError(
                "Ray's own processes on this node (raylet, GCS) have ended; a signal sent to the whole process "
                "group reaches them too"))
        for ref in ready:
            i = pending.pop(ref)
            group, rank, _ = items[i]
            try:
                results[i] = ray.get(ref)
                if i >= len(items) - len(watch):
                    raise RuntimeError(f"the weight listener of {group.describe(rank)} ended")
                waiting -= 1
            except ray.exceptions.RayActorError as exc:
                died = WorkerDiedError(group.describe(rank), exc)
                _shutdown_all(items)
                raise died from exc
            except Exception as exc:
                dead = _dead_peer(items, pending)  # a collective that failed because a peer died: name the peer
                if dead is not None:
                    _shutdown_all(items)
                    raise dead from exc
                if hasattr(exc, "add_note"):
                    exc.add_note(f"raised by worker {group.describe(rank)}")
                raise
    return results[:len(items) - len(watch)]


#: how long a failed call waits for the other calls to show whether a peer died (Ray notices a dead actor in ms)
PEER_GRACE_S = 5.0


def _dead_peer(items: Sequence[tuple], pending: dict, grace_s: float = PEER_GRACE_S) -> Optional[WorkerDiedError]:
    """A WorkerDiedError for a worker among the ``pending`` calls that died, found within ``grace_s``, else None:
    when one rank's collective fails because a peer was killed (gloo's "Connection reset by peer"), the cause
    to report is the dead peer, not the survivor's error."""
    import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

    if not pending:
        return None
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        group, rank, _ = items[pending[ref]]
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return WorkerDiedError(group.describe(rank), exc)
        except Exception:  # another rank's own error: not a death
            continue
    return None
