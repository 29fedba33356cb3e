"""A data preset's settings fitted to the user's own data, before a model loads (called by the preflight).

The data presets (``data=gsm8k``, ``math``, ``dapo_math``) carry the sizes of their full datasets and file
locations; a user's own files can be smaller or elsewhere. What is fitted, each with one log line:

* **Validation files.** An empty ``data.val_files`` becomes the test split written beside the training split
  (``DIR/test.parquet`` for every ``DIR/train.parquet``, as ``portrl preprocess`` writes them) when it exists;
  else validation is off. A preset's ``data.val_files`` is replaced the same way when the user named other
  ``data.train_files`` (the preset's files belong to the preset's location) or when they do not exist.
  ``data.val_files`` set by the user is kept as given (``data.val_files=[]``: validation off).
* **Batch sizes.** A ``data.train_batch_size`` (prompts per step) larger than the training rows that fit
  ``data.max_prompt_length`` is lowered to that count when it came from a preset or the defaults, and
  ``actor.ppo_mini_batch_size`` to a divisor of it that keeps about the preset's mini-batches per step; one the
  user set is refused with the key to change.
* **The SFT warm start.** ``model.sft_warm_start`` is built in for the generated rows of tasks with built-in SFT
  rows (portrl.tasks: ``data.name=arith``), run without ``data.train_files`` (:func:`warm_start_task`): with other
  data (another ``data.name``, or files of your own under the default ``data.name=arith``) a preset's ``true`` is
  turned off with a note, a user's is refused.
* **The micro-batch token budget.** ``actor.max_tokens_per_micro_batch=null`` (the ``cpu`` preset's), not set by
  the user, becomes a budget sized by the model for models of at least 100M parameters (where gradient
  checkpointing turns itself on too, ``portrl/workers/setup.py``): :func:`token_budget`. It caps every
  micro-batch of the actor's and the critic's update and log-prob passes (reference included), so a longer
  response or a larger batch adds micro-batches instead of memory. The tiny model keeps rows alone.

Whether the user set a key comes from :func:`portrl.config.composition.explicit_keys` (the user YAML and the
dotted overrides); a config it does not know is treated as all set by the user (nothing is changed).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from omegaconf import Node, read_write

from portrl.config.batch_follow import mini_batch_for
from portrl.config.composition import explicit_keys
from portrl.errors import UserError
from portrl.tasks import Task, builtin_sft_task, names_where
from portrl.trainer.data_cache import generated_files
from portrl.workers.setup import AUTO_CHECKPOINTING_PARAMS, count_parameters

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

log = logging.getLogger(__name__)
# id(config) -> (the config, notes logged for it, notes held back or None): the preflight and the trainer both
# resolve a run's files, and the preflight holds its notes until every check passed (bad input: one line)
_NOTES: dict[int, tuple[weakref.ref, set, list | None]] = {}


def _notes(cfg: PortRLConfig) -> tuple[weakref.ref, set, list | None]:
    key = id(cfg)
    entry = _NOTES.get(key)
    if entry is None or entry[0]() is not cfg:
        entry = _NOTES[key] = (weakref.ref(cfg, lambda _ref: _NOTES.pop(key, None)), set(), None)
    return entry


def note_once(cfg: PortRLConfig, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` unless it was logged for this config object already; held back inside :func:`held_notes`."""
    _, logged, held = _notes(cfg)
    if message in logged:
        return
    logged.add(message)
    if held is not None:
        held.append((level, message))
    else:
        log.log(level, message)


@contextmanager
def held_notes(cfg: PortRLConfig) -> Iterator[None]:
    """Hold the notes about ``cfg`` back while the block runs: logged when it ends normally, dropped when it
    raises (a run refused for bad input prints its one error line only)."""
    ref, logged, _ = _notes(cfg)
    held: list = []
    _NOTES[id(cfg)] = (ref, logged, held)
    try:
        yield
    except BaseException:
        logged.difference_update(m for _, m in held)
        raise
    else:
        for level, message in held:
            log.log(level, message)
    finally:
        _NOTES[id(cfg)] = (ref, logged, None)


@contextmanager
def writable(section: object) -> Iterator[None]:
    """omegaconf's ``read_write`` on ``section``: the run config or one of its sections (the schema's dataclass to
    mypy, a DictConfig at run time) opened for the block."""
    if not isinstance(section, Node):
        raise TypeError(f"not an omegaconf config: {type(section).__name__}")
    with read_write(section):
        yield


def user_set(cfg: PortRLConfig, key: str) -> bool:
    """Whether the user YAML or an override set ``key`` (True when the config's origin is unknown)."""
    keys = explicit_keys(cfg)
    return keys is None or key in keys


def val_files_beside(train_files: Iterable[str]) -> list[str]:
    """``DIR/test.parquet`` for every ``DIR/train.parquet`` when every training file is so named and every such
    test file exists; else []."""
    train = [Path(f) for f in train_files]
    tests = [p.with_name("test.parquet") for p in train]
    if train and all(p.name == "train.parquet" for p in train) and all(t.is_file() for t in tests):
        return [str(t) for t in tests]
    return []


def default_val_files(cfg: PortRLConfig, train_files: list[str], why: str = "data.val_files is empty") -> list[str]:
    """The test split beside ``train_files`` (logged), or [] with a note that validation is off."""
    val = val_files_beside(train_files)
    if val:
        note_once(cfg, f"{why}: validating on the test split beside the training split: {', '.join(val)}")
    else:
        note_once(cfg, f"{why} and there is no test.parquet beside data.train_files: validation is off (set "
                  "data.val_files=[TEST.parquet] to validate)")
    return val


def fit_val_files(cfg: PortRLConfig) -> None:
    """Fill or replace ``data.val_files`` in ``cfg`` as the module docstring says (a run with training files)."""
    d = cfg.data
    train = [str(f) for f in d.train_files or []]
    val = [str(f) for f in d.val_files or []]
    if not train:
        return  # a generated task's data brings its own test split (portrl.trainer.resources)
    keys = explicit_keys(cfg)
    if not val and keys is not None and "data.val_files" in keys:
        note_once(cfg, "data.val_files=[] (set by you): validation is off")
        return
    if not val:
        new = default_val_files(cfg, train)
    elif user_set(cfg, "data.val_files"):
        return
    elif user_set(cfg, "data.train_files") and val != val_files_beside(train):
        new = default_val_files(cfg, train, f"data.val_files ({', '.join(val)}) is the data preset's and "
                                                "data.train_files is yours")
    elif not all(Path(f).is_file() for f in val):
        missing = next(f for f in val if not Path(f).is_file())
        new = default_val_files(cfg, train, f"the data preset's data.val_files {missing} does not exist")
    else:
        return
    with writable(d):
        d.val_files = new


def warm_start_task(cfg: PortRLConfig) -> Optional[Task]:
    """The task whose built-in SFT rows the SFT warm start trains on, or None when the run must not warm-start.

    A task only when the run trains on that task's own generated rows: ``data.name`` has built-in SFT rows
    (portrl.tasks) and ``data.train_files`` is empty, or is the task's generated split in the cache (a settled
    config: portrl.trainer.resources.settle_config writes it there). Other training files are the user's data even
    where ``data.name`` kept its default (``arith``: the data preset is skipped when files are given), so a run
    with them never warm-starts on the built-in task."""
    task = builtin_sft_task(cfg)
    files = [str(f) for f in cfg.data.train_files or []]
    if task is None or not files:
        return task
    generated = generated_files(cfg)
    return task if generated is not None and files == [str(generated[0])] else None


def fit_warm_start(cfg: PortRLConfig) -> None:
    """``model.sft_warm_start`` off when :func:`warm_start_task` is None and a preset set it (with a note);
    UserError naming the key when the user set it."""
    if not bool(cfg.model.sft_warm_start) or warm_start_task(cfg) is not None:
        return
    tasks = names_where(lambda t: t.sft_rows is not None)
    files = [str(f) for f in cfg.data.train_files or []]
    data = f"data.train_files={files}" if files else f"data.name={cfg.data.name!r}"
    if user_set(cfg, "model.sft_warm_start"):
        raise UserError(f"model.sft_warm_start trains on the generated rows of data.name={tasks} only, not on "
                        f"{data}; set model.sft_warm_start=false, or fine-tune first with `portrl sft "
                        "--train-files SFT.parquet --output sft` and train from it with model.path=sft")
    note_once(cfg, f"model.sft_warm_start is built in for the generated rows of data.name={tasks} only: off for "
              f"{data} (fine-tune first with `portrl sft --train-files SFT.parquet` to warm-start on your data)")
    with writable(cfg.model):
        cfg.model.sft_warm_start = False


def fit_train_batch(cfg: PortRLConfig, usable: int, total: int, files: list[str]) -> None:
    """Fit ``data.train_batch_size`` to ``usable`` training prompts (of ``total`` rows; fewer when some are longer
    than ``data.max_prompt_length``); UserError with the key to set when the user set it or none is usable."""
    d, a = cfg.data, cfg.actor
    want, mini, limit = int(d.train_batch_size), int(a.ppo_mini_batch_size), int(d.max_prompt_length)
    if usable >= want:
        return
    where = ", ".join(files)
    if usable == 0 or user_set(cfg, "data.train_batch_size"):
        if usable == total:
            raise UserError(f"data.train_batch_size={want} is more than the {total} rows of {where}; set "
                            f"data.train_batch_size<={total} (and actor.ppo_mini_batch_size to a divisor of it) or "
                            "add rows")
        raise UserError(f"data.train_batch_size={want} needs {want} prompts, but only {usable} of the {total} rows of "
                        f"{where} fit data.max_prompt_length={limit} tokens (longer ones are dropped: "
                        "data.filter_overlong_prompts); raise data.max_prompt_length or lower data.train_batch_size")
    if user_set(cfg, "actor.ppo_mini_batch_size"):
        if usable % mini:
            raise UserError(f"data.train_batch_size={want} (not set by you) is lowered to the {usable} usable rows of "
                            f"{where}, which actor.ppo_mini_batch_size={mini} does not divide; set "
                            f"actor.ppo_mini_batch_size to a divisor of {usable}, or set data.train_batch_size")
        new_mini = mini
    else:  # keep about the preset's number of optimizer steps per RL step
        new_mini = mini_batch_for(usable, max(1, want // mini))
    short = "" if usable == total else f" that fit data.max_prompt_length={limit}"
    note_once(cfg, f"data.train_batch_size={want} (not set by you) is more than the {usable} training rows{short} of "
                   f"{where}: lowered to {usable} prompts per step, actor.ppo_mini_batch_size {mini} -> {new_mini}; set "
                   "data.train_batch_size to choose", logging.WARNING)
    with writable(cfg):
        d.train_batch_size = usable
        a.ppo_mini_batch_size = new_mini


#: activation memory one micro-batch may take under gradient checkpointing (float32), which sizes the token budget
MICRO_BATCH_ACTIVATION_BYTES = 1 << 30


def token_budget(hidden: int, layers: int, intermediate: int) -> int:
    """Tokens per micro-batch whose training activations take about MICRO_BATCH_ACTIVATION_BYTES with gradient
    checkpointing: per token, each layer's saved input (``hidden``) plus one layer recomputed in full (about 8
    hidden-wide and 3 ``intermediate``-wide tensors), float32, twice for the backward's gradients; a multiple of
    256, at least 256. Qwen2.5-0.5B (896, 24, 4864): 3072; 1.5B: 1536; 7B: 512."""
    per_token = 4 * 2 * (hidden * (layers + 8) + 3 * intermediate)
    return max(256, MICRO_BATCH_ACTIVATION_BYTES // per_token // 256 * 256)


def fit_token_budget(cfg: PortRLConfig) -> None:
    """``actor.max_tokens_per_micro_batch``: a null the user did not set becomes :func:`token_budget` of
    ``model.path`` when it has at least AUTO_CHECKPOINTING_PARAMS parameters (logged once); kept otherwise."""
    a, path = cfg.actor, cfg.model.path
    if a.max_tokens_per_micro_batch is not None or not path or user_set(cfg, "actor.max_tokens_per_micro_batch"):
        return
    if count_parameters(str(path)) < AUTO_CHECKPOINTING_PARAMS:
        return
    from transformers import AutoConfig  # noqa: PLC0415  (transformers: only where a model is built)

    c = AutoConfig.from_pretrained(str(path), local_files_only=True)
    c = getattr(c, "text_config", None) or c
    budget = token_budget(int(c.hidden_size), int(c.num_hidden_layers), int(c.intermediate_size))
    note_once(cfg, f"actor.max_tokens_per_micro_batch=null -> {budget} tokens per micro-batch for {path} (about "
                   f"{MICRO_BATCH_ACTIVATION_BYTES >> 30} GiB of activations; set it to choose)")
    with writable(cfg):
        a.max_tokens_per_micro_batch = budget
