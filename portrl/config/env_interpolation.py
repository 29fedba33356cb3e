"""``${oc.env:NAME}`` refused in a config layer: it would copy an environment variable (a token, say) into the config
that a run records and logs.

omegaconf's other resolvers read neither the environment nor files (``oc.decode`` parses the string it is given),
nor does portrl's ``portrl.scale``; portrl/config/composition.py calls :func:`env_interpolation` on every layer
(presets, the user YAML, the overrides) before merging it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from portrl.config.presets import ConfigError

#: a call of omegaconf's oc.env resolver, escaped (``\${oc.env:X}``, which a later resolve of the config calls) or
#: not, alone or inside another resolver's arguments (``${oc.decode:${oc.env:X}}``)
_ENV_CALL = re.compile(r"\$\{\s*oc\.env\s*:")


def _values(data: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every leaf of nested mappings; a list's items under the list's key."""
    if isinstance(data, Mapping):
        for k, v in data.items():
            yield from _values(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from _values(v, prefix)
    else:
        yield prefix, data


def env_interpolation(data: Mapping[str, Any], source: str) -> None:
    """Raise ConfigError when a value of ``data`` (a layer from ``source``: a preset, the user YAML, an override)
    holds ``${oc.env:...}`` (:data:`_ENV_CALL`): the variable's value would be saved with the run (the identity keys
    in ``run.json`` and the checkpoints' manifests) and logged (the config wandb and mlflow get, ``portrl config
    show``). One line names the key and what to write instead."""
    for key, value in _values(data):
        if isinstance(value, str) and _ENV_CALL.search(value):
            raise ConfigError(
                f"{source}: {key} reads an environment variable (${{oc.env:...}}), which portrl refuses: its value "
                f"would be saved with the run's config and logged; write the value itself (on the command line the "
                f"shell expands {key}=$NAME), and leave a secret such as a token in the environment of the program "
                f"that reads it")
