"""The one loader of entry-point plugins: backends (``portrl.backends``), rollout engines
(``portrl.rollout_engines``) and algorithms (``portrl.algorithms``) all load through a :class:`PluginGroup`.

Every group is isolated the same way:

* the entry points of the group are read once (until :meth:`PluginGroup.reset`); a name that two installed
  distributions declare with different values is broken (neither is used);
* each entry point loads on its own, once, when it is first asked for (:meth:`PluginGroup.load`) or when the
  whole group is listed (:meth:`PluginGroup.load_all`), and is then checked by the group's ``check``;
* a plugin that fails in any way (import error, wrong class, a check that raises) is recorded as a
  :class:`BrokenPlugin` with its error, and the other plugins still load;
* every broken plugin reads the same way: ``plugin <module:attr> failed to load: <ErrorType>: <text>``
  (:attr:`BrokenPlugin.message`); ``portrl devices`` lists them for the three groups.

This module imports no other part of portrl, so that every layer can use it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

log = logging.getLogger(__name__)

#: ``check(name, loaded)`` returns what the group keeps for the plugin, or raises (the text says what is wrong)
Check = Callable[[str, Any], Any]


class BrokenPlugin(NamedTuple):
    """A plugin that cannot be used: its entry point's value (``module:attr``) and why (``ErrorType: text``)."""

    value: str
    error: str

    @property
    def message(self) -> str:
        """The one line every registry shows for a broken plugin."""
        return f"plugin {self.value} failed to load: {self.error}"


class PluginLoadError(Exception):
    """Raised by :meth:`PluginGroup.load` for a broken plugin; ``broken`` holds the record, ``str()`` its message."""

    def __init__(self, name: str, broken: BrokenPlugin):
        super().__init__(broken.message)
        self.name, self.broken = name, broken


class PluginGroup:
    """The plugins of one entry-point group (see the module docstring).

    ``kind`` names one plugin in messages (``"backend"``); ``check`` validates (and may transform) what an entry
    point loads; ``builtin`` maps names to ``module:attr`` values that are declared even when the installed
    package metadata is older than the source tree (an installed declaration of the same name replaces them).
    """

    def __init__(self, group: str, kind: str, check: Optional[Check] = None,
                 builtin: Optional[Mapping[str, str]] = None):
        self.group, self.kind = group, kind
        self._check = check
        self._builtin = dict(builtin or {})
        self.reset()

    def reset(self) -> None:
        """Forget what was read and loaded (tests that install plugins call this)."""
        self._declared: Optional[Dict[str, importlib.metadata.EntryPoint]] = None
        self._loaded: Dict[str, Any] = {}
        self._broken: Dict[str, BrokenPlugin] = {}

    def declared(self) -> Dict[str, importlib.metadata.EntryPoint]:
        """Every declared name and its entry point (built-ins, then the installed distributions), read once."""
        if self._declared is None:
            found = {n: importlib.metadata.EntryPoint(n, v, self.group) for n, v in self._builtin.items()}
            installed: Dict[str, str] = {}
            for ep in importlib.metadata.entry_points(group=self.group):
                first = installed.setdefault(ep.name, ep.value)
                if first != ep.value and ep.name not in self._broken:
                    self._broken[ep.name] = BrokenPlugin(
                        ep.value, f"two plugins claim {self.kind} {ep.name!r}: {first} and {ep.value}")
                found[ep.name] = ep
            self._declared = found
        return self._declared

    def names(self) -> list[str]:
        """Every declared name, broken ones included, sorted."""
        return sorted(self.declared())

    def load(self, name: str) -> Any:
        """What plugin ``name`` provides (loaded and checked once). A broken plugin raises
        :class:`PluginLoadError`; a name that is not declared raises ``KeyError``."""
        ep = self.declared()[name]
        if name not in self._loaded and name not in self._broken:
            try:
                loaded = ep.load()
                self._loaded[name] = self._check(name, loaded) if self._check is not None else loaded
            except Exception as exc:  # a third-party plugin may fail in any way; it must not stop the others
                self._broken[name] = BrokenPlugin(ep.value, f"{type(exc).__name__}: {exc}")
                log.debug("%s plugin %s (%s) failed to load: %s", self.kind, name, ep.value, self._broken[name].error)
        if name in self._broken:
            raise PluginLoadError(name, self._broken[name])
        return self._loaded[name]

    def load_all(self) -> Dict[str, Any]:
        """Load every declared plugin not loaded yet; the ones that load, by name (broken ones are recorded)."""
        for name in self.declared():
            try:
                self.load(name)
            except PluginLoadError:
                pass
        return dict(self._loaded)

    def broken(self) -> Dict[str, BrokenPlugin]:
        """The plugins found broken so far, by name (:meth:`load_all` first to know them all)."""
        self.declared()
        return dict(self._broken)
