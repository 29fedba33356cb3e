"""The data tasks portrl knows, one record each: the one list that `portrl preprocess`, the data presets, the
preflight, the trainer's resources and ``portrl sft`` read instead of comparing task names.

A :class:`Task` says whether its rows are generated (no raw input, no ``data.train_files``; the options of the
generator are the config section ``data.<name>``), where its preprocessing converter is, which `portrl preprocess`
options it takes, whether it has built-in SFT rows (the SFT warm start, ``portrl sft`` without files,
``portrl preprocess <task> --sft``) and whether ``data=<name>`` is a data preset (``configs/data/<name>.yaml``).

Functions are named as ``"module:attribute"`` and imported when used, so that this module imports nothing heavy
(``portrl preprocess --help`` lists the task names without loading pyarrow or torch). To add a task: a converter
(``convert(records, split, **options) -> rows``, see ``portrl/data/gsm8k.py``) and a line in :data:`TASKS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Protocol

from portrl.errors import UserError


@dataclass(frozen=True)
class Task:
    """One data task.

    ``rows`` / ``sft_rows``: ``"module:function"`` of the generator of RL rows / SFT rows (prompt + response: a
    string, or the conversation after the prompt as chat messages, portrl/data/sft_encode.py), called as
    ``f(n, seed, difficulty, split, **kw)``; ``rows`` set = a generated task. ``converter``:
    ``"module:function"`` turning raw records into verl rows (a task read from files). ``options``: the
    `portrl preprocess` options the task takes -> the keyword its converter receives. ``default_input``:
    ``"module:attribute"`` of the raw input used when ``--input`` is not given. ``preset``: ``data=<name>`` is a
    data preset."""

    name: str
    rows: Optional[str] = None
    sft_rows: Optional[str] = None
    converter: Optional[str] = None
    options: Mapping[str, str] = field(default_factory=dict)
    default_input: Optional[str] = None
    preset: bool = False

    @property
    def generated(self) -> bool:
        """Its rows are generated: it reads no input file."""
        return self.rows is not None

    def generate(self, n: int, seed: int, difficulty: int, split: str, **kw: Any) -> list:
        """``n`` generated RL rows of ``split`` (a generated task only)."""
        return _load(self.rows, self.name, "rows")(n, seed, difficulty, split, **kw)

    def generate_sft(self, n: int, seed: int, difficulty: int, split: str, **kw: Any) -> list:
        """``n`` built-in SFT rows (prompt messages + response) of ``split`` (a task with ``sft_rows``)."""
        return _load(self.sft_rows, self.name, "sft_rows")(n, seed, difficulty, split, **kw)

    def convert(self) -> Callable[..., list]:
        """The converter of raw records (a task read from files)."""
        return _load(self.converter, self.name, "converter")

    @property
    def generator_version(self) -> int:
        """``GENERATOR_VERSION`` of the module of its generator (0 when it declares none): a key of the cached
        generated files, so that a changed generator rebuilds them (a generated task only)."""
        return int(getattr(importlib.import_module(str(self.rows).split(":")[0]), "GENERATOR_VERSION", 0))

    def builtin_input(self) -> Any:
        """The raw input used without ``--input`` (None when the task needs one)."""
        return _load(self.default_input, self.name, "default_input") if self.default_input else None


_QA_OPTIONS = {k: k for k in ("data_source", "question_key", "answer_key", "instruction", "system")}

#: every task, in the order `portrl preprocess` lists them
TASKS: Dict[str, Task] = {t.name: t for t in (
    Task("gsm8k", converter="portrl.data.gsm8k:convert", preset=True),
    Task("math", converter="portrl.data.hendrycks_math:convert", options={"difficulty": "max_level"}, preset=True),
    Task("dapo_math", converter="portrl.data.dapo_math:convert", preset=True),
    Task("arith", rows="portrl.data.arith:make_arith_rows", sft_rows="portrl.data.arith:make_arith_sft_rows",
         options={"difficulty": "difficulty"}, preset=True),
    Task("arith_tool", rows="portrl.data.arith_tool:make_arith_tool_rows",
         sft_rows="portrl.data.arith_tool:make_arith_tool_sft_rows", options={"difficulty": "difficulty"}, preset=True),
    Task("wordprob", rows="portrl.data.wordprob:make_wordprob_rows", sft_rows="portrl.data.wordprob:make_wordprob_sft_rows",
         options={"difficulty": "difficulty"}, preset=True),
    Task("code", converter="portrl.data.code:convert", options={"data_source": "data_source"},
         default_input="portrl.data.code:BUILTIN_PROBLEMS", preset=True),
    Task("qa", converter="portrl.data.qa:convert", options=_QA_OPTIONS),
    Task("geo3k", converter="portrl.data.geo3k:convert", preset=True),
)}
TASK_NAMES = tuple(TASKS)


def get_task(name: str) -> Task:
    """The task named ``name``; a UserError listing the tasks when there is none."""
    task = TASKS.get(str(name))
    if task is None:
        raise UserError(f"unknown task {name!r}; valid: {', '.join(TASK_NAMES)}")
    return task


class _DataName(Protocol):
    @property
    def name(self) -> str: ...


class DataRun(Protocol):
    """What the look-ups by a run config read: ``data.name`` (portrl.config.schema.PortRLConfig is one; this floor
    sits below the config's, so it names no schema class)."""

    @property
    def data(self) -> _DataName: ...


def data_task(cfg: DataRun) -> Optional[Task]:
    """The task of a run config's ``data.name``; None for a name that is no task (``custom``: files given)."""
    return TASKS.get(str(cfg.data.name))


def generated_task(cfg: DataRun) -> Optional[Task]:
    """The task whose rows a run of ``cfg`` generates (``data.name`` a generated task), else None."""
    task = data_task(cfg)
    return task if task is not None and task.generated else None


def builtin_sft_task(cfg: DataRun) -> Optional[Task]:
    """The task of ``data.name`` when it has built-in SFT rows (the warm start's data), else None."""
    task = data_task(cfg)
    return task if task is not None and task.sft_rows is not None else None


def names_where(predicate: Callable[[Task], bool]) -> str:
    """The names of the tasks for which ``predicate`` holds, comma-separated (for messages)."""
    return ", ".join(t.name for t in TASKS.values() if predicate(t))


def _load(ref: Optional[str], task: str, what: str) -> Any:
    if not ref:
        raise ValueError(f"task {task!r} has no {what}")
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
