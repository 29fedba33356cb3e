"""The schema's dotted key paths and their types, for error messages and checks of user input.

``schema_keys()`` maps every dotted path (``algorithm.kl_ctrl.kl_coef``) to its type, the options the registered
algorithms declare included (``portrl.config.options_schema.run_schema``). Fields typed
``Dict[str, X]`` are *open*: any sub-key below them is valid (``device.kernels.rms_norm``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import lru_cache
from typing import Any, Mapping

from portrl.config.options_schema import run_schema
from portrl.config.presets import ConfigError


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def schema_keys() -> dict[str, Any]:
    """Dotted path -> annotated type, for every field (groups and leaves) of the run schema (PortRLConfig and the
    declared options)."""
    return _keys_of(run_schema())


@lru_cache(maxsize=8)
def _keys_of(root: type) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            tp = hints[f.name]
            out[path] = tp
            if _is_dataclass_type(tp):
                walk(tp, path + ".")

    walk(root, "")
    return out


def open_dict_prefixes() -> tuple[str, ...]:
    """Paths of ``Dict[str, X]`` fields: any sub-key below them is valid."""
    return tuple(k for k, tp in schema_keys().items() if typing.get_origin(tp) in (dict, typing.Dict))


def type_name(tp: Any) -> str:
    """``int``, ``Optional[float]``, ``List[str]``, ``Dict[str, int]``, or a group's class name."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " | ".join(type_name(a) for a in args)
        return f"Optional[{inner}]" if len(args) < len(typing.get_args(tp)) else inner
    if origin in (list, typing.List):
        return f"List[{type_name(typing.get_args(tp)[0])}]"
    if origin in (dict, typing.Dict):
        k, v = typing.get_args(tp)
        return f"Dict[{type_name(k)}, {type_name(v)}]"
    if _is_dataclass_type(tp):
        return f"a {tp.__name__} mapping"
    return getattr(tp, "__name__", str(tp))


def is_valid_key(path: str) -> bool:
    return path in schema_keys() or any(path.startswith(p + ".") for p in open_dict_prefixes())


def unknown_key_error(path: str, source: str) -> ConfigError:
    """'unknown key' with the closest valid dotted path (difflib over all paths)."""
    keys = list(schema_keys())
    close = difflib.get_close_matches(path, keys, n=1, cutoff=0.6)
    if not close:  # a misspelt leaf under a right group: compare last components within the group
        head, _, leaf = path.rpartition(".")
        siblings = [k for k in keys if k.rpartition(".")[0] == head]
        near = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.5)
        close = [f"{head}.{near[0]}" if head else near[0]] if near else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{source}: unknown config key {path!r}.{hint}")


def leaf_paths(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of a nested mapping (a mapping under an open Dict field is a leaf's parent)."""
    out = []
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and _is_dataclass_type(schema_keys().get(path)):
            out.extend(leaf_paths(v, path + "."))
        else:  # a leaf, or a whole open Dict field (its sub-keys are free-form, e.g. "0.5b")
            out.append(path)
    return out


def check_keys(data: Mapping[str, Any], source: str) -> list[str]:
    """Raise on the first unknown key of ``data`` (nested); return its leaf paths."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of config groups, got {type(data).__name__}")
    paths = leaf_paths(data)
    for path in paths:
        if not is_valid_key(path):
            raise unknown_key_error(path, source)
    return paths
