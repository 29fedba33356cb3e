"""A user reward function loaded from a Python file (``reward.custom.path`` / ``reward.custom.name``).

The function has compute_score's signature: ``fn(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`` (a dict holds at least "score"). Errors name the file and
function: a missing file, a file that fails to import, a missing or non-callable name
(:class:`RewardFileError`), and (in RewardFunctionError, raised by the reward manager) an exception
while scoring a row. Both are user errors (``portrl`` prints one line, exit code 2).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from portrl.errors import UserError

_CACHE: dict[tuple[str, str], Callable] = {}


class RewardFunctionError(UserError, RuntimeError):
    """A reward function raised while scoring a row (the message names the function and the row)."""


class RewardFileError(UserError, ValueError):
    """``reward.custom.path`` / ``reward.custom.name`` do not give a function (the message says why)."""


def load_custom_reward(path: str | Path, name: str = "compute_score") -> Callable:
    """The function ``name`` defined in the Python file ``path`` (cached per process)."""
    file = Path(path).expanduser().resolve()
    key = (str(file), name)
    if key in _CACHE:
        return _CACHE[key]
    if not file.exists():
        raise RewardFileError(f"custom reward file {str(path)!r} does not exist (reward.custom.path); "
                              "give a Python file defining the function")
    if not file.is_file():
        raise RewardFileError(f"reward.custom.path {str(path)!r} is not a file; give a Python file defining the function")
    module_name = "portrl_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardFileError(f"custom reward file {str(file)!r} cannot be loaded as a Python module "
                              "(reward.custom.path must be a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardFileError(f"custom reward file {str(file)!r} failed to import: {type(exc).__name__}: "
                              f"{exc}".replace("\n", " ")) from exc
    fn = getattr(module, name, None)
    if fn is None:
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFileError(f"custom reward file {str(file)!r} defines no {name!r} (reward.custom.name); "
                             f"callables found: {', '.join(names) or 'none'}")
    if not callable(fn):
        raise RewardFileError(f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function "
                              "(reward.custom.name names the function to call)")
    _CACHE[key] = fn
    return fn
