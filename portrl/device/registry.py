"""Backend registry: discovery through the ``portrl.backends`` entry-point group, and resolution.

Where backends come from: only that entry-point group. The built-in ones (one folder each under ``backends/``)
are declared in pyproject.toml exactly as a third-party plugin would be::

    [project.entry-points."portrl.backends"]
    xpu = "my_pkg.xpu:XPUBackend"

Entry points load through :class:`portrl.plugins.PluginGroup`, one at a time, isolated as every plugin group is: a
plugin that fails to import, is not a Backend subclass, declares another name, lacks one of the answers every
backend gives itself (bf16, fp8, memory: ``portrl.device.backend.REQUIRED_ANSWERS``), or claims a name another plugin
claims is recorded with its error (:func:`broken_backends`, listed by ``portrl devices``) instead of stopping
discovery; asking for it by name is a one-line :class:`BackendError`, and the other backends still work.

Resolution order: an explicit name (``--device``, then ``PORTRL_DEVICE``, then config
``device.name``, unless ``compose`` recorded that ``device.name`` itself came from ``--device``);
``auto`` or nothing means detection: backends are probed in descending
``detect_priority`` (each backend declares its own) and the first usable one wins. The core holds no
list of vendors.
"""

from __future__ import annotations

import difflib
import logging
import os
from functools import lru_cache
from typing import Sequence

from portrl.device.backend import Backend, missing_answers
from portrl.errors import UserError
from portrl.plugins import BrokenPlugin, PluginGroup

ENTRY_POINT_GROUP = "portrl.backends"
ENV_VAR = "PORTRL_DEVICE"
AUTO = "auto"

log = logging.getLogger(__name__)


class BackendError(UserError, RuntimeError):
    """A backend name is unknown, broken or not usable here (a user error: exit code 2, one line)."""


def _check(name: str, cls: object) -> type[Backend]:
    """An entry point's Backend class: a Backend subclass whose declared name (if any) is the entry point's and
    that gives every required answer itself (portrl.device.backend.REQUIRED_ANSWERS: bf16, fp8, memory)."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a portrl Backend subclass")
    if (cls.name or name) != name:
        raise ValueError(f"the class declares name {cls.name!r}; the entry point and the class must agree")
    missing = missing_answers(cls)
    if missing:
        raise TypeError(f"backend {name!r} ({cls.__module__}.{cls.__qualname__}) does not answer "
                        f"{', '.join(missing)}: every backend gives these itself (portrl.device.backend)")
    return cls


PLUGINS = PluginGroup(ENTRY_POINT_GROUP, "backend", _check)


def _classes() -> dict[str, type[Backend]]:
    """Every backend class that loads, by name (the group loads once; see the module docstring)."""
    return PLUGINS.load_all()


def broken_backends() -> dict[str, BrokenPlugin]:
    """Backend plugins that could not be used: name -> (entry point value, error)."""
    PLUGINS.load_all()
    return PLUGINS.broken()


def clear_cache() -> None:
    """Forget discovered backends (tests that add plugins call this)."""
    PLUGINS.reset()
    _instance.cache_clear()


def backend_names() -> list[str]:
    """Registered names, in detection order (highest ``detect_priority`` first)."""
    classes = _classes()
    return sorted(classes, key=lambda n: (-classes[n].detect_priority, n))


def get_backend(name: str, source: str | None = None) -> Backend:
    """The backend registered under ``name`` (not probed). Unknown names list the valid ones; ``source``
    (``--device``, ``$PORTRL_DEVICE``, a preset, a file) says where the name came from."""
    classes = _classes()
    where = f" (from {source})" if source else ""
    broken = PLUGINS.broken()
    if name in broken:
        value, error = broken[name]
        raise BackendError(f"device {name!r}{where}: its plugin {value} is broken: {error}; working backends: "
                           f"{', '.join(backend_names()) or 'none'} (see `portrl devices`)")
    if name not in classes:
        close = difflib.get_close_matches(name, classes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise BackendError(f"unknown device {name!r}{where}; registered: {', '.join(backend_names())}, "
                           f"or 'auto' (see `portrl devices`).{hint}")
    return _instance(name)


@lru_cache(maxsize=None)
def _instance(name: str) -> Backend:
    return _classes()[name]()



def all_backends() -> list[Backend]:
    return [get_backend(n) for n in backend_names()]


def usable_names() -> list[str]:
    """The backends usable on this host, in detection order (each probed: a host without a backend's device
    answers from its device nodes, importing nothing)."""
    return [b.name for b in all_backends() if b.probe().usable]


def config_backend(cfg) -> Backend:
    """The backend a run config names (``device.name``, ``auto``: detection; the command line and
    ``$PORTRL_DEVICE`` as :func:`resolve_backend` orders them), usable here, or a one-line :class:`BackendError`
    naming where the name came from. Light (nothing heavy imported, nothing logged): a command calls it right
    after composing its config, so that a device that is not here is said in a second, before the model and
    trainer modules load."""
    name = cfg.device.name
    quiet = logging.getLogger(__name__)
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the run logs its backend when it starts; not twice
    try:
        return resolve_backend(config=None if name in (None, AUTO) else str(name),
                               config_source=cfg.device.get("name_source"))
    finally:
        quiet.setLevel(level)


def check_cli_device(device: str | None, overrides: Sequence[str] = (), *, preset: str | None = None,
                     config_file: str | None = None) -> None:
    """Before a run config is composed (its checks import the algorithm modules, and torch with them: seconds): a
    ``--device`` naming a registered backend that is not usable here is the one-line :class:`BackendError` the
    composed config would give (``from --device``). Nothing is checked when the name may still change: a
    device preset, ``--preset``, ``--config``, or an override of ``device``, ``preset`` or ``device.name``."""
    if not device or device == AUTO or preset or config_file or device not in _classes():
        return
    if any(item.split("=", 1)[0].strip().lstrip("+") in ("device", "preset", "device.name") for item in overrides):
        return
    resolve_backend(device)


def detect() -> Backend:
    """The first usable backend in detection order."""
    reasons = []
    for backend in all_backends():
        result = backend.probe()
        if result.usable:
            return backend
        reasons.append(f"{backend.name}: {result.reason}")
    raise BackendError("no usable device backend: " + "; ".join(reasons))


def resolve_backend(cli: str | None = None, config: str | None = None, *, require_usable: bool = True,
                    config_source: str | None = None) -> Backend:
    """Resolve the backend: ``cli`` > ``$PORTRL_DEVICE`` > ``config`` > detection.

    ``config_source`` says where ``config`` came from (``device.name_source``, recorded by compose); when it is
    ``--device`` the config value is the command line's choice and beats ``$PORTRL_DEVICE``. An explicit
    backend that is not usable here is an error naming the reason and the source, unless ``require_usable``
    is False (``portrl doctor`` inspects unusable backends too).
    """
    from_config = (config_source or "device.name", config)
    from_env = (f"${ENV_VAR}", os.environ.get(ENV_VAR))
    order = [("--device", cli)]
    order += [from_config, from_env] if (config_source or "").startswith("--device") else [from_env, from_config]
    for source, value in order:
        if value and value != AUTO:
            backend = get_backend(value, source)
            if require_usable:
                result = backend.probe()
                if not result.usable:
                    here = ", ".join(usable_names()) or "none"
                    raise BackendError(f"device {value!r} (from {source}) is not usable here: {result.reason}; "
                                       f"usable here: {here} (see `portrl devices`)")
            log.info("device backend %s (from %s)", backend.name, source)
            return backend
    backend = detect()
    log.info("device backend %s (detected)", backend.name)
    return backend
