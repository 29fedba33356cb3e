"""The host's C++ compiler, found without importing torch (``portrl doctor`` reports it in a fraction of a second;
``native_build`` compiles the CPU kernels with it), and the line of its output that says why a build failed."""

from __future__ import annotations

import os
import re
import shutil


def compiler() -> str | None:
    """Path of the C++ compiler to use: ``$CXX`` if set (and found), else ``g++`` or ``c++``; None when none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def first_error(output: str) -> str:
    """The line of a compiler's ``output`` that says what went wrong, folders cut from its file name: its first
    ``#error`` line (a header's stated requirement), else its first ``error`` line, else its last line; "no output"
    when it printed nothing."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if not lines:
        return "no output"
    errors = [ln for ln in lines if re.search(r"\berror\b", ln, re.IGNORECASE)]
    line = next((ln for ln in errors if "#error" in ln), errors[0] if errors else lines[-1])
    line = re.sub(r"^\S*/", "", line)  # /long/path/ATen.h:5:2: error: ... -> ATen.h:5:2: error: ...
    return line if len(line) <= 300 else line[:297] + "..."
