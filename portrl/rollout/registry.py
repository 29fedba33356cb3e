"""Choosing and building a rollout engine: :func:`choose_engine` (the one place that decides which engine a run
uses) and :func:`make_engine`.

Where engines come from (nothing else registers one):

* ``_BUILTIN`` below: the ``hf`` engine (``portrl/rollout/hf_engine.py``), found even when the installed package
  metadata is older than the source tree;
* the entry-point group ``portrl.rollout_engines``: pyproject.toml declares ``hf`` and the engines under
  ``backends/`` there, exactly as a third-party engine would;
* :func:`register_engine` calls (a program or test registering a factory at run time).

Entry points load through :class:`portrl.plugins.PluginGroup`, one at a time, on first use, isolated as every
plugin group is: a plugin that fails to import or is not a RolloutEngine is recorded with its error
(:func:`broken_engines`, listed by ``portrl devices``); asking for it by name is a one-line
:class:`RolloutEngineError`, and the other engines still work. A name must also be offered on the backend
(:func:`offered_engines`: the backend's ``rollout_engines()``, which reflects what is installed, and any engine
whose class says it runs there); otherwise the error lists the engines that are available. The choice is logged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Union

import torch

from portrl.device import get_backend, resolve_backend
from portrl.device.backend import Backend
from portrl.errors import UserError
from portrl.plugins import BrokenPlugin, PluginGroup, PluginLoadError
from portrl.rollout.engine import EngineCapabilities, RolloutEngine
from portrl.rollout.settings import RolloutSettings

ENTRY_POINT_GROUP = "portrl.rollout_engines"
AUTO = "auto"
#: below this many parameters a model on the CPU device decodes with ``hf`` even under ``auto`` (a separate engine
#: only pays off for real models; tiny ones share the trainer's module)
SMALL_MODEL_PARAMS = 50_000_000

log = logging.getLogger(__name__)

_registered: dict[str, Callable[..., RolloutEngine]] = {}  # register_engine calls (they win over entry points)
_BUILTIN = {"hf": "portrl.rollout.hf_engine:HFEngine"}

NumParams = Union[int, Callable[[], int], None]


class RolloutEngineError(UserError, RuntimeError):
    """An engine name is unknown, broken or not available on this backend (a user error: exit code 2, one line)."""


def _check(name: str, factory: Any) -> Callable[..., RolloutEngine]:
    """An entry point's engine: a RolloutEngine subclass, or a callable that builds one."""
    if not callable(factory) or (isinstance(factory, type) and not issubclass(factory, RolloutEngine)):
        raise TypeError(f"{factory!r} is not a portrl RolloutEngine subclass or factory")
    return factory


PLUGINS = PluginGroup(ENTRY_POINT_GROUP, "rollout engine", _check, builtin=_BUILTIN)


def register_engine(name: str, factory: Callable[..., RolloutEngine]) -> None:
    """Register ``factory`` (an engine class or a callable taking the make_engine keywords) under ``name``."""
    _registered[name] = factory


def engine_names() -> list[str]:
    """Every engine name known here (registered or declared, broken ones included), installed or not."""
    return sorted(set(_registered) | set(PLUGINS.names()))


def engine_factory(name: str) -> Callable[..., RolloutEngine]:
    """The factory registered for ``name`` (loading its entry point); unknown or broken names raise
    :class:`RolloutEngineError`."""
    if name in _registered:
        return _registered[name]
    if name not in PLUGINS.declared():
        raise RolloutEngineError(f"unknown rollout engine {name!r}; known engines: "
                                 f"{', '.join(engine_names()) or 'none'}")
    try:
        return PLUGINS.load(name)
    except PluginLoadError as exc:
        raise RolloutEngineError(f"rollout engine {name!r}: {exc}") from None


def broken_engines() -> dict[str, BrokenPlugin]:
    """Declared engines whose plugin cannot be used, with the reason (loads every declared engine once)."""
    PLUGINS.load_all()
    return {name: b for name, b in PLUGINS.broken().items() if name not in _registered}


def _listed(broken: dict[str, BrokenPlugin]) -> str:
    return ", ".join(f"{n}: {b.message}" for n, b in broken.items()) or "none"


def engine_capabilities(name: str) -> EngineCapabilities:
    """What engine ``name`` declares it can do (a plain factory declares nothing)."""
    caps = getattr(engine_factory(name), "capabilities", None)
    return caps if isinstance(caps, EngineCapabilities) else EngineCapabilities()


def _usable(name: str) -> bool:
    try:
        engine_factory(name)
    except RolloutEngineError:
        return False
    return True


def _resolve_backend(backend: Backend | str | None) -> Backend:
    if backend is None:
        return resolve_backend()
    if isinstance(backend, str):
        return get_backend(backend) if backend != AUTO else resolve_backend()
    return backend


def offered_engines(backend: Backend) -> list[str]:
    """The engines offered on ``backend``, best first: the backend's own ``rollout_engines()``, then any other
    declared engine whose class says it runs there (:meth:`RolloutEngine.runs_on`), so that a third-party engine
    needs no change to the backends it supports."""
    offered = list(backend.rollout_engines())
    for name in engine_names():
        if name not in offered and _usable(name):
            runs_on = getattr(engine_factory(name), "runs_on", None)
            if runs_on is not None and runs_on(backend):
                offered.append(name)
    return offered


def available_engines(backend: Backend | str | None = None) -> list[str]:
    """Engines offered on this backend (:func:`offered_engines`) that are registered and load, best first."""
    backend = _resolve_backend(backend)
    known = set(engine_names())
    return [e for e in offered_engines(backend) if e in known and _usable(e)]


def choose_engine(requested: str | None, backend: Backend | str | None = None, *, num_params: NumParams = None) -> str:
    """The engine a run uses: the one place this is decided.

    ``requested`` "auto" (or None): the backend's first available engine (:func:`available_engines`: offered
    by the backend, registered, loading), except ``hf`` when the backend's device is the CPU and the model has
    fewer than SMALL_MODEL_PARAMS parameters. ``num_params`` is the count, or a callable that returns it (called
    only when the rule needs it); None = unknown, which never counts as small. Any other name is returned when the
    backend offers it and it loads; otherwise a one-line :class:`RolloutEngineError` says why and what is
    available. ``backend`` is a Backend, a backend name, or None (resolved as the CLI does).
    """
    backend = _resolve_backend(backend)
    available = available_engines(backend)
    if requested in (None, AUTO):
        if not available:
            raise RolloutEngineError(f"backend {backend.name!r} offers no usable rollout engine (offers: "
                                     f"{', '.join(offered_engines(backend)) or 'none'}; broken: "
                                     f"{_listed(broken_engines())})")
        if available[0] != "hf" and "hf" in available and backend.device_type == "cpu":
            count = num_params() if callable(num_params) else num_params
            if count is not None and count < SMALL_MODEL_PARAMS:
                return "hf"
        return available[0]
    name = str(requested)
    known = name in engine_names()
    if known:
        engine_factory(name)  # a broken plugin: its own error
    if name not in offered_engines(backend):
        why = " (it is a known engine, but its package is not installed for this backend)" if known else ""
        raise RolloutEngineError(f"rollout engine {name!r} is not available on backend {backend.name!r}{why}; "
                                 f"available: {', '.join(available) or 'none'}, or auto")
    if not known:
        raise RolloutEngineError(f"backend {backend.name!r} offers rollout engine {name!r}, but no engine of that "
                                 f"name is registered; known engines: {', '.join(engine_names())}")
    return name


def make_engine(
    name: str | None,
    *,
    model: Any = None,
    model_path: str | None = None,
    tokenizer: Any = None,
    backend: Backend | str | None = None,
    settings: RolloutSettings | None = None,
    num_params: NumParams = None,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """Build the rollout engine ``name`` (see :func:`choose_engine`; a ``model`` module supplies ``num_params``
    when it is not given) for ``backend``.

    Options: the engine class's translation of ``settings`` (:meth:`RolloutEngine.translate_settings`), then
    ``engine_kwargs``, then the backend's ``check_and_update_engine_options(name, options)``, whose result is
    final (it sees everything and adjusts what the platform needs).
    """
    backend = _resolve_backend(backend)
    if num_params is None and isinstance(model, torch.nn.Module):
        num_params = lambda: sum(p.numel() for p in model.parameters())  # noqa: E731 (counted only if needed)
    source = "auto" if name in (None, AUTO) else "requested"
    name = choose_engine(name, backend, num_params=num_params)
    factory = engine_factory(name)
    translate = getattr(factory, "translate_settings", None)
    options = dict(translate(settings) if settings is not None and translate is not None else {})
    options.update(engine_kwargs)
    options = backend.check_and_update_engine_options(name, options)
    log.info("rollout engine %s (%s) on backend %s; available: %s; options: %s",
             name, source, backend.name, ", ".join(available_engines(backend)), options or "{}")
    return factory(model=model, model_path=model_path, tokenizer=tokenizer, backend=backend, **options)
