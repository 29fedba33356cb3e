"""What a run needs on disk before workers start: the model directory and the train / validation parquet.

* ``model.path`` empty -> the built-in tiny Qwen2 model (``model.tiny`` sizes), written once and
  reused from ``$PORTRL_CACHE`` (default ``~/.cache/portrl``) under a name derived from its sizes.
* ``data.name == "arith"`` with no files -> generated arith rows (``data.arith``) written once to
  the same cache. Other datasets need ``data.train_files``; validation uses ``data.val_files``, or when that is
  empty the ``test.parquet`` written beside a ``train.parquet`` (portrl.trainer.data_fit), else none.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, List, Tuple

from omegaconf import OmegaConf

from portrl.data.arith import GENERATOR_VERSION, make_arith_rows, make_arith_sft_rows
from portrl.data.preprocess import write_split
from portrl.errors import UserError
from portrl.models import write_tiny_model
from portrl.models.loader import check_model_dir
from portrl.trainer.data_fit import fit_val_files

PREPROCESS_TASKS = ("gsm8k", "math", "dapo_math", "geo3k")  # raw formats `portrl preprocess` reads (portrl.data.preprocess)


def no_train_files_message(cfg: Any) -> str:
    """Why a run of ``data.name`` without ``data.train_files`` cannot start, and the command that makes them."""
    name = str(cfg.data.name)
    task = name if name in PREPROCESS_TASKS else "qa"  # qa: any question-answer rows
    return (f"data.train_files is empty and only data.name=arith is generated (data.name={name!r}); make verl parquet "
            f"with `portrl preprocess {task} --input RAW_FILE --output-dir data/{task}`, then pass "
            f"data.train_files=[data/{task}/train.parquet] (the test.parquet beside it is the validation split)")


def cache_dir() -> Path:
    return Path(os.environ.get("PORTRL_CACHE") or Path.home() / ".cache" / "portrl")


def _key(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def resolve_model_path(cfg: Any) -> str:
    """``model.path``, or the cached tiny model built from ``model.tiny`` (written on first use)."""
    if cfg.model.path:
        return str(check_model_dir(str(cfg.model.path), "model.path"))
    t: Any = OmegaConf.to_container(cfg.model.tiny, resolve=True) if not isinstance(cfg.model.tiny, dict) else dict(cfg.model.tiny)
    out = cache_dir() / "models" / f"tiny-arith-{_key(t)}"
    if not (out / "config.json").is_file():
        write_tiny_model(out, vocab="arith", hidden_size=int(t["hidden_size"]), num_layers=int(t["num_layers"]),
                         num_heads=int(t["num_heads"]), num_kv_heads=int(t["num_kv_heads"]),
                         intermediate_size=int(t["intermediate_size"]), seed=int(t["seed"]), overwrite=True)
    return str(out)


def resolve_data_files(cfg: Any) -> Tuple[List[str], List[str]]:
    """(train files, validation files); generated for the arith task when none are given. Validation files
    missing from ``cfg`` are filled in it (:func:`portrl.trainer.data_fit.fit_val_files`)."""
    train = [str(f) for f in (cfg.data.train_files or [])]
    if train:
        fit_val_files(cfg)
        return train, [str(f) for f in (cfg.data.val_files or [])]
    val = [str(f) for f in (cfg.data.val_files or [])]
    if str(cfg.data.name) != "arith":
        raise UserError(no_train_files_message(cfg))
    a = cfg.data.arith
    spec = {"n_train": int(a.num_train), "n_test": int(a.num_test), "difficulty": int(a.difficulty), "seed": int(a.seed),
            "generator": GENERATOR_VERSION}
    out = cache_dir() / "data" / f"arith-{_key(spec)}"
    tr, te = out / "train.parquet", out / "test.parquet"
    if not tr.is_file():
        write_split(make_arith_rows(spec["n_train"], spec["seed"], spec["difficulty"], "train"), tr)
    if not te.is_file():
        write_split(make_arith_rows(spec["n_test"], spec["seed"], spec["difficulty"], "test"), te)
    return [str(tr)], (val or [str(te)])


def arith_sft_rows(cfg: Any, n: int) -> list:
    """Rows (prompt messages + response) of the arith train split for the SFT warm start."""
    a = cfg.data.arith
    return make_arith_sft_rows(n, int(a.seed), int(a.difficulty), "train")
