"""Run configuration: the structured schema, presets and their composition.

Public API (imported lazily so that ``import portrl.config`` does no work)::

    compose(device=None, preset=None, algorithm=None, data=None, model=None, config_file=None,
            overrides=(), check=True) -> DictConfig
    to_yaml(cfg) -> str;  save_yaml(cfg, path)  (atomic)
    validate(cfg) -> None (raises ConfigError listing every problem)
    list_presets(group) -> list[str];  load_preset(group, name) -> dict;  ConfigError
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "compose": "portrl.config.composition",
    "to_yaml": "portrl.config.composition",
    "save_yaml": "portrl.config.composition",
    "split_overrides": "portrl.config.composition",
    "validate": "portrl.config.checks",
    "list_presets": "portrl.config.presets",
    "load_preset": "portrl.config.presets",
    "ConfigError": "portrl.config.presets",
    "GROUPS": "portrl.config.presets",
    "default_config": "portrl.config.options_schema",
    "PortRLConfig": "portrl.config.schema",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'portrl.config' has no attribute {name!r}")
