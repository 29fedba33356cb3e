"""The run's typed schema: :class:`portrl.config.schema.PortRLConfig` plus the options the algorithms declare.

Every registered estimator, objective and policy loss may declare an options dataclass next to its function
(``portrl/algo/options.py``); :func:`run_schema` adds each declared field to the section its class names
(``algorithm`` by default; the built-ins that keep verl's paths use ``actor`` or ``actor.policy_loss``), so a
declared key is typed, defaulted and valid in a preset, a YAML file or an override, and any other key is still
refused. Plugins count: the declarations are read after the entry points of ``portrl.algorithms`` are loaded, and
the schema is rebuilt when the set of declarations changes (a record registered in the process later). A plugin's key
that another plugin declares differently lives under its owner's name (``algorithm.<name>.<field>``: the scopes of
``portrl.algo.options.placements``): the schema gets one sub-section per scope.

:func:`check_declared_ranges` is the range / choices check of every declared option, from its declaration.
Two declarations of one key must agree (type, default, range), which the scopes ensure between plugins; a key that
clashes with a schema field or a built-in's declaration, or a scope that clashes with a schema key, is a
:class:`ConfigError` naming both owners.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache
from typing import Any, Dict, List, Tuple

from omegaconf import OmegaConf

from portrl.algo.options import SECTIONS, out_of_range, placements, range_text
from portrl.config.presets import ConfigError
from portrl.config.schema import PortRLConfig

#: one declared key: (owner, node, field, type); the node is its section, or ``section.<owner name>`` when scoped
Declaration = Tuple[str, str, dataclasses.Field, Any]


def declared() -> List[Declaration]:
    """Every option declaration of the registered algorithms (plugins loaded first), each at its node."""
    return [(p.owner, p.node, p.field, p.type) for p in placements()]


def _same(a: dataclasses.Field, b: dataclasses.Field, ta: Any, tb: Any) -> bool:
    return ta == tb and a.default == b.default and dict(a.metadata) == dict(b.metadata)


def merged_options(decls: List[Declaration]) -> Dict[str, Dict[str, Declaration]]:
    """section -> key -> its declaration, one per key; disagreeing declarations of a key raise ConfigError."""
    out: Dict[str, Dict[str, Declaration]] = {}
    for decl in decls:
        owner, section, f, tp = decl
        have = out.setdefault(section, {}).get(f.name)
        if have is not None and not _same(have[2], f, have[3], tp):
            raise ConfigError(f"option {section}.{f.name} is declared twice, differently: by {have[0]} and {owner} "
                              "(one key, one type, default and range)")
        if have is None:
            out[section][f.name] = decl
    return out


def _extend(cls: type, prefix: str, adds: Dict[str, Dict[str, Declaration]], made: Dict[str, type]) -> type:
    """``cls`` with the declared keys of section ``prefix`` added, a new sub-section per scope under it, and its
    sub-sections extended in turn."""
    own = {f.name for f in dataclasses.fields(cls)}
    new_fields: List[Tuple[str, Any, Any]] = _scopes(cls, prefix, adds, made)
    for name, (owner, _, f, tp) in adds.get(prefix, {}).items():
        if name in own:
            raise ConfigError(f"{owner} declares option {prefix}.{name}, which is already a key of the config schema; "
                              "choose another name")
        default: Any = dataclasses.field(default=f.default, metadata=f.metadata)
        new_fields.append((name, tp, default))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and any(s == sub or s.startswith(sub + ".") for s in adds):
            ext = _extend(tp, sub, adds, made)
            new_fields.append((f.name, ext, dataclasses.field(default_factory=ext)))
    if not new_fields:
        return cls
    return _made(f"{cls.__name__}_{prefix.replace('.', '_') or 'root'}", new_fields, (cls,), cls.__doc__, made)


def _made(name: str, fields: List[Tuple[str, Any, Any]], bases: Tuple[type, ...], doc: Any,
          made: Dict[str, type]) -> type:
    """A new dataclass named in this module (see __getattr__), so that a config of it pickles to a Ray worker and
    back."""
    ext = dataclasses.make_dataclass(name, fields, bases=bases, namespace={"__doc__": doc})
    ext.__module__, ext.__qualname__ = __name__, name
    made[name] = ext
    return ext


def _scopes(cls: type, prefix: str, adds: Dict[str, Dict[str, Declaration]],
            made: Dict[str, type]) -> List[Tuple[str, Any, Any]]:
    """The fields of ``cls`` that hold the scoped keys under section ``prefix``: one sub-section per node of ``adds``
    that is no section (``algorithm.td0``); a scope named like a key of ``cls`` is a ConfigError."""
    own = {f.name for f in dataclasses.fields(cls)}
    out: List[Tuple[str, Any, Any]] = []
    for node, keys in adds.items():
        parent, _, scope = node.rpartition(".")
        if node in SECTIONS or parent != prefix:
            continue
        owners = ", ".join(sorted({owner for owner, _, _, _ in keys.values()}))
        if scope in own:
            raise ConfigError(f"{owners}: its options are scoped at {node} (another plugin declares one of them "
                              "differently), which is already a key of the config schema; choose another name")
        fields = [(name, tp, dataclasses.field(default=f.default, metadata=f.metadata))
                  for name, (_, _, f, tp) in keys.items()]
        sub = _made(f"Options_{node.replace('.', '_')}", fields, (), f"The options of {owners}.", made)
        out.append((scope, sub, dataclasses.field(default_factory=sub)))
    return out


_CLASSES: Dict[str, type] = {}  # the classes of the latest schema built, by name


def __getattr__(name: str) -> Any:
    """The extended classes by name, building the schema when asked (unpickling in a fresh process)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _CLASSES:
        run_schema()
    try:
        return _CLASSES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


@lru_cache(maxsize=8)
def _build(decls: Tuple[Declaration, ...]) -> Tuple[type, Dict[str, type]]:
    made: Dict[str, type] = {}
    root = _extend(PortRLConfig, "", merged_options(list(decls)), made)
    return root, made


def run_schema() -> type:
    """The PortRLConfig dataclass with every declared option merged in (built once per set of declarations: the
    declared fields themselves are the cache key)."""
    root, made = _build(tuple(declared()))
    _CLASSES.clear()
    _CLASSES.update(made)
    return root


def default_config() -> Any:
    """The defaults as a structured (type-checked, closed) omegaconf object, with every option the registered
    estimators, objectives and policy losses declare (:func:`run_schema`)."""
    return OmegaConf.structured(run_schema())


def check_declared_ranges(cfg) -> List[str]:
    """Every declared option of ``cfg`` outside its declared range or choices, one line each, naming its owner."""
    problems = []
    for section, keys in merged_options(declared()).items():
        node = OmegaConf.select(cfg, section)
        for name, (owner, _, f, _) in keys.items():
            value = node.get(name) if node is not None else None
            if node is not None and name in node and out_of_range(f, value):
                problems.append(f"{section}.{name}={value!r} {range_text(f)} (an option of {owner})")
    return problems
