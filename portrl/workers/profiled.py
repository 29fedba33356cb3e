"""Profiling a worker in its own (Ray) process: portrl.trainer.profiling calls these around a profiled step."""

from __future__ import annotations

from typing import Any


class ProfiledWorker:
    """``profile_start(trace_dir, role)`` starts ``self.backend.step_profiler`` for ``<role>_rank<rank>``;
    ``profile_stop()`` ends it and writes the trace."""

    backend: Any
    rank: int
    _step_profile: Any = None

    def profile_start(self, trace_dir: str, role: str) -> None:
        self._step_profile = self.backend.step_profiler(trace_dir, f"{role}_rank{self.rank}")
        self._step_profile.__enter__()

    def profile_stop(self) -> None:
        profile, self._step_profile = self._step_profile, None
        if profile is not None:
            profile.__exit__(None, None, None)
