"""A trained policy written back as the user's model: new weights, the user's own config and tokenizer files.

Training changes a loaded model in memory in ways that are not part of the model: gradient checkpointing sets
``config.use_cache = False``, and a tokenizer loaded with ``from_pretrained(..., local_files_only=True)``
would write that flag (and a pad token portrl filled in) into ``tokenizer_config.json``.
:func:`export_pretrained` writes the weights and config with ``save_pretrained``, puts back the config keys of
:data:`RUNTIME_CONFIG_KEYS` as the source directory had them, and copies the tokenizer files byte for byte
from the tokenizer's source directory, and a vision-language model's processor files (:data:`PROCESSOR_FILES`)
from the model's. The directory is written under a unique temporary name beside
``out_dir`` with ordinary permissions (umask) and renamed into place; an older export there is replaced
only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from portrl.outputs import publish
from portrl.user_files import new_dir, ordinary_permissions, temp_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
RUNTIME_CONFIG_KEYS = ("use_cache",)  # set in memory for training, not properties of the model
# a vision-language model's processor (image / video processor settings), beside its tokenizer files
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def restore_config(saved: Path, source: Path) -> None:
    """Put :data:`RUNTIME_CONFIG_KEYS` of the ``saved`` config.json back to their values in ``source`` (a key the
    source does not have is removed, so the library default applies as it did for the source)."""
    if not source.is_file():
        return
    want = json.loads(source.read_text())
    got = json.loads(saved.read_text())
    _restore_keys(got, want)
    for name, sub in got.items():  # a composite config's parts (a vision-language model's text_config, ...)
        if isinstance(sub, dict) and "model_type" in sub:
            _restore_keys(sub, want.get(name) if isinstance(want.get(name), dict) else {})
    saved.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")


def _restore_keys(got: dict, want: dict) -> None:
    for key in RUNTIME_CONFIG_KEYS:
        if key in want:
            got[key] = want[key]
        else:
            got.pop(key, None)


def copy_tokenizer_files(source: Path, dest: Path) -> list:
    """Copy the tokenizer files of ``source`` into ``dest`` (byte for byte); returns the names copied."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    for name in names:
        shutil.copyfile(source / name, dest / name)
    return names


def export_pretrained(model: Any, out_dir: str | os.PathLike, *, source_dir: str | os.PathLike,
                      tokenizer: Any = None, tokenizer_dir: Optional[str | os.PathLike] = None,
                      replace: bool = True) -> Path:
    """Write ``model`` (a transformers model) to ``out_dir`` as described in the module docstring; returns where
    it went.

    ``source_dir``: the model directory training started from (its config.json is the reference);
    ``tokenizer_dir``: where the tokenizer came from (default ``source_dir``). When that directory holds no
    tokenizer files, ``tokenizer.save_pretrained`` writes them instead. ``replace=False`` (a folder the user
    named, claimed with portrl.outputs.claim): a non-empty ``out_dir`` that appeared meanwhile is kept and the
    export goes beside it (portrl.outputs.publish); ``True``: the run's own earlier export is replaced.
    """
    out = Path(out_dir)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        restore_config(tmp / "config.json", Path(source_dir) / "config.json")
        if not copy_tokenizer_files(Path(tokenizer_dir or source_dir), tmp) and tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name in PROCESSOR_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copyfile(Path(source_dir) / name, tmp / name)

    if replace:
        with new_dir(out) as tmp:
            fill(tmp)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out)
    tmp.mkdir()
    try:
        fill(tmp)
        ordinary_permissions(tmp)
        return publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
