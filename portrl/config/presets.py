"""Preset files: ``configs/{device,algorithm,data,model}/<name>.yaml``, shipped as ``portrl.configs``.

A preset is a partial config (any of the groups of :class:`portrl.config.schema.PortRLConfig`)
merged over the defaults by :func:`portrl.config.compose`, with one optional top-level key, ``keep:``: the dotted
keys whose values a later preset does not replace (what the algorithm needs; the precedence rule is in
portrl/config/preset_layers.py). A name that ends in ``.yaml`` / ``.yml``
and exists on disk is read from that path instead, so users can keep their own presets.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

from portrl.errors import UserError

GROUPS = ("device", "algorithm", "data", "model")


class ConfigError(UserError, ValueError):
    """A config, preset or override is invalid; the message names the key and what is valid."""


def _group_dir(group: str):
    if group not in GROUPS:
        raise ConfigError(f"unknown preset group {group!r}; groups: {', '.join(GROUPS)}")
    return resources.files("portrl.configs").joinpath(group)


def list_presets(group: str) -> list[str]:
    """Names of the shipped presets of ``group``, sorted."""
    folder = _group_dir(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_source(group: str, name: str) -> str:
    """A readable location for error messages (``configs/algorithm/dapo.yaml`` or the user's path)."""
    if _is_path(name):
        return name
    return f"configs/{group}/{name}.yaml"


def _is_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).expanduser().is_file()


def load_preset(group: str, name: str) -> dict[str, Any]:
    """The preset's content as a plain dict (not yet checked against the schema).

    An unknown name is a :class:`ConfigError` listing the presets of the group.
    """
    import yaml  # noqa: PLC0415  (CLI start-up: `portrl config list` reads only file names)

    if _is_path(name):
        text = Path(name).expanduser().read_text()
    else:
        names = list_presets(group)
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown {group} preset {name!r}; available: {', '.join(names)}.{hint}")
        text = _group_dir(group).joinpath(f"{name}.yaml").read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{preset_source(group, name)} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{preset_source(group, name)} must be a mapping of config groups, got {type(data).__name__}")
    return data
