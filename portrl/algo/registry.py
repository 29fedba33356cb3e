"""Name -> entry registries for the algorithm core.

Five registries exist: ``adv_estimator`` and ``objective`` (records of ``portrl.algo.spec``: what an
algorithm needs and which function computes it), ``policy_loss``, ``loss_agg_mode`` and ``kl_penalty``
(functions). A registry maps a name to one entry:

* registering the *same* entry twice under a name is allowed (idempotent re-import; equal records count
  as the same);
* registering a *different* entry under a taken name is a ``ValueError``;
* asking for an unknown name is a ``KeyError`` whose message lists every registered name;
* aliases (other spellings of the same entry, e.g. ``k1`` for ``kl``) resolve to their target
  and are listed separately from the canonical names.

Where entries come from: the built-ins register themselves in the modules that define them (listed in
``portrl/algo/spec.py`` for estimators and objectives; ``policy_losses.py``, ``policy_losses_cov.py``,
``aggregation.py``, ``kl.py`` and ``trl_aliases.py`` for the others), all imported by ``portrl/algo/__init__.py``;
other packages register theirs through the entry-point group ``portrl.algorithms`` (:func:`load_plugins`: each
entry point names a module, or a function, that calls ``register_estimator`` / ``register_objective`` /
``POLICY_LOSSES.register`` when loaded; they load through :class:`portrl.plugins.PluginGroup`, isolated as backends
and rollout engines are), or by calling those functions in the same process.
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional

from portrl.plugins import BrokenPlugin, PluginGroup

PLUGIN_GROUP = "portrl.algorithms"


def _run(name: str, loaded: Any) -> Any:
    """An algorithm plugin is a module (imported: it registered its entries) or a function, called now."""
    if callable(loaded) and not isinstance(loaded, types.ModuleType):
        loaded()
    return loaded


PLUGINS = PluginGroup(PLUGIN_GROUP, "algorithm", _run)


def load_plugins() -> Dict[str, BrokenPlugin]:
    """Load the entry points of ``portrl.algorithms``, each once and on its own (a module is imported, a function
    is called; either registers its entries) through :class:`portrl.plugins.PluginGroup`: a plugin that fails is
    recorded with its error and the others still load; returns the broken ones. Registries call this before they
    call a name unknown, so a plugin's names work in every process (Ray workers included) without an import in the
    user's code."""
    PLUGINS.load_all()
    return PLUGINS.broken()


class UnknownNameError(KeyError, ValueError):
    """An unknown registry name. Subclasses both KeyError and ValueError so either can be caught."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _describe(entry: Any) -> str:
    fn = getattr(entry, "fn", entry)  # a spec record names its function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class Registry:
    """A registry of entries of one kind (e.g. ``"policy_loss"``): functions, or spec records."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: Dict[str, Any] = {}
        self._aliases: Dict[str, str] = {}

    def register(self, name: str, fn: Optional[Any] = None):
        """Register ``fn`` under ``name``; usable as ``@reg.register("name")``."""

        def _add(f: Any) -> Any:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind}: a registry name must be a non-empty string, got {name!r}")
            if name in self._aliases:
                raise ValueError(f"{self.kind}: {name!r} is already an alias of {self._aliases[name]!r}")
            old = self._fns.get(name)
            if old is not None and old is not f and old != f:
                raise ValueError(
                    f"{self.kind}: {name!r} is already registered to {_describe(old)}; "
                    f"refusing to replace it with {_describe(f)}"
                )
            self._fns[name] = f
            return f

        return _add(fn) if fn is not None else _add

    def alias(self, alias: str, target: str) -> None:
        """Make ``alias`` another name for the registered entry ``target``."""
        if target not in self._fns:
            raise self._unknown(target)
        if alias in self._fns:
            raise ValueError(f"{self.kind}: {alias!r} is a registered name, it cannot also be an alias")
        if self._aliases.get(alias, target) != target:
            raise ValueError(f"{self.kind}: alias {alias!r} already points to {self._aliases[alias]!r}")
        self._aliases[alias] = target

    def resolve(self, name: str) -> str:
        """The canonical name for ``name`` (itself or an alias target); a name not found loads the algorithm
        plugins once (:func:`load_plugins`) and is looked up again; unknown names raise."""
        for attempt in range(2):
            if name in self._fns:
                return name
            if name in self._aliases:
                return self._aliases[name]
            if attempt == 0:
                load_plugins()
        raise self._unknown(name)

    def get(self, name: str) -> Any:
        return self._fns[self.resolve(name)]

    def names(self, include_aliases: bool = False) -> List[str]:
        out = sorted(self._fns)
        return out + sorted(self._aliases) if include_aliases else out

    def aliases(self) -> Dict[str, str]:
        return dict(self._aliases)

    def __contains__(self, name: object) -> bool:
        return name in self._fns or name in self._aliases

    def _unknown(self, name: object) -> UnknownNameError:
        extra = f"; aliases: {', '.join(sorted(self._aliases))}" if self._aliases else ""
        broken = PLUGINS.broken()
        if broken:
            extra += "; broken algorithm plugins: " + "; ".join(f"{n}: {b.message}" for n, b in sorted(broken.items()))
        return UnknownNameError(
            f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._fns))}{extra}"
        )


ADV_ESTIMATORS = Registry("adv_estimator")  # EstimatorSpec records (portrl.algo.spec.register_estimator)
OBJECTIVES = Registry("objective")  # ObjectiveSpec records (portrl.algo.spec.register_objective)
POLICY_LOSSES = Registry("policy_loss")
LOSS_AGG_MODES = Registry("loss_agg_mode")
KL_PENALTIES = Registry("kl_penalty")

_KINDS = {r.kind: r for r in (ADV_ESTIMATORS, OBJECTIVES, POLICY_LOSSES, LOSS_AGG_MODES, KL_PENALTIES)}


def get_registry(kind: str) -> Registry:
    """The registry of ``kind`` ("adv_estimator", "objective", "policy_loss", "loss_agg_mode", "kl_penalty")."""
    try:
        return _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown registry kind {kind!r}; valid: {', '.join(sorted(_KINDS))}") from None


def registered(kind: str, include_aliases: bool = False) -> List[str]:
    """Sorted canonical names registered under ``kind`` (aliases appended if asked), plugins included."""
    import portrl.algo  # noqa: F401,PLC0415  (the package fills the registries; it imports this module)

    load_plugins()

    return get_registry(kind).names(include_aliases=include_aliases)
