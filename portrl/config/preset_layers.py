"""Which layer of a composed config set each key, and the keys a preset keeps over later presets.

The precedence rule (portrl.config.composition applies it):

* Presets are merged in the order device, algorithm, data, model; a later preset replaces an earlier one's value
  of the same key (the model preset's generic defaults, e.g. the tiny model's ``rollout.n: 8`` of the default run,
  replace the algorithm preset's recipe values).
* Except for the keys a preset lists under its top-level ``keep:`` (dotted keys of values the algorithm needs,
  e.g. SPIN's ``keep: [rollout.n]``: its DPO pairs are two samples of a prompt): no later *preset* replaces
  those.
* The user YAML (``--config``) and the command line's ``key=value`` replace any preset's value, kept or not.

:class:`Origins` records, per dotted key, every layer that set it (its source and value, in order), so that
``portrl config show`` can say where a key's value came from when more than one layer set it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from portrl.config.presets import ConfigError

KEEP = "keep"  # the top-level preset key listing the dotted keys it keeps over later presets


def flat_keys(data: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (a non-empty mapping is descended; anything else is a leaf)."""
    out: Dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def split_keep(data: Mapping[str, Any], source: str) -> Tuple[Dict[str, Any], Tuple[str, ...]]:
    """(the preset without ``keep``, the dotted keys it keeps); a ``keep`` naming a key the preset does not set is
    a ConfigError."""
    body = {k: v for k, v in data.items() if k != KEEP}
    keep = data.get(KEEP) or []
    if isinstance(keep, str):
        keep = [keep]
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise ConfigError(f"{source}: keep must be a list of dotted keys the preset sets, got {keep!r}")
    missing = [k for k in keep if k not in flat_keys(body)]
    if missing:
        raise ConfigError(f"{source}: keep names {', '.join(missing)}, which the preset does not set")
    return body, tuple(keep)


def without_keys(data: Mapping[str, Any], dotted: Any) -> Dict[str, Any]:
    """``data`` less the dotted keys in ``dotted`` (emptied mappings dropped)."""
    out: Dict[str, Any] = {}
    for k, v in data.items():
        if k in dotted:
            continue
        if isinstance(v, Mapping) and v:
            inner = without_keys(v, {d[len(k) + 1:] for d in dotted if d.startswith(f"{k}.")})
            if inner:
                out[k] = inner
        else:
            out[k] = v
    return out


class Origins:
    """Per dotted key, the layers that set it, in the order they were applied: ``[(source, value, applied)]``
    (``applied`` False for a preset's value that an earlier preset's ``keep`` held off)."""

    def __init__(self) -> None:
        self.entries: Dict[str, List[Tuple[str, Any, bool]]] = {}
        self.kept: Dict[str, str] = {}  # dotted key -> the source of the preset that keeps it

    def preset(self, data: Mapping[str, Any], source: str) -> Dict[str, Any]:
        """Record a preset's keys and return what of it to merge: its ``keep`` noted, and the keys an earlier
        preset keeps left out."""
        body, keep = split_keep(data, source)
        held = {k for k in flat_keys(body) if k in self.kept}
        for key, value in flat_keys(body).items():
            self.entries.setdefault(key, []).append((source, value, key not in held))
        for key in keep:
            self.kept[key] = source
        return without_keys(body, held) if held else body

    def user(self, data: Mapping[str, Any], source: str) -> None:
        """Record the user YAML's or an override's keys (always applied)."""
        for key, value in flat_keys(data).items():
            self.entries.setdefault(key, []).append((source, value, True))

    def derived(self, key: str, value: Any, why: str) -> None:
        """Record a value composition derived (``why``: from what)."""
        self.entries.setdefault(key, []).append((why, value, True))

    def contested(self) -> Dict[str, List[Tuple[str, Any, bool]]]:
        """The keys set by more than one layer, with their entries."""
        return {k: v for k, v in self.entries.items() if len(v) > 1}

    def describe(self) -> List[str]:
        """One line per contested key: the value that holds and its source, then what the others set."""
        lines = []
        for key, entries in sorted(self.contested().items()):
            source, value = next((s, v) for s, v, applied in reversed(entries) if applied)
            others = [f"{s} set {v}{'' if applied else ' (held off by keep)'}" for s, v, applied in entries
                      if (s, v) != (source, value) or not applied]
            why = ", keep" if self.kept.get(key) == source else ""
            lines.append(f"{key}: {value} ({source}{why}); {'; '.join(others)}")
        return lines
