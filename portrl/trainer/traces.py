"""Traces: every ``trainer.trace_freq`` steps the decoded turns of the first ``trainer.trace_rows`` trajectories of
the step's batch, appended to ``<output_dir>/traces.jsonl`` (shown by ``portrl trace RUN``: portrl/cli/trace.py).

One JSON line per trajectory, written with one ``write`` and flushed (a killed run leaves no half line)::

    {"step", "row", "uid", "data_source", "score", "acc"?, "num_turns", "prompt", "messages"}

``score`` is the row's sequence score (``seq_scores``, else the sum of ``token_level_scores``), ``prompt`` the
decoded prompt, ``messages`` the conversation: a multi-turn batch's meta ``trace`` (portrl/agent/trajectory.py:
``{"role", "content"}`` and maybe ``"tool_calls"`` / ``"name"``), or for a single-turn batch
``[{"role": "assistant", "content": <decoded response>}]`` (``num_turns`` 1). Decoding skips special tokens.

Resuming follows ``metrics.jsonl`` (portrl/trainer/tracking.py): at the run's first step, lines of steps after the
step the run resumes from (all lines on a fresh start) are dropped, the file rewritten atomically (removed when
nothing is left), so the file never mixes an abandoned continuation with the new run's; this happens whatever
``trace_freq`` is, and a launch that fails before its first step leaves the file as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from portrl.agent.trajectory import META_NUM_TURNS, META_TRACE
from portrl.trainer.tracking import _truncate_after, read_metrics, read_metrics_up_to

if TYPE_CHECKING:  # `portrl trace` reads traces without loading torch
    from portrl.workers.batch import Batch

TRACES_FILE = "traces.jsonl"


def _score(batch: Batch, i: int) -> Optional[float]:
    t = batch.tensors
    if "seq_scores" in t:
        return float(t["seq_scores"][i])
    return float(t["token_level_scores"][i].sum()) if "token_level_scores" in t else None


def trace_records(step: int, batch: Batch, rows: int, tokenizer: Any) -> List[Dict[str, Any]]:
    """The trace records (module docstring) of the first ``rows`` rows of a rollout ``batch`` at ``step``."""
    t, meta = batch.tensors, batch.meta
    width = t["prompts"].shape[1]
    attention = t["attention_mask"].bool()
    out = []
    for i in range(min(int(rows), len(batch))):
        prompt = t["prompts"][i][attention[i, :width]].tolist()
        record: Dict[str, Any] = {
            "step": int(step), "row": i, "uid": str(meta["uid"][i]) if "uid" in meta else None,
            "data_source": str(meta["data_source"][i]) if "data_source" in meta else None, "score": _score(batch, i)}
        if "acc" in t:
            record["acc"] = float(t["acc"][i])
        if META_NUM_TURNS in meta:
            record["num_turns"] = int(meta[META_NUM_TURNS][i])
            messages = list(meta[META_TRACE][i]) if META_TRACE in meta else []
        else:
            record["num_turns"] = 1
            response = t["responses"][i][attention[i, width:]].tolist()
            messages = [{"role": "assistant", "content": tokenizer.decode(response, skip_special_tokens=True)}]
        record["prompt"] = tokenizer.decode(prompt, skip_special_tokens=True)
        record["messages"] = messages
        out.append(record)
    return out


class TraceWriter:
    """Appends the trace records of every ``freq``-th step to ``<out_dir>/traces.jsonl`` (``freq`` 0: none), after
    cutting the lines of steps after ``resume_step`` at the first :meth:`observe` (module docstring)."""

    def __init__(self, out_dir: Path, freq: int, rows: int, tokenizer: Any, resume_step: int = 0):
        self.path = Path(out_dir) / TRACES_FILE
        self.freq, self.rows, self.tokenizer = int(freq), int(rows), tokenizer
        self.resume_step = int(resume_step)
        self._started = False

    def _start(self) -> None:
        self._started = True
        if not self.path.exists():
            return
        if read_metrics_up_to(self.path, self.resume_step):
            _truncate_after(self.path, self.resume_step)  # metrics.jsonl's own cut: kept lines, atomic rewrite
        else:
            self.path.unlink()

    def observe(self, step: int, batch: Optional[Batch]) -> None:
        """Called with every step's batch (None: the step trained on nothing); writes the traces of a traced step."""
        if not self._started:
            self._start()
        if batch is None or self.freq <= 0 or step % self.freq != 0:
            return
        records = trace_records(step, batch, self.rows, self.tokenizer)
        with open(self.path, "a", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
                fh.flush()


def read_traces(path: Path) -> List[Dict[str, Any]]:
    """The records of a ``traces.jsonl`` file, in file order (a torn last line is skipped, as metrics.jsonl's)."""
    return read_metrics(path)
