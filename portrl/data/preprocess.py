"""Preprocessing: read local raw files, write verl-schema train/test parquet (atomically).

Inputs are ``.jsonl``, ``.json`` (a list of records, or {"data"/"rows": [...]}), ``.parquet`` or ``.arrow``.
An input directory holds one file per split, named ``train*`` and ``test*`` (``validation*`` / ``val*`` when
there is no ``test*``; as on the Hub: ``train-00000-of-00001.parquet``), or is a dataset saved by Hugging Face
``datasets``' ``save_to_disk`` (read with pyarrow alone): a Dataset folder (``state.json`` and ``*.arrow``
files) or a DatasetDict folder (``dataset_dict.json`` and one such folder per split). A single file, or a
saved Dataset, is split by ``test_fraction`` with ``seed``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from portrl.data.images import IMAGE_KEY, IMAGES_TYPE
from portrl.data.schema import DataError
from portrl.data.table_rows import table_rows
from portrl.outputs import claim, publish
from portrl.tasks import TASK_NAMES, TASKS, Task, names_where
from portrl.user_files import ordinary_permissions

log = logging.getLogger(__name__)
RAW_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
TEST_PREFIXES = ("test", "validation", "valid", "val")  # the first prefix that names files is the test split


def _utf8(raw: bytes, path: Path, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: {where} is not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None


def read_records(path: str | Path) -> list[dict]:
    """The records of one raw file (jsonl, json or parquet)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"input file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return table_rows(pq.read_table(path), str(path))
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input
            raise DataError(f"{path}: cannot be read as parquet ({type(exc).__name__}: {exc})") from None
    if suffix == ".arrow":
        return table_rows(read_arrow(path), str(path))
    if suffix == ".jsonl":
        records = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _utf8(raw, path, f"line {lineno}")
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
        return records
    if suffix == ".json":
        try:
            data = json.loads(_utf8(path.read_bytes(), path, "the file"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        if isinstance(data, dict):
            data = data.get("data", data.get("rows"))
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json input must hold a list of records (or {{'data': [...]}})")
        return data
    raise DataError(f"{path}: unsupported input type {suffix!r}; valid: {', '.join(RAW_SUFFIXES)}")


def read_arrow(path: str | Path) -> pa.Table:
    """An Arrow IPC file: the stream format ``datasets`` writes, or the random-access file format."""
    errors = []
    for open_ in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                return open_(source).read_all()
        except Exception as exc:  # noqa: BLE001 - try the other format; both failing is the user's input
            errors.append(f"{type(exc).__name__}: {exc}")
    raise DataError(f"{path}: cannot be read as an Arrow file ({errors[0]})")


def is_saved_dataset(directory: Path) -> bool:
    """Whether ``directory`` was written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file()


def read_saved_dataset(directory: Path) -> dict[str, list[dict]]:
    """The records of a ``save_to_disk`` folder by split: {"train": [...]} for a Dataset; for a DatasetDict its
    splits (``test``, else ``validation``, becomes "test"; other splits are left out, with a log line)."""
    if (directory / "state.json").is_file():
        return {"train": _saved_split(directory)}
    try:
        names = json.loads((directory / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{directory}/dataset_dict.json: not a saved DatasetDict ({type(exc).__name__}: {exc})") from None
    if "train" not in names:
        raise DataError(f"{directory}: the saved DatasetDict has no train split (splits: {', '.join(names)})")
    test = next((n for n in ("test", "validation", "valid", "val") if n in names), None)
    unused = [n for n in names if n not in ("train", test)]
    if unused:
        log.info("%s: splits %s not used (train: train, test: %s)", directory, ", ".join(unused), test or "none")
    return {"train": _saved_split(directory / "train"), "test": _saved_split(directory / test) if test else []}


def _saved_split(folder: Path) -> list[dict]:
    """The records of one saved Dataset folder, in the order of its state.json's data files."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        files = [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        files = sorted(folder.glob("*.arrow"))
    if not files:
        raise DataError(f"{folder}: a saved dataset folder without .arrow data files")
    records = []
    for f in files:
        if not f.is_file():
            raise DataError(f"{folder}/state.json names {f.name}, which does not exist")
        records.extend(table_rows(read_arrow(f), str(f)))
    return records


def find_split_files(directory: Path) -> dict[str, list[Path]]:
    """{"train": [...], "test": [...]} raw files in ``directory`` by name prefix (test may be empty)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in RAW_SUFFIXES)
    test: list[Path] = []
    for prefix in TEST_PREFIXES:
        test = [p for p in files if p.name.lower().startswith(prefix)]
        if test:
            break
    splits = {"train": [p for p in files if p.name.lower().startswith("train")], "test": test}
    if not splits["train"]:
        raise DataError(f"{directory}: no raw file named train* with suffix {', '.join(RAW_SUFFIXES)}, and not a "
                        "folder saved by datasets' save_to_disk (state.json or dataset_dict.json)")
    return splits


def write_split(rows: list[dict], path: str | Path, replace: bool = True) -> Path:
    """Write rows as parquet at ``path``: to a temporary name in the same folder, then renamed; returns where it
    went. The columns are every row's keys (None where a row has none); an ``images`` column is a list of
    ``{"bytes": binary, "path": string}`` (portrl.data.images.IMAGES_TYPE). ``replace=False``: a file that is at
    ``path`` by then is kept and the new one goes beside it (portrl.outputs.publish)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    names = list(dict.fromkeys(k for r in rows for k in r))  # every row's columns (from_pylist takes the first's)
    table = pa.table({k: pa.array([r.get(k) for r in rows], type=IMAGES_TYPE if k == IMAGE_KEY else None)
                      for k in names})
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        ordinary_permissions(tmp)  # mkstemp made it 0600
        if replace:
            os.replace(tmp, path)
        else:
            path = publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def split_records(records: list, test_fraction: float, seed: int) -> tuple[list, list]:
    """(train, test) by a seeded shuffle; test gets round(len * test_fraction) records."""
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_test = round(len(records) * test_fraction)
    test_idx = set(order[:n_test])
    return ([r for i, r in enumerate(records) if i not in test_idx], [r for i, r in enumerate(records) if i in test_idx])


def _load(paths: Iterable[Path], n: int | None) -> list[tuple[str, int, dict]]:
    out: list[tuple[str, int, dict]] = []
    for p in paths:
        out.extend((str(p), i, r) for i, r in enumerate(read_records(p)))
    return out[:n] if n is not None else out


def preprocess(task: str, output_dir: str | Path, input_path: str | Path | None = None,
               test_input: str | Path | None = None, test_fraction: float = 0.1, seed: int = 0,
               n: int | None = None, difficulty: int | None = None, sft: bool = False,
               data_source: str | None = None, question_key: str | None = None, answer_key: str | None = None,
               instruction: str | None = None, system: str | None = None,
               on_existing: str = "refuse") -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` for ``task`` (a name of portrl.tasks.TASKS) into
    ``output_dir``; returns their paths. Those files must not exist yet (``on_existing="move_aside"``: earlier
    ones are renamed to ``<name>.old-<time>``; portrl.outputs.claim), checked before any input is read; other
    files in the folder are left alone.

    ``n`` limits the raw records read per split (a generated task, arith: the number of problems, train + test,
    default 2000); ``difficulty`` is arith's level, or MATH's highest kept level (1-5). With ``sft`` (a task with
    built-in SFT rows: arith), ``sft_train.parquet`` / ``sft_test.parquet`` with a ``response`` column are
    written too. ``data_source`` (code, qa), ``question_key``, ``answer_key``, ``instruction`` and ``system`` (qa)
    are the converters' options (portrl.data.code, portrl.data.qa); a task takes the options its record lists.
    """
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; valid: {', '.join(TASK_NAMES)}")
    t = TASKS[task]
    if n is not None and n <= 0:
        raise DataError(f"--n must be positive, got {n}")
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    out = Path(output_dir)
    for name in ("train", "test", *(("sft_train", "sft_test") if sft and t.sft_rows else ())):
        claim(out / f"{name}.parquet", "--output-dir", on_existing)
    if sft and t.sft_rows is None:
        raise DataError(f"--sft is only available for {names_where(lambda t: t.sft_rows is not None)} (other tasks "
                        "have no reference responses)")
    if t.generated:
        if input_path is not None or test_input is not None:
            raise DataError(f"{task} generates its problems; it takes no --input")
        return _write_splits(_generated_splits(t, n, seed, difficulty, test_fraction, sft), out)
    options = {"difficulty": difficulty, "data_source": data_source, "question_key": question_key,
               "answer_key": answer_key, "instruction": instruction, "system": system}
    _check_options(t, options)
    if input_path is None:
        input_path = t.builtin_input()  # code: the small problem set shipped with portrl
    if input_path is None:
        raise DataError(f"{task} needs --input (a raw file or a folder with train*/test* files)")
    src = Path(input_path)
    if not src.exists():
        raise DataError(f"input {str(src)!r} does not exist")
    train_raw, test_raw = _read_input(src, n)
    if test_input is not None:
        test_raw = _load([Path(test_input)], n)
    convert = t.convert()
    kw = {arg: options[flag] for flag, arg in t.options.items()}
    train = convert(train_raw, split="train", **kw)
    test = convert(test_raw, split="test", **kw)
    if not test_raw and test_fraction > 0:
        # split after converting, so that deduplication (DAPO) cannot put one problem in both splits
        train, test = (_relabel(part, name) for part, name in zip(split_records(train, test_fraction, seed),
                                                                  ("train", "test")))
    if not train:
        raise DataError(f"{task}: no training rows left from {src}")
    log.info("%s: %d train rows, %d test rows -> %s", task, len(train), len(test), out)
    return _write_splits({"train": train, "test": test}, out)


#: what each converter option is, for the message naming the tasks that take it
_OPTION_HELP = {"difficulty": " (arith: the level; math: the highest MATH level kept)",
                "data_source": " (the other tasks write their dataset's own name)"}


def _check_options(task: Task, options: dict) -> None:
    """DataError for an option (given, not None) that ``task`` does not take."""
    def takers(flag: str) -> str:
        return names_where(lambda t: flag in t.options)

    for flag, value in options.items():
        if value is not None and flag not in task.options:
            alike = [f"--{f.replace('_', '-')}" for f in options if takers(f) == takers(flag)]  # named together
            flags = alike[0] if len(alike) == 1 else f"{', '.join(alike[:-1])} and {alike[-1]}"
            verb = "applies" if len(alike) == 1 else "apply"
            raise DataError(f"{flags} {verb} to {takers(flag)} only{_OPTION_HELP.get(flag, '')}")


def _generated_splits(task: Task, n: int | None, seed: int, difficulty: int | None, test_fraction: float,
                      sft: bool) -> dict[str, list[dict]]:
    """The train / test rows (and with ``sft`` the SFT rows) of a generated task: ``n`` problems in all."""
    total = n or 2000  # arith: difficulty 1 has about 2,850 distinct problems
    n_test = round(total * test_fraction)
    level = 1 if difficulty is None else difficulty
    sizes = {"train": total - n_test, "test": n_test}
    splits = {name: task.generate(k, seed, level, name, test_fraction=test_fraction) for name, k in sizes.items()}
    if sft:
        splits.update({f"sft_{name}": task.generate_sft(k, seed, level, name, test_fraction=test_fraction)
                       for name, k in sizes.items()})
    return splits


def _read_input(src: Path, n: int | None) -> tuple[list, list]:
    """(train, test) raw records of ``src``: a saved dataset folder, a folder of train*/test* files, or one file
    (test empty); at most ``n`` per split."""
    if src.is_dir() and is_saved_dataset(src):
        saved = read_saved_dataset(src)
        train_raw, test_raw = ([(f"{src} ({name})", i, r) for i, r in enumerate(saved.get(name, [])[:n])]
                               for name in ("train", "test"))
        return train_raw, test_raw
    if src.is_dir():
        files = find_split_files(src)
        return _load(files["train"], n), _load(files["test"], n)
    return _load([src], n), []


def _relabel(rows: list[dict], split: str) -> list[dict]:
    """Rows with extra_info.split and a fresh 0-based extra_info.index."""
    for i, row in enumerate(rows):
        row["extra_info"] = {**row["extra_info"], "split": split, "index": i}
    return rows


def _write_splits(splits: dict[str, list[dict]], out: Path) -> dict[str, Path]:
    """Write each non-empty split as ``<name>.parquet``; an empty split is skipped (and logged)."""
    paths = {}
    for name, rows in splits.items():
        if rows:
            paths[name] = write_split(rows, out / f"{name}.parquet", replace=False)
        else:
            log.warning("no %s rows: %s.parquet not written", name, name)
    return paths
