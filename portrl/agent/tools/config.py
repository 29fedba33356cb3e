"""The tool config (``rollout.multi_turn.tool_config_path``): verl's ``tool_config`` YAML, plus portrl's built-ins.

::

    tools:
      - class_name: my_pkg.tools.WeatherTool      # or my_pkg.tools:WeatherTool, or tools.py:WeatherTool
        config: {api_key_env: WEATHER_KEY}        # the class is built with **config
        tool_schema:                              # optional for a class that sets its own schema
          type: function
          function: {name: weather, description: ..., parameters: {...}}
      - class_name: tools.py:lookup               # a @tool function (portrl.agent.tools.decorator); no config
      - name: calculator                          # portrl's built-ins by short name (BUILTINS)
      - name: python
        config: {timeout_s: 5, memory_mb: 512}
      - name: search
        config: {corpus_path: wiki.jsonl, top_k: 3}

``class_name`` names a :class:`Tool` subclass, a ``@tool`` function (or a plain function, made a tool), or a
built-in's short name; a file path (``path/to/tools.py:Name``) is relative to the YAML's folder, as are the
config values a class lists in ``config_paths`` (the search tool's ``corpus_path``). ``tool_schema`` sets the
tool's schema (and so its name); the schema is checked (portrl.agent.tools.schema). verl's ``config.type:
native`` is accepted and dropped; another type (``mcp``) is not supported.

A relative path under ``configs/`` that is not there (a run outside the repository) is the copy shipped in the wheel
(``portrl.configs``: ``configs/tools/calculator.yaml`` works from any folder). ``open_files=False`` (the config
checks, the prompts' tool list) builds no tool that reads a file named in ``config_paths``: its class, config keys
and schema are checked and it stands as a schema-only :class:`Tool`; the file itself (a search corpus, which may be
large) is read when the run is checked (preflight) and by the rollout worker.

Every mistake is a :class:`ToolConfigError`, one line naming the file and the entry (``tools[2] (x.Y)``): a
missing file, bad YAML, no ``tools`` list, an entry that is not a mapping or has unknown keys, an unknown
built-in, a class that cannot be imported or built, a malformed schema, two tools with one name.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping

import yaml

from portrl.agent.tools.base import Tool
from portrl.agent.tools.decorator import FunctionTool, tool
from portrl.agent.tools.schema import ToolSchemaError, check_schema
from portrl.errors import UserError, yaml_problem

# portrl's built-in tools by short name ("module:class", imported when used)
BUILTINS: Dict[str, str] = {
    "calculator": "portrl.agent.tools.builtin_calculator:CalculatorTool",
    "python": "portrl.agent.tools.builtin_python:PythonTool",
    "search": "portrl.agent.tools.builtin_search:SearchTool",
}
ENTRY_KEYS = ("name", "class_name", "config", "tool_schema")


class ToolConfigError(UserError, ValueError):
    """A tool config that cannot be read or gives no valid tools (one line naming the file and the entry)."""


def find_tool_config(path: "str | Path") -> Path:
    """The file ``path`` names: as given, else the wheel's copy of a relative ``configs/...`` path."""
    file = Path(path).expanduser()
    if not file.is_file() and not file.is_absolute() and file.parts[:1] == ("configs",) and len(file.parts) > 1:
        packaged = resources.files("portrl.configs").joinpath(*file.parts[1:])
        if packaged.is_file():
            return Path(str(packaged))
    return file


def load_tool_config(path: "str | Path", *, open_files: bool = True) -> Dict[str, Tool]:
    """{tool name: tool} of the tool config at ``path`` (module docstring), in the file's order; with
    ``open_files=False`` a tool that reads files named in its ``config_paths`` is a schema-only Tool."""
    file = find_tool_config(path)
    if not file.is_file():
        raise ToolConfigError(f"tool config {str(path)!r} does not exist (rollout.multi_turn.tool_config_path); "
                              "give a YAML file with a 'tools' list")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"tool config {str(path)!r} is not valid YAML: {yaml_problem(exc)}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ToolConfigError(f"tool config {str(path)!r} has no 'tools' list; valid: tools: [{{class_name: ..., "
                              "config: {...}, tool_schema: {...}}, {name: calculator}, ...]")
    tools: Dict[str, Tool] = {}
    where_of: Dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"tool config {str(path)!r}, tools[{i}]"
        made = _entry_tool(entry, where, file.resolve().parent, open_files)
        entry_name = f"tools[{i}] ({_label(entry)})"
        if made.name in tools:
            raise ToolConfigError(f"tool config {str(path)!r}, {entry_name}: a second tool named {made.name!r} (the "
                                  f"first: {where_of[made.name]}); tool names must be unique (set another name in "
                                  "tool_schema)")
        tools[made.name], where_of[made.name] = made, entry_name
    return tools


def tool_schemas(tools: Mapping[str, Tool]) -> List[Dict[str, Any]]:
    """The tools' schemas in order: what the chat template's ``tools=`` gets."""
    return [copy.deepcopy(t.schema) for t in tools.values()]


def _label(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("class_name") or entry.get("name") or "?")
    return "?"


def _entry_tool(entry: Any, where: str, folder: Path, open_files: bool = True) -> Tool:
    """The tool of one entry, its schema checked and its name the schema's."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: an entry is a {type(entry).__name__}, not a mapping; valid keys: "
                              f"{', '.join(ENTRY_KEYS)}")
    where = f"{where} ({_label(entry)})"
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(ENTRY_KEYS)}")
    if "class_name" in entry and "name" in entry:
        raise ToolConfigError(f"{where}: both name and class_name; give one: name for a built-in "
                              f"({', '.join(BUILTINS)}), class_name for a Tool class or @tool function (the tool's "
                              "name comes from its schema)")
    target = entry.get("class_name") or entry.get("name")
    if not isinstance(target, str) or not target:
        raise ToolConfigError(f"{where}: no class_name (a Tool class or @tool function) or name (a built-in: "
                              f"{', '.join(BUILTINS)})")
    config = _config(entry.get("config"), where)
    obj = _resolve(target, where, folder, builtin_only="class_name" not in entry)
    schema = entry.get("tool_schema")
    if not open_files and isinstance(obj, type) and issubclass(obj, Tool) and obj.config_paths:
        _check_config_keys(obj, config, where)
        made = Tool()  # schema only: the class reads files (module docstring)
        made.schema = obj.schema
    else:
        made = _build(obj, config, where, folder)
    if schema is None and not made.schema:
        raise ToolConfigError(f"{where}: no schema: the tool sets none and the entry has no tool_schema; valid: "
                              "tool_schema: {type: function, function: {name: ..., description: ..., parameters: "
                              "{type: object, properties: {...}, required: [...]}}}")
    try:
        made.schema = check_schema(schema if schema is not None else made.schema, where)
    except ToolSchemaError as exc:
        raise ToolConfigError(str(exc)) from None
    made.name = made.schema["function"]["name"]
    return made


def _config(config: Any, where: str) -> Dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: config is a {type(config).__name__}, not a mapping")
    config = dict(config)
    kind = config.pop("type", "native")
    if kind != "native":
        raise ToolConfigError(f"{where}: config.type {kind!r} is not supported; valid: native (a Python tool)")
    return config


def _resolve(target: str, where: str, folder: Path, builtin_only: bool) -> Any:
    """The object ``target`` names: a built-in, ``file.py:Name``, ``pkg.mod:Name`` or ``pkg.mod.Name``."""
    if target in BUILTINS:
        target = BUILTINS[target]
    elif builtin_only or ("." not in target and ":" not in target):
        raise ToolConfigError(f"{where}: unknown built-in tool {target!r}; valid: {', '.join(BUILTINS)} (or "
                              "class_name: a dotted path or file.py:Name)")
    module_part, sep, attr = target.rpartition(":") if ":" in target else target.rpartition(".")
    if not module_part or not attr:
        raise ToolConfigError(f"{where}: class_name {target!r} names no object; valid: pkg.mod.Name, "
                              "pkg.mod:Name or path/to/tools.py:Name")
    try:
        module = _load_file(folder / module_part) if module_part.endswith(".py") else \
            importlib.import_module(module_part)
    except ToolConfigError as exc:
        raise ToolConfigError(f"{where}: {exc}") from None
    except Exception as exc:
        problem = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ToolConfigError(f"{where}: cannot import {module_part!r} ({problem})") from None
    if not hasattr(module, attr):
        raise ToolConfigError(f"{where}: {module_part!r} defines no {attr!r}")
    return getattr(module, attr)


def _load_file(file: Path) -> Any:
    file = file.resolve()
    if not file.is_file():
        raise ToolConfigError(f"tool file {str(file)!r} does not exist (paths are relative to the tool config's "
                              "folder)")
    name = "portrl_tools_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ToolConfigError(f"tool file {str(file)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and get_type_hints look the module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _check_config_keys(cls: type, config: Dict[str, Any], where: str) -> None:
    """``cls(**config)`` would bind: no unknown key, no missing required one."""
    try:
        inspect.signature(cls).bind(**config)
    except TypeError as exc:
        params = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        raise ToolConfigError(f"{where}: cannot be built with config {config}: {exc}; valid config keys: "
                              f"{', '.join(params) or 'none'}") from None


def _build(obj: Any, config: Dict[str, Any], where: str, folder: Path) -> Tool:
    """A fresh Tool from ``obj``: a Tool class built with ``**config``, or a (copied) @tool function."""
    if isinstance(obj, type) and issubclass(obj, Tool):
        for key in obj.config_paths:
            if isinstance(config.get(key), str) and not Path(config[key]).expanduser().is_absolute():
                config[key] = str(folder / config[key])
        try:
            return obj(**config)
        except UserError as exc:
            raise ToolConfigError(f"{where}: {exc}") from None
        except Exception as exc:
            params = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
            raise ToolConfigError(f"{where}: cannot be built with config {config}: {type(exc).__name__}: {exc}; "
                                  f"valid config keys: {', '.join(params) or 'none'}") from None
    if isinstance(obj, Tool) or (callable(obj) and not isinstance(obj, type)):
        if config:
            raise ToolConfigError(f"{where}: a function tool takes no config (got {sorted(config)}); give "
                                  "the row's values as keyword-only parameters instead")
        if isinstance(obj, Tool):
            made = copy.copy(obj)
            made.schema = copy.deepcopy(obj.schema)
            return made
        try:
            made_tool: FunctionTool = tool(obj)
        except TypeError as exc:
            raise ToolConfigError(f"{where}: {exc}") from None
        return made_tool
    raise ToolConfigError(f"{where}: names a {type(obj).__name__}, not a Tool subclass or a @tool function")
