"""Composition of a run's config from defaults, presets, a user YAML and command-line overrides.

Order (later wins): defaults (schema) -> device preset -> algorithm preset -> data preset ->
model preset -> user YAML (``--config``) -> dotted overrides (``algorithm.kl_ctrl.kl_coef=0.001``).
One exception among presets: the keys a preset lists under ``keep:`` (what the algorithm needs: SPIN's and PRIME's
``rollout.n``) are not replaced by a later preset; the user YAML and the overrides still replace them
(portrl/config/preset_layers.py). :func:`key_origins` tells, per key, which layers set it.
Shorthand overrides choose presets: ``algorithm=grpo``, ``data=gsm8k``, ``model=qwen2.5-0.5b``,
``device=<device preset>`` or ``device=<backend name>`` (see ``portrl devices``), ``preset=<device preset>``.

The result is a structured, closed omegaconf object: unknown keys are errors that suggest the
closest valid dotted key, wrong types name the key and the expected type. Interpolations are
resolved and ``~`` in path fields is expanded, so the returned config is concrete.

``${oc.env:NAME}`` is refused in every layer (portrl/config/env_interpolation.py): it would copy an environment variable (a
token, say) into the config that a run records and logs. omegaconf's other resolvers read neither the environment
nor files (``oc.decode`` parses the string it is given), nor does portrl's ``portrl.scale``.

Default presets: a group for which no preset is selected gets its default preset
(:data:`DEFAULT_PRESETS`: algorithm ``grpo``, data ``arith``, model ``tiny``), except where the
user YAML or an override points the group elsewhere: a non-null ``model.path`` (your own model: no
``tiny`` learning rates or SFT warm start), ``data.name`` or ``data.train_files`` (your own data).
So ``portrl train`` with no argument is the built-in demo (tiny model, SFT warm start, GRPO on
arith) and ``portrl train model.path=~/m data.train_files=...`` gets only the schema defaults
for those groups. ``portrl config show`` prints what was applied (``algorithm.name``, ``model.size``).

Derived defaults (applied only where neither the user YAML nor an override set the key):
``rollout.tensor_model_parallel_size = device.tp_by_model_size[model.size]``; the mini-batch sizes follow a
``data.train_batch_size`` the user set (portrl/config/batch_follow.py).

:func:`explicit_keys` gives the dotted keys a composed config's user YAML and overrides set, so that a later
step can tell a value the user asked for from a preset's (the preflight fits a preset's batch size to a small
dataset, but refuses a user's).

verl's names of the mesh sizes (``actor_rollout_ref.actor.ulysses_sequence_parallel_size``) are accepted in the
user YAML and the overrides, as their portrl keys (portrl/config/verl_aliases.py).

``device.name_source`` records where ``device.name`` came from (``--device``, ``override device=NAME``,
``preset h100``, the config file, ``override device.name=NAME``), so that a device that is unknown or not
usable is reported with its origin (portrl.device.resolve_backend).
"""

from __future__ import annotations

import copy
import inspect
import os
import tempfile
import typing
import weakref
from functools import lru_cache
from typing import Any, Iterable, Mapping

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from portrl.config.batch_follow import batch_sizes, follow_train_batch
from portrl.config.env_interpolation import env_interpolation
from portrl.config.checks import validate
from portrl.config.keys import check_keys, open_dict_prefixes, schema_keys, type_name
from portrl.config.options_schema import run_schema
from portrl.config.preset_layers import Origins
from portrl.config.presets import ConfigError, list_presets, load_preset, preset_source
from portrl.config.verl_aliases import apply_aliases
from portrl.errors import yaml_problem
from portrl.user_files import ordinary_permissions

SHORTHANDS = ("algorithm", "data", "model", "device", "preset")
DEFAULT_PRESETS = {"algorithm": "grpo", "data": "arith", "model": "tiny"}
# a group's default preset is skipped when the user YAML / overrides set one of these keys (non-null)
_GROUP_ELSEWHERE = {"algorithm": (), "data": ("data.name", "data.train_files"), "model": ("model.path",)}
PATH_KEYS = (
    "model.path", "model.tokenizer_path", "critic.model_path", "reward.model_path", "reward.custom.path",
    "reward_model.model.path", "reward_model.model.ref_path",
    "data.train_files", "data.val_files", "trainer.output_dir",
)
_RESOLVERS_DONE = False
_EXPLICIT: dict[int, tuple[weakref.ref, frozenset]] = {}  # id(config) -> (the config, keys the user set)
_ORIGINS: dict[int, tuple[weakref.ref, Origins]] = {}  # id(config) -> (the config, the layers that set its keys)


def _register_resolvers() -> None:
    """``${portrl.scale:${data.max_response_length},0.2}`` = int(x * f) (used by presets for length ratios)."""
    global _RESOLVERS_DONE
    if _RESOLVERS_DONE:
        return
    def scale(x, f) -> int:
        return int(float(x) * float(f))

    # omegaconf >= 2.4: register_resolver (register_new_resolver warns, deprecated); 2.1-2.3: register_new_resolver
    # (their register_resolver is the legacy one, without replace: an H200 image with 2.3.0 failed on it)
    register = OmegaConf.register_resolver if "replace" in _parameters(OmegaConf.register_resolver) \
        else OmegaConf.register_new_resolver
    register("portrl.scale", scale, replace=True)
    _RESOLVERS_DONE = True


def _parameters(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def split_overrides(overrides: Iterable[str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Split ``key=value`` items into preset selections (shorthands) and dotted overrides."""
    selections: dict[str, str] = {}
    dotted: list[tuple[str, str]] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. algorithm.kl_ctrl.kl_coef=0.001 or algorithm=grpo)")
        key, value = item.split("=", 1)
        key = key.strip().lstrip("+")
        if key in SHORTHANDS:
            selections[key] = value.strip()
        else:
            dotted.append((key, value))
    return selections, dotted


def _wrap_scalars_for_lists(data: Any, prefix: str = "") -> Any:
    """A bare string given for a ``List[...]`` field becomes a one-item list (``data.train_files=a.parquet``)."""
    if not isinstance(data, Mapping):
        return data
    out = {}
    for k, v in data.items():
        path = f"{prefix}{k}"
        tp = schema_keys().get(path)
        if isinstance(v, Mapping):
            out[k] = _wrap_scalars_for_lists(v, path + ".")
        elif isinstance(v, str) and typing.get_origin(tp) in (list, typing.List) and not v.startswith("${"):
            out[k] = [v]
        else:
            out[k] = v
    return out


def _merge(cfg, data: Mapping[str, Any], source: str):
    """Merge a plain mapping into the structured config with readable key/type errors (and no
    :func:`env_interpolation`)."""
    check_keys(data, source)
    env_interpolation(data, source)
    try:
        return OmegaConf.merge(cfg, _wrap_scalars_for_lists(data))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        expected = type_name(schema_keys()[key]) if key in schema_keys() else "a valid value"
        value = _lookup(data, key)
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{source}: {key} expects {expected}, got {value!r} ({first})") from None


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return "?"
        node = node[part]
    return node


def _parse_override(key: str, value: str) -> dict[str, Any]:
    """``a.b.c=v`` -> ``{"a": {"b": {"c": parsed v}}}``; values are parsed as YAML (``null``, ``[1,2]``, ``true``)."""
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={value}: the value is not valid YAML ({yaml_problem(exc)})") from None
    if not isinstance(parsed, str) and parsed is not None and _is_str_field(key):
        parsed = value.strip()  # YAML 1.1 reads off/on/yes/no as booleans: trainer.resume=off stays "off"
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for i in range(1, len(parts)):  # below an open Dict field the rest is one sub-key (tp_by_model_size.0.5b)
        if ".".join(parts[:i]) in open_dict_prefixes():
            parts = parts[:i] + [".".join(parts[i:])]
            break
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = parsed
    return out


def _is_str_field(key: str) -> bool:
    tp = schema_keys().get(key.lstrip("+"))
    return tp is str or (typing.get_origin(tp) is typing.Union and set(typing.get_args(tp)) == {str, type(None)})


def _resolve_device(device: str | None, preset: str | None) -> tuple[str | None, str | None]:
    """(device preset name or None, backend name or None) from ``--device`` and ``--preset``."""
    presets = list_presets("device")
    backend = None
    if device and device in presets and not preset:
        preset = device  # --device h100 selects the preset; cpu is both a backend and a preset
    elif device:
        backend = device
    if backend and backend != "auto" and not preset and backend in presets:
        preset = backend
    return preset, backend


def compose(device: str | None = None, preset: str | None = None, algorithm: str | None = None,
            data: str | None = None, model: str | None = None, config_file: str | os.PathLike | None = None,
            overrides: Iterable[str] = (), check: bool = True):
    """The resolved run config (an omegaconf DictConfig of :class:`PortRLConfig`, closed).

    ``device`` is a backend name (``portrl devices``; or auto) or a device preset name; ``preset`` a
    device preset (``configs/device``). ``check`` runs :func:`portrl.config.checks.validate`.
    """
    _register_resolvers()
    selections, dotted = split_overrides(overrides)
    device_from = f"override device={selections['device']}" if "device" in selections else "--device"
    device = selections.get("device", device)
    preset = selections.get("preset", preset)
    algorithm = selections.get("algorithm", algorithm)
    data = selections.get("data", data)
    model = selections.get("model", model)

    user = _read_user_yaml(config_file) if config_file else {}
    items = [(f"override {key}={value}", _parse_override(key, value)) for key, value in dotted]
    user, items = apply_aliases(user, str(config_file), items)  # verl's names of the mesh sizes -> portrl's keys
    explicit: set[str] = set(check_keys(user, str(config_file))) if config_file else set()
    for source, item in items:
        explicit.update(check_keys(item, source))
    chosen = {"algorithm": algorithm, "data": data, "model": model}
    for group, default in DEFAULT_PRESETS.items():
        if not chosen[group] and not any(_given([user] + [i for _, i in items], k) for k in _GROUP_ELSEWHERE[group]):
            chosen[group] = default

    cfg = _defaults()
    dev_preset, backend = _resolve_device(device, preset)
    name_source = None
    if dev_preset:
        name_source = device_from if device == dev_preset else f"preset {dev_preset}"
    layers = [("device", dev_preset), ("algorithm", chosen["algorithm"]), ("data", chosen["data"]),
              ("model", chosen["model"])]
    origins = Origins()  # which layer set each key; a preset's `keep` (portrl/config/preset_layers.py)
    for group, name in layers:
        if not name:
            continue
        source = preset_source(group, name)
        cfg = _merge(cfg, origins.preset(load_preset(group, name), source), source)
        if group == "device":
            cfg.device.preset = name
        elif group == "algorithm":
            cfg.algorithm.name = name
    if backend:
        if dev_preset and backend != "auto" and cfg.device.name != backend:
            raise ConfigError(f"device preset {dev_preset!r} is for device {cfg.device.name!r}, not {backend!r}; "
                              f"drop --device or choose a {backend} preset")
        if not dev_preset:
            cfg.device.name = backend
        name_source = device_from

    preset_batch = batch_sizes(cfg)  # what the presets set, before the user's values (batch_follow)
    if config_file:
        origins.user(user, str(config_file))
        cfg = _merge(cfg, user, str(config_file))
        if _lookup(user, "device.name") not in ("?", None, "auto"):
            name_source = str(config_file)
    for source, item in items:
        origins.user(item, source)
        cfg = _merge(cfg, item, source)
        if _lookup(item, "device.name") not in ("?", None, "auto"):
            name_source = source
    if all(_lookup(d, "device.name_source") == "?" for d in [user] + [i for _, i in items]):
        cfg.device.name_source = name_source if cfg.device.name != "auto" else None  # a saved config keeps its own

    _derive(cfg, explicit)
    follow_train_batch(cfg, explicit, preset_batch, origins)
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:  # noqa: BLE001 - any interpolation failure is a config error
        raise ConfigError(f"cannot resolve an interpolation: {exc}") from None
    _expand_paths(cfg)
    if check:
        validate(cfg)
    key = id(cfg)
    _EXPLICIT[key] = (weakref.ref(cfg, lambda _ref: _EXPLICIT.pop(key, None)), frozenset(explicit))
    _ORIGINS[key] = (weakref.ref(cfg, lambda _ref: _ORIGINS.pop(key, None)), origins)
    return cfg


def key_origins(cfg) -> Origins | None:
    """Which layer (preset, user YAML, override, a value derived from another) set each key of ``cfg``, a config
    :func:`compose` returned; None for any other config. ``key_origins(cfg).describe()``: the keys set by more than
    one layer, where each value came from (``portrl config show`` prints them)."""
    entry = _ORIGINS.get(id(cfg))
    return entry[1] if entry is not None and entry[0]() is cfg else None


def copy_config(cfg):
    """A deep copy of ``cfg`` that keeps :func:`explicit_keys` (a plain ``copy.deepcopy`` forgets them)."""
    out = copy.deepcopy(cfg)
    keys = explicit_keys(cfg)
    if keys is not None:
        key = id(out)
        _EXPLICIT[key] = (weakref.ref(out, lambda _ref: _EXPLICIT.pop(key, None)), keys)
    return out


def explicit_keys(cfg) -> frozenset | None:
    """The dotted keys (``data.train_batch_size``) that the user YAML or a dotted override set on ``cfg``, a
    config :func:`compose` returned (or :func:`copy_config` copied); a preset's or the schema's values are not
    among them. None for any other config (loaded from a file, copied otherwise)."""
    entry = _EXPLICIT.get(id(cfg))
    return entry[1] if entry is not None and entry[0]() is cfg else None


def _read_user_yaml(config_file: str | os.PathLike) -> dict:
    path = os.path.expanduser(os.fspath(config_file))
    if not os.path.isfile(path):
        raise ConfigError(f"--config {config_file}: no such file")
    try:
        return yaml.safe_load(open(path).read()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config_file} is not valid YAML: {yaml_problem(exc)}") from None


def _given(sources: list, dotted: str) -> bool:
    """Whether any of the nested mappings sets ``dotted`` to a non-null, non-empty value."""
    for data in sources:
        node: Any = data
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node not in (None, [], ""):
            return True
    return False


@lru_cache(maxsize=8)
def _default_template(schema: type):
    return OmegaConf.structured(schema)


def _defaults():
    """A fresh copy of the structured defaults of the run schema (the schema and the algorithms' declared options;
    building them from the dataclasses costs ~0.1 s; a copy ~10x less)."""
    return copy.deepcopy(_default_template(run_schema()))


def _derive(cfg, explicit: set[str]) -> None:
    size = cfg.model.size
    tp = cfg.device.tp_by_model_size
    if "rollout.tensor_model_parallel_size" not in explicit and size and size in tp:
        cfg.rollout.tensor_model_parallel_size = int(tp[size])


def _expand_paths(cfg) -> None:
    for dotted in PATH_KEYS:
        value = OmegaConf.select(cfg, dotted)
        if isinstance(value, str):
            OmegaConf.update(cfg, dotted, os.path.expanduser(value))
        elif value is not None and OmegaConf.is_list(value):
            OmegaConf.update(cfg, dotted, [os.path.expanduser(v) for v in value])


def to_yaml(cfg) -> str:
    """The config as YAML text (interpolations resolved)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def save_yaml(cfg, path: str | os.PathLike) -> None:
    """Write the config as YAML atomically (temp file in the same folder, then rename)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(to_yaml(cfg))
        ordinary_permissions(tmp)  # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
