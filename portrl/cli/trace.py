"""``portrl trace RUN [--step N | --last] [--rows K]``: the traces a run wrote (``trainer.trace_freq``:
portrl/trainer/traces.py) shown readably in the terminal.

For each trajectory of the chosen step (default, or ``--last``: the last traced step), in row order (``--rows K``:
the first K): a header (step, row, data source, score, turns), then each message under its role (prompt, system,
user, assistant, tool), indented, long lines wrapped to the terminal; an assistant's tool calls read
``-> name(arguments)``. The prompt is shown when the conversation does not begin with it (a single-turn trace, or a
multi-turn trace that starts at the model's first turn).

Bad input, one line and exit code 2: RUN not a run folder, a run without traces (how to turn them on), a step with
no traces (the traced steps are listed), ``--rows`` below 1.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any, Dict, List

from portrl.errors import UserError

from portrl.trainer.traces import TRACES_FILE, read_traces

RUN_MARKERS = ("run.json", "metrics.jsonl", TRACES_FILE)
INDENT = "    "


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a run's output directory (trainer.output_dir)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, metavar="N", help="the traced step to show (default: the last traced step)")
    which.add_argument("--last", action="store_true", help="the last traced step (the default)")
    parser.add_argument("--rows", type=int, metavar="K",
                        help="show the first K trajectories of the step (default: all traced)")


def _load(run_dir: Path) -> List[Dict[str, Any]]:
    """The trace records of ``run_dir``; UserError when it is no run folder or holds no traces."""
    if not run_dir.is_dir() or not any((run_dir / m).exists() for m in RUN_MARKERS):
        raise UserError(f"{run_dir} is not a portrl run folder (no run.json or metrics.jsonl); give a run's "
                        "trainer.output_dir")
    path = run_dir / TRACES_FILE
    records = read_traces(path) if path.is_file() else []
    if not records:
        raise UserError(f"{run_dir} holds no traces ({TRACES_FILE} is missing or empty); run with "
                        "trainer.trace_freq=N to write the decoded turns of trainer.trace_rows trajectories every "
                        "N steps")
    return records


def _steps_text(steps: List[int]) -> str:
    shown = [str(s) for s in steps[:20]]
    return ", ".join(shown) + (f" ... {steps[-1]} ({len(steps)} steps)" if len(steps) > 20 else "")


def select(records: List[Dict[str, Any]], step: int | None, rows: int | None) -> List[Dict[str, Any]]:
    """The records of ``step`` (None: the last traced step), in row order, the first ``rows`` of them."""
    if rows is not None and rows < 1:
        raise UserError(f"--rows={rows} must be >= 1 (the number of trajectories to show)")
    steps = sorted({int(r.get("step", 0)) for r in records})
    want = steps[-1] if step is None else int(step)
    chosen = sorted((r for r in records if int(r.get("step", 0)) == want), key=lambda r: int(r.get("row", 0)))
    if not chosen:
        raise UserError(f"no traces of step {want}; traced steps: {_steps_text(steps)}")
    return chosen[:rows] if rows is not None else chosen


def _call_text(call: Any) -> str:
    """``name(arguments)`` of one tool call (OpenAI's ``{"function": {...}}`` or a bare ``{"name", "arguments"}``)."""
    if not isinstance(call, dict):
        return str(call)
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return f"{fn.get('name', '?')}({args})"
    if isinstance(args, dict):
        inner = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
    else:
        inner = json.dumps(args, ensure_ascii=False)
    return f"{fn.get('name', '?')}({inner})"


def _wrap(text: str, width: int) -> List[str]:
    """``text`` indented, each of its lines wrapped to ``width`` columns (blank lines kept)."""
    out: List[str] = []
    for line in str(text).splitlines() or [""]:
        out += textwrap.wrap(line, width=width, initial_indent=INDENT * 2, subsequent_indent=INDENT * 2,
                             replace_whitespace=False, drop_whitespace=True, break_on_hyphens=False) or [""]
    return out


def _score_text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "-"


def render(record: Dict[str, Any], width: int) -> List[str]:
    """The lines showing one trajectory (module docstring)."""
    turns = record.get("num_turns")
    head = (f"step {record.get('step')} | row {record.get('row')} | {record.get('data_source') or '-'} | "
            f"score {_score_text(record.get('score'))}")
    if "acc" in record:
        head += f" | acc {_score_text(record.get('acc'))}"
    head += f" | {turns} turn{'' if turns == 1 else 's'}"
    lines = ["=" * 3 + " " + head + " " + "=" * max(3, width - len(head) - 5)]
    messages = [m for m in record.get("messages") or [] if isinstance(m, dict)]
    if record.get("prompt") is not None and not (messages and messages[0].get("role") in ("system", "user")):
        messages = [{"role": "prompt", "content": record["prompt"]}] + messages
    for m in messages:
        role = str(m.get("role", "?"))
        lines.append(INDENT + (f"{role} ({m['name']})" if m.get("name") else role))
        if m.get("content") not in (None, ""):
            lines += _wrap(m["content"], width)
        for call in m.get("tool_calls") or []:
            lines += _wrap("-> " + _call_text(call), width)
    return lines


def run(args) -> int:
    records = _load(Path(args.run_dir))
    chosen = select(records, None if args.last else args.step, args.rows)
    width = max(40, min(120, shutil.get_terminal_size((100, 24)).columns))
    for i, record in enumerate(chosen):
        if i:
            print()
        print("\n".join(render(record, width)))
    return 0
