"""Where a run's generated inputs are cached, keyed by what they are made from: ``$PORTRL_CACHE`` (default
``~/.cache/portrl``), and the files of a generated task's rows there (:func:`generated_files`; written by
portrl/trainer/resources.py, read by the SFT warm-start decision in portrl/trainer/data_fit.py and the run's
identity)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Tuple

from portrl.tasks import Task, generated_task

if TYPE_CHECKING:
    from portrl.config.schema import ArithDataConfig, PortRLConfig


def cache_dir() -> Path:
    return Path(os.environ.get("PORTRL_CACHE") or Path.home() / ".cache" / "portrl")


def cache_key(d: dict) -> str:
    """A short hash of ``d`` (JSON with sorted keys): the name of what is cached from it."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def generator_options(cfg: PortRLConfig, name: str) -> ArithDataConfig:
    """``data.<name>``: the generator's options of the generated task ``name`` (a section of the schema's data)."""
    data: Any = cfg.data  # indexed by the task's name
    options: ArithDataConfig = data[name]
    return options


def generated_spec(cfg: PortRLConfig, task: Task) -> dict:
    a = generator_options(cfg, task.name)
    return {"n_train": int(a.num_train), "n_test": int(a.num_test), "difficulty": int(a.difficulty),
            "seed": int(a.seed), "generator": task.generator_version}


def generated_files(cfg: PortRLConfig) -> Optional[Tuple[Path, Path]]:
    """(train, test) parquet paths of the generated task of ``data.name`` in the cache (None for other data);
    nothing is written."""
    task = generated_task(cfg)
    if task is None:
        return None
    out = cache_dir() / "data" / f"{task.name}-{cache_key(generated_spec(cfg, task))}"
    return out / "train.parquet", out / "test.parquet"
