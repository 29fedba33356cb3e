"""The run's typed schema: :class:`portrl.config.schema.PortRLConfig` plus the options the algorithms declare.

Every registered estimator, objective and policy loss may declare an options dataclass next to its function
(``portrl/algo/options.py``); :func:`run_schema` adds each declared field to the section its class names
(``algorithm`` by default; the built-ins that keep verl's paths use ``actor`` or ``actor.policy_loss``), so a
declared key is typed, defaulted and valid in a preset, a YAML file or an override, and any other key is still
refused. Plugins count: the declarations are read after the entry points of ``portrl.algorithms`` are loaded, and
the schema is rebuilt when the set of declarations changes (a record registered in the process later).

:func:`check_declared_ranges` is the range / choices check of every declared option, from its declaration.
Two declarations of one key must agree (type, default, range); a key that clashes with a schema field or another
declaration is a :class:`ConfigError` naming both owners.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache
from typing import Any, Dict, List, Tuple

from omegaconf import OmegaConf

from portrl.config.presets import ConfigError
from portrl.config.schema import PortRLConfig

#: one declared key: (owner, section, field, type)
Declaration = Tuple[str, str, dataclasses.Field, Any]


def declared() -> List[Declaration]:
    """Every option declaration of the registered algorithms (plugins loaded first)."""
    import portrl.algo  # noqa: F401,PLC0415  (importing the package registers the built-ins)
    from portrl.algo.options import declarations  # noqa: PLC0415

    return declarations()


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
    """``cls`` with the declared keys of section ``prefix`` added and its sub-sections extended in turn."""
    own = {f.name for f in dataclasses.fields(cls)}
    new_fields: List[Tuple[str, Any, Any]] = []
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
    # named in this module (see __getattr__), so that a config of the class pickles to a Ray worker and back
    name = f"{cls.__name__}_{prefix.replace('.', '_') or 'root'}"
    ext = dataclasses.make_dataclass(name, new_fields, bases=(cls,), namespace={"__doc__": cls.__doc__})
    ext.__module__, ext.__qualname__ = __name__, name
    made[name] = ext
    return ext


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


def check_declared_ranges(cfg) -> List[str]:
    """Every declared option of ``cfg`` outside its declared range or choices, one line each, naming its owner."""
    from portrl.algo.options import out_of_range, range_text  # noqa: PLC0415

    problems = []
    for section, keys in merged_options(declared()).items():
        node = OmegaConf.select(cfg, section)
        for name, (owner, _, f, _) in keys.items():
            value = node.get(name) if node is not None else None
            if node is not None and name in node and out_of_range(f, value):
                problems.append(f"{section}.{name}={value!r} {range_text(f)} (an option of {owner})")
    return problems
