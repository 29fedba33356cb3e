"""Choosing a rollout engine: ``make_engine(name, ...)``.

Engine classes are found by name in the entry-point group ``portrl.rollout_engines`` (the
built-in ``hf`` engine and the engines under ``backends/`` are registered there in
pyproject.toml, exactly as a third-party engine would be) or through :func:`register_engine`.
A name must also be offered by the backend (``backend.rollout_engines()``, which reflects what is
installed); otherwise the error lists the engines that are available. The choice is logged.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, Callable

from portrl.rollout.engine import RolloutEngine

ENTRY_POINT_GROUP = "portrl.rollout_engines"
AUTO = "auto"

log = logging.getLogger(__name__)

_registered: dict[str, Callable[..., RolloutEngine]] = {}
# Core engines, found even when the installed package metadata is older than the source tree.
_BUILTIN = {"hf": "portrl.rollout.hf_engine:HFEngine"}


class RolloutEngineError(RuntimeError):
    """An engine name is unknown or not available on this backend."""


def register_engine(name: str, factory: Callable[..., RolloutEngine]) -> None:
    """Register ``factory`` (an engine class or a callable taking the make_engine keywords) under ``name``."""
    _registered[name] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found = {name: importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in _BUILTIN.items()}
    found.update({ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})
    return found


def engine_names() -> list[str]:
    """Every engine name known here (registered or declared), whether or not a backend offers it."""
    return sorted(set(_registered) | set(_entry_points()))


def engine_factory(name: str) -> Callable[..., RolloutEngine]:
    """The factory registered for ``name`` (loading its entry point); unknown names list the known ones."""
    if name in _registered:
        return _registered[name]
    eps = _entry_points()
    if name not in eps:
        raise RolloutEngineError(f"unknown rollout engine {name!r}; known engines: {', '.join(engine_names()) or 'none'}")
    factory = eps[name].load()
    _registered[name] = factory
    return factory


def _resolve_backend(backend: Any):
    from portrl.device import get_backend, resolve_backend

    if backend is None:
        return resolve_backend()
    if isinstance(backend, str):
        return get_backend(backend) if backend != AUTO else resolve_backend()
    return backend


def available_engines(backend: Any = None) -> list[str]:
    """Engines this backend offers that are also registered, best first."""
    backend = _resolve_backend(backend)
    known = set(engine_names())
    return [e for e in backend.rollout_engines() if e in known]


def make_engine(
    name: str | None,
    *,
    model: Any = None,
    model_path: str | None = None,
    tokenizer: Any = None,
    backend: Any = None,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """Build the rollout engine ``name`` ("auto" or None: the backend's first available) for ``backend``.

    ``backend`` is a Backend, a backend name, or None (resolved as the CLI does). The backend's
    ``rollout_fixups(name)`` are applied first; ``engine_kwargs`` override them.
    """
    backend = _resolve_backend(backend)
    offered = list(backend.rollout_engines())
    available = available_engines(backend)
    if name in (None, AUTO):
        if not available:
            raise RolloutEngineError(f"backend {backend.name!r} offers no registered rollout engine (offers: {offered})")
        name = available[0]
        source = "auto"
    else:
        source = "requested"
    if name not in offered:
        known = " (it is a known engine, but its package is not installed for this backend)" if name in engine_names() else ""
        raise RolloutEngineError(
            f"rollout engine {name!r} is not available on backend {backend.name!r}{known}; "
            f"available: {', '.join(available) or 'none'}"
        )
    factory = engine_factory(name)
    kwargs = {**backend.rollout_fixups(name), **engine_kwargs}
    log.info(
        "rollout engine %s (%s) on backend %s; available: %s; options: %s",
        name, source, backend.name, ", ".join(available), kwargs or "{}",
    )
    return factory(model=model, model_path=model_path, tokenizer=tokenizer, backend=backend, **kwargs)
