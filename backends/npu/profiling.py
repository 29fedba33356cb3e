"""Profiling on Ascend: one step recorded by torch_npu's profiler, and phase ranges through mstx.

Written against the documented torch_npu API (Ascend Extension for PyTorch, "torch_npu.profiler" and
"torch_npu.npu.mstx"): ``torch_npu.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.NPU],
on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(dir_name, worker_name=...))`` writes its own folder
of trace data under ``dir_name`` (read with MindStudio Insight or TensorBoard's torch-tb-profiler);
``torch_npu.npu.mstx.range_start(msg, stream=None) -> int`` (0 on failure) and ``range_end(range_id)`` mark a
host-side range. Tested on the CPU with a fake torch_npu; only an Ascend machine can confirm it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

from portrl.device.backend import import_optional

INSTALL = 'pip install -e ".[npu]" (torch_npu; see backends/npu/versions.py for the rows)'
_open_ranges: List[int] = []  # ids of this process's open mstx ranges, innermost last


class NPUStepProfiler:
    """The step's trace in ``<trace_dir>/<name>/`` (torch_npu's layout, one folder per recording)."""

    def __init__(self, trace_dir: str | os.PathLike, name: str):
        self.path = Path(trace_dir) / name
        self._prof: Any = None

    def __enter__(self) -> "NPUStepProfiler":
        torch_npu = import_optional("torch_npu", INSTALL)
        prof = torch_npu.profiler
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof = prof.profile(activities=[prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU],
                                  on_trace_ready=prof.tensorboard_trace_handler(str(self.path)))
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)  # on_trace_ready writes the folder


def mstx_range_start(name: str) -> None:
    torch_npu = import_optional("torch_npu", INSTALL)
    _open_ranges.append(int(torch_npu.npu.mstx.range_start(name)))


def mstx_range_end() -> None:
    if not _open_ranges:
        return
    range_id = _open_ranges.pop()
    if range_id:  # 0: range_start failed, there is nothing to end
        import_optional("torch_npu", INSTALL).npu.mstx.range_end(range_id)
