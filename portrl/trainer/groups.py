"""Worker placement for the trainer: plain in-process objects for one worker, Ray groups otherwise.

Both expose ``call(method, *args)`` (data-parallel: results combined, metric dicts reduced over ranks)
and ``call_rank0(method, *args)`` (rank 0's result of a call every rank makes: worker state for a
checkpoint). In-process either is a direct method call (no Ray, no copies: the hot path of small runs).
With ``trainer.num_workers > 1``, ``trainer.use_ray`` or a ``trainer.ray_address``,
``portrl.workers.group.WorkerGroup`` runs the same worker classes as Ray actors and splits Batch
arguments across data-parallel ranks.
"""

from __future__ import annotations

from typing import Any


class LocalGroup:
    """One worker in this process; ``call`` is ``getattr(worker, method)(*args)``."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.num_workers = 1

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The one worker's result, uncombined (as ``WorkerGroup.call_rank0``: state, never a metrics reduction)."""
        return getattr(self.worker, method)(*args, **kwargs)

    def shutdown(self) -> None:
        return None


def use_ray(cfg: Any) -> bool:
    """``trainer.use_ray`` when set, else Ray for several workers, a named cluster or separated rollout
    workers (the weight broadcast joins Ray actors)."""
    t = cfg.trainer
    separated = str(cfg.rollout.placement) == "separated"
    if t.use_ray is not None:
        if separated and not t.use_ray:
            raise ValueError("rollout.placement=separated runs rollout workers as Ray actors; "
                             "trainer.use_ray must not be false")
        return bool(t.use_ray)
    return int(t.num_workers) > 1 or bool(t.ray_address) or separated


def make_group(worker_cls: Any, cfg: Any, backend: Any):
    """The worker group for ``worker_cls`` under ``cfg`` (see the module docstring)."""
    if not use_ray(cfg):
        return LocalGroup(worker_cls(cfg, rank=0, world_size=1))
    from portrl.workers.group import WorkerGroup

    return WorkerGroup(worker_cls, cfg, int(cfg.trainer.num_workers), backend, use_ray=True)


def first(result: Any) -> Any:
    """A group call's result from rank 0 when the group returns one value per rank."""
    return result[0] if isinstance(result, list) else result
