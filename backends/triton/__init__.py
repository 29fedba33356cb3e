"""Triton kernels shared by the GPU backends that run Triton (cuda, rocm).

Kernels are built on first use (``triton`` imported lazily), once per interpreter mode, so
``TRITON_INTERPRET=1`` set before the first call runs them on the CPU through Triton's interpreter
(how the tests check them against the native ops). Only a GPU confirms compiled behaviour and speed.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

from portrl.device.backend import import_optional, module_available

INSTALL = "pip install triton"


def interpreting() -> bool:
    """True when Triton is told to interpret kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@lru_cache(maxsize=None)
def load_kernels(name: str, interpret: bool):
    """Import ``backends/triton/<name>.py`` (module-level ``@triton.jit`` kernels) as a fresh module for the
    given interpreter mode: Triton decides compiled vs interpreted when a kernel is decorated, and
    the interpreter resolves names through the module's globals."""
    import_optional("triton", INSTALL)
    path = Path(__file__).with_name(f"{name}.py")
    mode = "interpreted" if interpret else "compiled"
    spec = importlib.util.spec_from_file_location(f"{__name__}.{name}_{mode}", path)
    if spec is None or spec.loader is None:  # a file path always gives a spec with a loader
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available() -> bool | str:
    """Registry availability: triton importable, and either a GPU driver Triton can use or the interpreter.

    Asked when an op is selected (never at import); on a GPU host ``driver.active`` loads Triton's driver.
    """
    if not module_available("triton"):
        return f"triton is not installed ({INSTALL})"
    if interpreting():
        return True
    try:
        from triton.runtime import driver  # noqa: PLC0415  (optional dependency: triton)

        driver.active  # noqa: B018 - raises when Triton finds no GPU driver
    except Exception as exc:  # Triton raises RuntimeError (no driver) or ImportError (broken install)
        return f"Triton has no GPU driver here ({exc}); TRITON_INTERPRET=1 runs its kernels on the CPU"
    return True


def register(registry) -> None:
    """Register the Triton implementations ("triton") of logprobs_entropy and rms_norm."""
    from portrl.backends.triton.logprobs import logprobs_entropy_triton  # noqa: PLC0415  (torch and Triton: only when the kernels are registered)
    from portrl.backends.triton.rms_norm import rms_norm_triton  # noqa: PLC0415  (torch and Triton: only when the kernels are registered)

    registry.register("logprobs_entropy", "triton", logprobs_entropy_triton, available)
    registry.register("rms_norm", "triton", rms_norm_triton, available)
