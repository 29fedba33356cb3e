"""The installed package is the source tree: a built wheel (what `pip install .` and every Dockerfile install)
holds every module and data file of portrl/, backends/ (as portrl.backends) and configs/ (as portrl.configs).

An editable install imports straight from the checkout and hides a package left out of the wheel (a folder
without ``__init__.py``); this test builds the wheel and compares file lists.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> its place in the installed package (setup.py's package_dir)
TREES = {"portrl": "portrl", "backends": "portrl/backends", "configs": "portrl/configs"}
SHIPPED = {".py", ".yaml", ".json", ".jsonl", ".txt"}


def _source_files() -> set:
    out = set()
    for src, dst in TREES.items():
        for f in (ROOT / src).rglob("*"):
            if f.is_file() and f.suffix in SHIPPED and "__pycache__" not in f.parts:
                out.add(f"{dst}/{f.relative_to(ROOT / src).as_posix()}")
    return out


def test_every_python_folder_is_a_package():
    missing = [str(d.relative_to(ROOT)) for src in ("portrl", "backends") for d in (ROOT / src).rglob("*")
               if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, f"folders with modules but no __init__.py (left out of a wheel): {missing}"


def test_wheel_holds_every_source_file(tmp_path):
    # built from a copy: setuptools reuses a build/ folder in the tree, which may hold files of an older build
    src = tmp_path / "src"
    for name in (*TREES, "setup.py", "pyproject.toml", "README.md"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("portrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"files of the source tree missing from the wheel: {missing[:20]}"
