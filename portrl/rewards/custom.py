"""A user reward function loaded from a Python file (``reward.custom.path`` / ``reward.custom.name``).

The function has compute_score's signature: ``fn(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`` (a dict holds at least "score"). Errors name the file and
function: a missing file, a file that fails to import, a missing or non-callable name, and (in
RewardFunctionError, raised by the reward manager) an exception while scoring a row.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

_CACHE: dict[tuple[str, str], Callable] = {}


class RewardFunctionError(RuntimeError):
    """A reward function raised while scoring a row (the message names the function and the row)."""


def load_custom_reward(path: str | Path, name: str = "compute_score") -> Callable:
    """The function ``name`` defined in the Python file ``path`` (cached per process)."""
    file = Path(path).expanduser().resolve()
    key = (str(file), name)
    if key in _CACHE:
        return _CACHE[key]
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file {str(path)!r} does not exist (reward.custom.path)")
    module_name = "portrl_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom reward file {str(file)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"custom reward file {str(file)!r} failed to import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom reward file {str(file)!r} defines no {name!r} (reward.custom.name); "
                             f"callables found: {', '.join(names) or 'none'}")
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function")
    _CACHE[key] = fn
    return fn
