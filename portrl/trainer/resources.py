"""What a run needs on disk before workers start, resolved into the run config before it freezes.

* ``model.path`` empty -> the built-in tiny Qwen2 model (``model.tiny`` sizes), written once and
  reused from ``$PORTRL_CACHE`` (default ``~/.cache/portrl``) under a name derived from its sizes.
* ``data.name`` a generated task (portrl.tasks; ``arith``) with no files -> its generated rows (options:
  ``data.<name>``) written once to the same cache. Other datasets need ``data.train_files``; validation uses
  ``data.val_files``, or when that is empty the ``test.parquet`` written beside a ``train.parquet``
  (portrl.trainer.data_fit), else none.
* ``trainer.num_workers=null`` (auto) -> every device of the node (portrl.workers.setup.resolve_num_workers).

:func:`settle_config` is the step between the preflight and the trainer: it writes these resolved values into a
copy of the config and makes that copy read-only; :class:`~portrl.trainer.rl_trainer.RLTrainer` takes only such a
settled config, and a later write raises omegaconf's ReadonlyConfigError naming the key.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple, cast

from omegaconf import OmegaConf

from portrl.config.composition import copy_config
from portrl.data.preprocess import write_split
from portrl.errors import UserError
from portrl.models import write_tiny_model
from portrl.models.loader import check_model_dir
from portrl.models.tokenizer import CHAT_TEMPLATE
from portrl.tasks import builtin_sft_task, data_task, generated_task, names_where
from portrl.trainer.data_cache import cache_dir, cache_key, generated_files, generated_spec, generator_options
from portrl.trainer.data_fit import fit_val_files
from portrl.workers.setup import resolve_num_workers, worker_backend

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

# id(config) -> weak reference to it, for every config settle_config returned
_SETTLED: dict[int, weakref.ref] = {}


def no_train_files_message(cfg: PortRLConfig) -> str:
    """Why a run of ``data.name`` without ``data.train_files`` cannot start, and the command that makes them."""
    name = str(cfg.data.name)
    task = data_task(cfg)
    kind = name if task is not None and task.preset and task.converter else "qa"  # qa: any question-answer rows
    return (f"data.train_files is empty and only data.name={names_where(lambda t: t.generated)} is generated "
            f"(data.name={name!r}); make verl parquet with `portrl preprocess {kind} --input RAW_FILE --output-dir "
            f"data/{kind}`, then pass data.train_files=[data/{kind}/train.parquet] (the test.parquet beside it is "
            "the validation split)")


#: the vocabulary of the built-in tiny model (portrl.models.tokenizer: one token per byte, ChatML specials)
TINY_VOCAB = "arith"


def tiny_model_dir(cfg: PortRLConfig) -> Path:
    """Where the built-in tiny model of ``model.tiny`` is cached (written by :func:`resolve_model_path`); the key
    holds the sizes and the tokenizer's chat template (a model cached with an older template is built again)."""
    t = cast(dict, OmegaConf.to_container(cfg.model.tiny, resolve=True)) \
        if not isinstance(cfg.model.tiny, dict) else dict(cfg.model.tiny)
    return cache_dir() / "models" / f"tiny-{TINY_VOCAB}-{cache_key({**t, 'chat_template': CHAT_TEMPLATE})}"


def resolve_model_path(cfg: PortRLConfig) -> str:
    """``model.path``, or the cached tiny model built from ``model.tiny`` (written on first use)."""
    if cfg.model.path:
        return str(check_model_dir(str(cfg.model.path), "model.path"))
    t = cast(dict, OmegaConf.to_container(cfg.model.tiny, resolve=True)) \
        if not isinstance(cfg.model.tiny, dict) else dict(cfg.model.tiny)
    out = tiny_model_dir(cfg)
    if not (out / "config.json").is_file():
        write_tiny_model(out, vocab=TINY_VOCAB, hidden_size=int(t["hidden_size"]), num_layers=int(t["num_layers"]),
                         num_heads=int(t["num_heads"]), num_kv_heads=int(t["num_kv_heads"]),
                         intermediate_size=int(t["intermediate_size"]), seed=int(t["seed"]), overwrite=True)
    return str(out)


def settled_num_workers(cfg: PortRLConfig) -> int:
    """``trainer.num_workers`` of a settled config (:func:`settle_config` resolves the auto null to a count)."""
    n = cfg.trainer.num_workers
    if n is None:
        raise TypeError("trainer.num_workers is null (auto): settle the config first (settle_config)")
    return int(n)


def resolve_data_files(cfg: PortRLConfig) -> Tuple[List[str], List[str]]:
    """(train files, validation files); for a generated task without files, its rows written once to the cache.
    Validation files missing from ``cfg`` are filled in it (:func:`portrl.trainer.data_fit.fit_val_files`)."""
    train = [str(f) for f in (cfg.data.train_files or [])]
    if train:
        fit_val_files(cfg)
        return train, [str(f) for f in (cfg.data.val_files or [])]
    val = [str(f) for f in (cfg.data.val_files or [])]
    files = generated_files(cfg)
    if files is None:
        raise UserError(no_train_files_message(cfg))
    task = generated_task(cfg)
    assert task is not None  # generated_files found it
    spec = generated_spec(cfg, task)
    for path, split, n in zip(files, ("train", "test"), (spec["n_train"], spec["n_test"])):
        if not path.is_file():
            write_split(task.generate(n, spec["seed"], spec["difficulty"], split), path)
    return [str(files[0])], (val or [str(files[1])])


def builtin_sft_rows(cfg: PortRLConfig, at_least: int = 0) -> Optional[list]:
    """Rows (prompt messages + response) of the train split of ``data.name``'s built-in SFT data (the SFT warm
    start's, ``portrl sft`` without files): ``data.<name>.num_train`` of them, or ``at_least``; None when the
    task has none."""
    task = builtin_sft_task(cfg)
    if task is None:
        return None
    a = generator_options(cfg, task.name)
    return task.generate_sft(max(int(a.num_train), at_least), int(a.seed), int(a.difficulty), "train")


def settle_config(cfg: PortRLConfig) -> PortRLConfig:
    """A read-only copy of ``cfg`` (composed, checked by the preflight) with the run's resources resolved into
    it: ``trainer.num_workers``, ``model.path``, ``data.train_files`` and ``data.val_files`` (module docstring).
    ``cfg`` itself is left as it is; a config this returned is returned unchanged. UserError when the data
    cannot be resolved (no training files for a task that is not generated)."""
    if is_settled(cfg):
        return cfg
    out = copy_config(cfg)  # keeps what the user set (portrl.config.composition.explicit_keys)
    OmegaConf.set_readonly(out, False)
    out.trainer.num_workers = resolve_num_workers(out, worker_backend(out))  # null (auto): every device
    out.model.path = resolve_model_path(out)
    train, val = resolve_data_files(out)
    out.data.train_files, out.data.val_files = train, val
    OmegaConf.set_readonly(out, True)
    key = id(out)
    _SETTLED[key] = weakref.ref(out, lambda _ref: _SETTLED.pop(key, None))
    return out


def is_settled(cfg: PortRLConfig) -> bool:
    """Whether ``cfg`` is a config :func:`settle_config` returned."""
    ref = _SETTLED.get(id(cfg))
    return ref is not None and ref() is cfg
