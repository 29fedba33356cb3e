"""The host's C++ compiler, found without importing torch (``portrl doctor`` reports it in a fraction of a second;
``native_build`` compiles the CPU kernels with it)."""

from __future__ import annotations

import os
import shutil


def compiler() -> str | None:
    """Path of the C++ compiler to use: ``$CXX`` if set (and found), else ``g++`` or ``c++``; None when none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None
