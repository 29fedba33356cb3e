"""Options an estimator, an objective or a policy loss declares next to its function.

An options class is a dataclass whose fields are the config keys of one algorithm, each with a default and, when it
has one, a valid range (:func:`option`)::

    @dataclass
    class TD0Options:
        td_scale: float = option(1.0, gt=0, doc="scale of the TD error")

    register_estimator(EstimatorSpec("td0", td0, options=TD0Options))

The class attribute ``SECTION`` says where its keys live in the run config: ``"algorithm"`` (the default; a plugin's
options are ``algorithm.<field>``), or, for the built-ins that keep verl's paths, ``"actor"`` (``actor.tau_pos``) or
``"actor.policy_loss"`` (``actor.policy_loss.clip_cov_ratio``). ``options`` of a record is one class, a tuple of
classes (keys in two sections, e.g. SPPO's ``algorithm.sppo_eta`` and ``actor.sppo_eta``), or None.

Scopes (:func:`placements`): a built-in's key (declared by a class of portrl's own modules) is always
``<SECTION>.<field>``, and another declaration of it must be the same. A plugin's key is ``<SECTION>.<field>`` too,
unless plugins declare that field differently (type, default, range or doc): then each of them has it under its
own name, ``<SECTION>.<name>.<field>`` (``algorithm.td0.horizon``, ``algorithm.td1.horizon``), so two plugins that
never heard of each other do not break each other's runs, nor anybody's.

Who reads the declarations: ``portrl.config.options_schema`` merges every registered one into the typed config (so
the keys are valid, typed and defaulted, and unknown ones are still refused) and checks the declared ranges and
choices; ``compute_advantage`` passes an estimator its options as the keywords its function names; the
policy-gradient objective puts the chosen policy loss's options into the loss's ``config`` mapping.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from portrl.algo.registry import ADV_ESTIMATORS, OBJECTIVES, POLICY_LOSSES, load_plugins

SECTIONS = ("algorithm", "actor", "actor.policy_loss")
_META = "portrl_option"
#: policy-loss name -> its options classes (policy losses are plain functions in their registry)
POLICY_LOSS_OPTIONS: Dict[str, Tuple[type, ...]] = {}


def option(default: Any = None, *, ge: Optional[float] = None, gt: Optional[float] = None,
           le: Optional[float] = None, lt: Optional[float] = None, choices: Optional[Sequence[Any]] = None,
           doc: str = "") -> Any:
    """A dataclass field of an options class: ``default`` and the valid range (``ge``/``gt`` lower, ``le``/``lt``
    upper bound) or ``choices``; ``None`` is always valid for a field whose default is None (off / automatic)."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": tuple(choices) if choices is not None else None,
            "doc": doc}
    if isinstance(default, (list, dict)):
        raise TypeError("option: a list or dict default must be None (lists are mutable); use None for 'unset'")
    return dataclasses.field(default=default, metadata={_META: meta})


def rule(f: dataclasses.Field) -> Dict[str, Any]:
    """The range / choices :func:`option` recorded on field ``f`` (empty bounds for a plain dataclass field)."""
    return dict(f.metadata.get(_META, {}))


def range_text(f: dataclasses.Field) -> str:
    """The valid values of ``f`` in words (``must be >= 0 and <= 1 (or null)``); empty when any value is valid."""
    r = rule(f)
    bounds = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
    parts = [f"{op} {r[k]:g}" for k, op in bounds if r.get(k) is not None]
    text = ""
    if r.get("choices") is not None:
        text = "must be one of " + ", ".join(map(repr, r["choices"]))
    elif parts:
        text = "must be " + " and ".join(parts)
    if text and f.default is None:
        text += " (or null)"
    return text


def out_of_range(f: dataclasses.Field, value: Any) -> bool:
    """Whether ``value`` breaks the range or choices declared on ``f`` (None is valid where the default is None)."""
    r = rule(f)
    if value is None:
        return f.default is not None and f.default is not dataclasses.MISSING
    if r.get("choices") is not None:
        return value not in r["choices"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    checks = (("gt", lambda b: value > b), ("ge", lambda b: value >= b), ("lt", lambda b: value < b),
              ("le", lambda b: value <= b))
    return any(r.get(k) is not None and not ok(r[k]) for k, ok in checks)


def as_classes(options: Any, owner: str) -> Tuple[type, ...]:
    """``options`` (None, a dataclass, or a tuple of them) as a tuple, each checked: a dataclass type whose fields
    all have defaults, with a ``SECTION`` among :data:`SECTIONS`. A bad declaration is a TypeError naming ``owner``."""
    classes = () if options is None else tuple(options) if isinstance(options, (tuple, list)) else (options,)
    for cls in classes:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{owner}: options must be a dataclass type (or a tuple of them), got {cls!r}")
        if section_of(cls) not in SECTIONS:
            raise TypeError(f"{owner}: {cls.__name__}.SECTION={section_of(cls)!r} is not one of {', '.join(SECTIONS)}")
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TypeError(f"{owner}: option {cls.__name__}.{f.name} needs a default")
    return classes


def section_of(cls: type) -> str:
    """The config section (dotted) where ``cls``'s keys live; ``algorithm`` unless the class says otherwise."""
    return str(getattr(cls, "SECTION", "algorithm"))


def fields_of(options: Any) -> Iterator[Tuple[str, dataclasses.Field, Any]]:
    """``(section, field, type)`` of every field of the options classes ``options``."""
    for cls in as_classes(options, "options"):
        yield from _class_fields(cls)


@lru_cache(maxsize=None)
def _class_fields(cls: type) -> Tuple[Tuple[str, dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((section_of(cls), f, hints[f.name]) for f in dataclasses.fields(cls))


def option_values(options: Any, sections: Mapping[str, Any],
                  owner: Optional[Tuple[str, str]] = None) -> Dict[str, Any]:
    """The values of the options ``options`` declares, read from the config ``sections`` (section name -> config
    node, e.g. ``{"algorithm": cfg.algorithm}``); a section not given, or a key missing from it (a config built
    before the declaration), gives the declared default. ``owner`` (kind, name), e.g. ``("adv_estimator", "td0")``:
    whose options they are, so that a key scoped under its owner's name (:func:`placements`) is read there. Lists
    and mappings come back as plain Python."""
    scoped = {(p.section, p.field.name): p.scope for p in placements() if p.scope and (p.kind, p.name) == owner} \
        if owner is not None else {}
    out: Dict[str, Any] = {}
    for section, f, _ in fields_of(options):
        node = sections.get(section)
        scope = scoped.get((section, f.name))
        if scope is not None and node is not None:
            node = node.get(scope)
        value = node.get(f.name, f.default) if node is not None else f.default
        if hasattr(value, "items") or (hasattr(value, "__iter__") and not isinstance(value, (str, bytes))):
            from omegaconf import OmegaConf  # noqa: PLC0415  (a config node; plain data passes through)
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        out[f.name] = value
    return out


def register_policy_loss_options(name: str, options: Any) -> None:
    """Declare the options of the policy loss ``name`` (a registered function); the same classes again are a no-op,
    others under the same name a ValueError."""
    classes = as_classes(options, f"policy_loss {name!r}")
    old = POLICY_LOSS_OPTIONS.get(name)
    if old is not None and old != classes:
        raise ValueError(f"policy_loss {name!r} already declares options {[c.__name__ for c in old]}")
    POLICY_LOSS_OPTIONS[name] = classes


def policy_loss(name: str, options: Any = None) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated function as policy loss ``name`` with its ``options``; returns it."""

    def add(fn: Callable) -> Callable:
        POLICY_LOSSES.register(name, fn)
        if options is not None:
            register_policy_loss_options(name, options)
        return fn

    return add


def policy_loss_options(name: str) -> Tuple[type, ...]:
    """The options classes policy loss ``name`` (or an alias of it) declares; () when none."""
    return POLICY_LOSS_OPTIONS.get(POLICY_LOSSES.resolve(str(name)), ())


class Placed(NamedTuple):
    """One declared option and where it lives: ``<section>.<field>``, or ``<section>.<scope>.<field>`` when its key
    is scoped under its owner's name (see the module docstring)."""

    kind: str  # adv_estimator | objective | policy_loss
    name: str  # the owner's registered name
    section: str  # one of SECTIONS
    scope: Optional[str]  # the owner's name when scoped, else None
    field: dataclasses.Field
    type: Any
    builtin: bool  # declared by a class of portrl's own modules

    @property
    def owner(self) -> str:
        """The owner as messages name it: ``adv_estimator 'gae'``."""
        return f"{self.kind} {self.name!r}"

    @property
    def node(self) -> str:
        """The dotted config node holding the key: the section, or ``section.scope``."""
        return f"{self.section}.{self.scope}" if self.scope else self.section

    @property
    def key(self) -> str:
        """The dotted config key: ``algorithm.lam_actor``, ``algorithm.td0.horizon``."""
        return f"{self.node}.{self.field.name}"


def same_declaration(a: Placed, b: Placed) -> bool:
    """Whether two declarations of one field name agree: type, default, range and doc."""
    return a.type == b.type and a.field.default == b.field.default and dict(a.field.metadata) == dict(b.field.metadata)


def declarations() -> List[Tuple[str, str, dataclasses.Field, Any]]:
    """``(owner, section, field, type)`` of every option every registered estimator, objective and policy loss
    declares, plugins included (``owner`` e.g. ``"adv_estimator 'gae'"``), in a fixed order; recomputed only
    when what is registered changes."""
    return [(p.owner, p.section, p.field, p.type) for p in _placed()[0]]


def placements() -> List[Placed]:
    """Every declared option as :class:`Placed`, scopes decided (the module docstring): a plugin's field that another
    plugin declares differently, and no built-in declares, is scoped under its owner's name. A built-in's field
    stays where it is, whatever a plugin says (``portrl.config.options_schema`` refuses a plugin that redeclares it
    differently)."""
    return list(_placed()[1])


def _placed() -> Tuple[List[Placed], List[Placed]]:
    """(every declaration unscoped, every declaration placed), recomputed only when what is registered changes."""
    import portrl.algo  # noqa: F401,PLC0415  (importing the package registers the built-ins)

    load_plugins()
    key = (tuple(ADV_ESTIMATORS._fns.items()), tuple(OBJECTIVES._fns.items()), tuple(POLICY_LOSS_OPTIONS.items()))
    if _LAST[0] != key:
        owners = [(kind, name, as_classes(spec.options, name)) for kind, entries in (("adv_estimator", key[0]),
                  ("objective", key[1])) for name, spec in sorted(entries)]
        owners += [("policy_loss", name, classes) for name, classes in sorted(key[2])]
        flat = [Placed(kind, name, section, None, f, tp, cls.__module__.split(".")[0] == "portrl")
                for kind, name, classes in owners for cls in classes for section, f, tp in _class_fields(cls)]
        _LAST[:] = [key, (flat, [_place(p, flat) for p in flat])]
    return _LAST[1]


def _place(p: Placed, every: List[Placed]) -> Placed:
    """``p`` scoped under its owner's name when it is a plugin's and the plugins that declare its field disagree."""
    same_key = [q for q in every if (q.section, q.field.name) == (p.section, p.field.name)]
    if p.builtin or any(q.builtin for q in same_key) or all(same_declaration(p, q) for q in same_key):
        return p
    return p._replace(scope=p.name)


_LAST: List[Any] = [None, ([], [])]  # [what was registered, (its declarations, placed)]
