"""Backend registry: discovery through the ``portrl.backends`` entry-point group, and resolution.

Where backends come from: only that entry-point group. The built-in ones (one folder each under ``backends/``)
are declared in pyproject.toml exactly as a third-party plugin would be::

    [project.entry-points."portrl.backends"]
    xpu = "my_pkg.xpu:XPUBackend"

Entry points load one at a time: a plugin that fails to import, is not a Backend subclass, declares another name,
or claims a name another plugin claims is recorded with its error (:func:`broken_backends`, listed by
``portrl devices``) instead of stopping discovery; asking for it by name is a one-line :class:`BackendError`, and
the other backends still work.

Resolution order: an explicit name (``--device``, then ``PORTRL_DEVICE``, then config
``device.name``, unless ``compose`` recorded that ``device.name`` itself came from ``--device``);
``auto`` or nothing means detection: backends are probed in descending
``detect_priority`` (each backend declares its own) and the first usable one wins. The core holds no
list of vendors.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from functools import lru_cache

from portrl.device.backend import Backend
from portrl.errors import UserError

ENTRY_POINT_GROUP = "portrl.backends"
ENV_VAR = "PORTRL_DEVICE"
AUTO = "auto"

log = logging.getLogger(__name__)


class BackendError(UserError, RuntimeError):
    """A backend name is unknown, broken or not usable here (a user error: exit code 2, one line)."""


@dataclass
class Discovery:
    """The outcome of loading every entry point: backend classes by name, and broken plugins by name with
    ``(entry point value, error)``."""

    classes: dict[str, type[Backend]] = field(default_factory=dict)
    broken: dict[str, tuple[str, str]] = field(default_factory=dict)


def _load(ep: importlib.metadata.EntryPoint) -> type[Backend]:
    """One entry point's Backend class; any failure is an exception whose text says what is wrong."""
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a portrl Backend subclass")
    if (cls.name or ep.name) != ep.name:
        raise ValueError(f"the class declares name {cls.name!r}; the entry point and the class must agree")
    return cls


@lru_cache(maxsize=1)
def _discover() -> Discovery:
    """Load every entry point of the group once, each on its own (see the module docstring)."""
    found = Discovery()
    origin: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found.broken:
            continue
        try:
            cls = _load(ep)
        except Exception as exc:  # a third-party plugin may fail in any way on import; it must not stop the others
            found.classes.pop(ep.name, None)
            found.broken[ep.name] = (ep.value, f"{type(exc).__name__}: {exc}")
            log.debug("backend plugin %s (%s) failed to load: %s: %s", ep.name, ep.value, type(exc).__name__, exc)
            continue
        if ep.name in found.classes and ep.value != origin[ep.name]:
            del found.classes[ep.name]
            claim = f"two plugins claim backend {ep.name!r}: {origin[ep.name]} and {ep.value}"
            found.broken[ep.name] = (ep.value, claim)
            continue
        found.classes[ep.name] = cls
        origin[ep.name] = ep.value
    return found


def broken_backends() -> dict[str, tuple[str, str]]:
    """Backend plugins that could not be used: name -> (entry point value, error)."""
    return dict(_discover().broken)


def clear_cache() -> None:
    """Forget discovered backends (tests that add plugins call this)."""
    _discover.cache_clear()
    _instance.cache_clear()


def backend_names() -> list[str]:
    """Registered names, in detection order (highest ``detect_priority`` first)."""
    classes = _discover().classes
    return sorted(classes, key=lambda n: (-classes[n].detect_priority, n))


def get_backend(name: str, source: str | None = None) -> Backend:
    """The backend registered under ``name`` (not probed). Unknown names list the valid ones; ``source``
    (``--device``, ``$PORTRL_DEVICE``, a preset, a file) says where the name came from."""
    found = _discover()
    where = f" (from {source})" if source else ""
    if name in found.broken:
        value, error = found.broken[name]
        raise BackendError(f"device {name!r}{where}: its plugin {value} is broken: {error}; working backends: "
                           f"{', '.join(backend_names()) or 'none'} (see `portrl devices`)")
    classes = found.classes
    if name not in classes:
        close = difflib.get_close_matches(name, classes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise BackendError(f"unknown device {name!r}{where}; registered: {', '.join(backend_names())}, "
                           f"or 'auto' (see `portrl devices`).{hint}")
    return _instance(name)


@lru_cache(maxsize=None)
def _instance(name: str) -> Backend:
    return _discover().classes[name]()



def all_backends() -> list[Backend]:
    return [get_backend(n) for n in backend_names()]


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
                    raise BackendError(f"device {value!r} (from {source}) is not usable here: {result.reason}")
            log.info("device backend %s (from %s)", backend.name, source)
            return backend
    backend = detect()
    log.info("device backend %s (detected)", backend.name)
    return backend
