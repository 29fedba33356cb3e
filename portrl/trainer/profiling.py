"""``trainer.profile.steps``: record those steps with the backend's profiler, in every process that works on them.

A profiled step ``k`` writes under ``<output_dir>/profile/step_<k>/``:

* ``driver.json``: the trainer's process (with one worker per role that is the whole step: the workers run in it);
* ``<role>_rank<r>.json`` for each Ray worker (``actor``, ``critic``, ``prm``, ``rollout``: the separated rollout
  workers), from its own process;

each a Chrome trace of ``torch.profiler`` (CPU and the backend's device activities), where every phase of the step
(``gen``, ``ref``, ``adv``, ``update_actor``, ``sync``, ...) is a ``portrl/<phase>`` range; the same phases are
ranges of the vendor's range API that each backend declares (``Backend.range_api``, :meth:`Backend.range_push`), for
the vendor's system profiler. A backend with a profiler of its own writes what that profiler writes instead of a
JSON file (:meth:`Backend.step_profiler`; backends/ say which). Ray workers on other nodes write on their own node's disk at the same path.
In the asynchronous modes a separated rollout worker's trace holds what it generated during the step's window,
which is for a later step.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional

from portrl.workers.profiled import ProfiledWorker

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.device.backend import Backend
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)


class StepProfiling:
    """``groups`` returns the run's worker groups by role (None for a role the run has not)."""

    def __init__(self, cfg: PortRLConfig, backend: Backend, out_dir: Path,
                 groups: Callable[[], Mapping[str, Optional[WorkerGroup[ProfiledWorker]]]]):
        self.steps = frozenset(int(s) for s in (cfg.trainer.profile.steps or ()))
        self.backend, self.out_dir, self.groups = backend, Path(out_dir), groups

    def ranges(self, step: int) -> Optional[Backend]:
        """The backend whose range API marks the phases of ``step`` (portrl.trainer.metrics.Timer), or None."""
        return self.backend if step in self.steps else None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        trace_dir = self.out_dir / "profile" / f"step_{step}"
        remote = {role: g for role, g in self.groups().items() if g is not None and getattr(g, "use_ray", False)}
        for role, group in remote.items():
            group.run(ProfiledWorker.profile_start, str(trace_dir), role)
        try:
            with self.backend.step_profiler(trace_dir, "driver"):
                yield
        finally:
            for group in remote.values():
                group.run(ProfiledWorker.profile_stop)
        log.info("step %d profiled: %s (%s)", step, trace_dir, ", ".join(
            ["driver"] + [f"{role} x{g.num_workers}" for role, g in remote.items()]))
