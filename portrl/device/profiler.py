"""One training step recorded by ``torch.profiler``: the default of :meth:`Backend.step_profiler`.

``TorchStepProfiler(trace_dir, name, activities)`` is a context manager: on entry it starts
``torch.profiler.profile`` with the CPU activity plus the backend's device activities (names of
``torch.profiler.ProfilerActivity`` members, declared by each backend as ``profiler_activities``);
on exit it writes ``<trace_dir>/<name>.json``, a Chrome trace (open it in https://ui.perfetto.dev or
chrome://tracing; each phase of the step is a ``portrl/<phase>`` range), through a temporary file and a rename.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence


class TorchStepProfiler:
    def __init__(self, trace_dir: str | os.PathLike, name: str, activities: Sequence[str] = ()):
        self.path = Path(trace_dir) / f"{name}.json"
        self.activities = tuple(activities)
        self._prof: Any = None

    def __enter__(self) -> "TorchStepProfiler":
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415  (torch: the doctor runs without it)

        acts = [ProfilerActivity.CPU] + [getattr(ProfilerActivity, a) for a in self.activities]
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".json", dir=self.path.parent)
        os.close(fd)
        try:
            self._prof.export_chrome_trace(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
