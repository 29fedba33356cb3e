"""The configuration reference, generated from the typed config: ``python -m portrl.config.reference``.

Every leaf key of the run schema (:func:`portrl.config.options_schema.run_schema`: the dataclasses of
portrl/config/schema*.py plus the options the registered algorithms declare) becomes one row: its type, its schema
default, its valid values, the name verl gives it and a description. Where each comes from:

* type and default: the dataclass field (``portrl.config.keys.type_name``; a default factory is called);
* valid values: the names of ``portrl.config.checks.CHOICES`` and of the async / multi-turn checks, the registries
  the config checks against (the names registered in this process), each range rule the range checks state
  (recorded by running them on the default config), a declared option's range (``portrl.algo.options.range_text``)
  and :data:`portrl.config.reference_text.RULES_ELSEWHERE`;
* description: the field's comment in its class's source (on the field's line, or the comment lines right above
  it), else the option's ``doc``, else :data:`portrl.config.reference_text.DESCRIPTIONS`;
* verl's name: :data:`portrl.config.reference_text.VERL_NAMES`.

The committed page is docs/reference/configuration.md; tests/test_config_reference.py regenerates it in a fresh
process and fails when the two differ or a key has no description.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import lru_cache
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from omegaconf.base import Container

from portrl.algo import registered
from portrl.algo.options import range_text, rule
from portrl.config import checks
from portrl.config.checks import _Problems
from portrl.config.keys import type_name
from portrl.config.options_schema import declared, default_config, run_schema
from portrl.config.reference_text import DESCRIPTIONS, RULES_ELSEWHERE, VERL_NAMES
from portrl.config.schema_agent import SANITY_CHECK_MODES, TRUNCATE_SIDES
from portrl.config.schema_trainer import MODES, STALE_SAMPLES
from portrl.config.verl_aliases import ALIASES

#: the page's command, printed in its header
COMMAND = "python -m portrl.config.reference > docs/reference/configuration.md"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key of the reference."""

    key: str
    type: str
    default: str
    valid: str
    verl: str
    description: str


@lru_cache(maxsize=None)
def _comments(cls: type) -> Dict[str, str]:
    """Field name -> its comment in ``cls``'s source (the line's own comment, else the comment lines above it)."""
    try:
        text = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class made at run time (an extended schema class) has no source
        return {}
    lines: Dict[int, tuple] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    out: Dict[str, str] = {}
    node = ast.parse(text).body[0]
    for stmt in getattr(node, "body", []):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        own = lines.get(stmt.lineno)
        if own and not own[1]:
            out[stmt.target.id] = own[0]
            continue
        above: List[str] = []
        line = stmt.lineno - 1
        while line in lines and lines[line][1]:
            above.insert(0, lines[line][0])
            line -= 1
        if above:
            out[stmt.target.id] = " ".join(above)
    return out


def _declaring_class(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body declares field ``name`` (the extended classes subclass them)."""
    for base in cls.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


def _description(cls: type, f: dataclasses.Field, key: str) -> str:
    owner = _declaring_class(cls, f.name)
    return (_comments(owner).get(f.name) or rule(f).get("doc") or DESCRIPTIONS.get(f"{owner.__name__}.{f.name}")
            or DESCRIPTIONS.get(key, ""))


def _show(value: Any) -> str:
    """A default as it is written in an override: null, true, 0.001, [a, b], {}."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


class _RangeRecorder(_Problems):
    """The range checks' problem list that records every rule they state, broken or not. ``cfg`` is the container
    (a merged config; the checks read it by dotted key)."""

    def __init__(self, cfg: Container, rules: Dict[str, str]):
        super().__init__(cfg)
        self.rules = rules

    def need(self, ok: bool, key: str, rule_text: str) -> None:
        self.rules.setdefault(key, rule_text)


def _valid_values() -> Dict[str, str]:
    """Key -> its valid values in words, from the checks of portrl/config (see the module's docstring)."""
    def one_of(names) -> str:
        return "one of " + ", ".join(_show(n) for n in names)

    out: Dict[str, str] = {key: one_of(names) for key, names in checks.CHOICES.items()}
    out.update({"trainer.mode": one_of(MODES), "async_training.stale_samples": one_of(STALE_SAMPLES),
                "rollout.multi_turn.tool_response_truncate_side": one_of(TRUNCATE_SIDES),
                "rollout.multi_turn.tokenization_sanity_check_mode": one_of(SANITY_CHECK_MODES),
                "trainer.loggers": "each one of " + ", ".join(checks.LOGGERS)})
    for key, kind in checks.REGISTRY_KEYS.items():
        out[key] = f"a registered {kind}: " + ", ".join(registered(kind))
    rules: Dict[str, str] = {}
    for variant in ({}, {"algorithm": {"kl_ctrl": {"type": "adaptive"}}, "model": {"sft_warm_start": True}}):
        cfg = OmegaConf.merge(default_config(), variant)
        for check in (checks._optimizer_ranges, checks._policy_ranges, checks._sampling_and_data_ranges,
                      checks._run_ranges):
            check(cfg, _RangeRecorder(cfg, rules))
    for _owner, section, f, _tp in declared():
        text = range_text(f)
        if text:
            rules.setdefault(f"{section}.{f.name}", text)
    rules.update({k: v for k, v in RULES_ELSEWHERE.items() if k not in rules})
    for key, text in rules.items():
        out[key] = f"{out[key]}; {text}" if key in out else text
    return out


def entries() -> List[Entry]:
    """Every leaf key of the run schema, in the schema's order."""
    valid = _valid_values()
    out: List[Entry] = []

    def walk(cls: type, prefix: str, defaults: Any) -> None:
        """``defaults``: the group's default instance (a parent may set another default, e.g. critic.optim.lr)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, key = hints[f.name], f"{prefix}{f.name}"
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, key + ".", getattr(defaults, f.name))
                continue
            out.append(Entry(key, type_name(tp), _show(getattr(defaults, f.name)), valid.get(key, ""),
                             VERL_NAMES.get(key, ""), _description(cls, f, key)))

    root = run_schema()
    walk(root, "", root())
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: Optional[List[Entry]] = None) -> str:
    """The reference page in Markdown: one table per top-level group."""
    rows = entries() if rows is None else rows
    lines = [
        "# Configuration reference",
        "",
        f"<!-- generated by `{COMMAND}`; do not edit by hand -->",
        "",
        "Every key of a run's config: its type, its default in the schema (a preset may set another: "
        "`portrl config show` prints the resolved config of a command), the values the config checks accept, "
        "the name verl gives the same setting (empty where verl has none, or one that differs) and what it does. "
        "Set a key with an override (`portrl train actor.optim.lr=3e-4`), in a preset or in a YAML file. "
        "Checks across keys (batch sizes that divide, what an algorithm needs) are in `portrl/config/checks.py`; "
        "a key outside its range stops the command with one line naming it.",
        "",
        "verl's names of the mesh sizes and memory levers are accepted as aliases of portrl's keys, in a YAML file "
        "(`--config`) and in overrides: " + ", ".join(f"`{alias}` (`{key}`)" for alias, key in ALIASES.items()) + ". Setting one and "
        "its portrl key to different values in the same file, or in the same command line, is an error.",
        "",
        "A value may refer to another key (`${data.max_response_length}`) and use omegaconf's resolvers, except "
        "`${oc.env:NAME}`: a value that reads an environment variable is refused with one line naming the key "
        "(escaped or inside another resolver too), because the variable's value (a token, say) would be saved "
        "with the run (`run.json`, the checkpoints' manifests) and logged (`portrl config show`, the config "
        "wandb and mlflow get). Write the value itself, or let the shell expand it on the command line "
        "(`trainer.experiment_name=$NAME`), and leave a secret in the environment of the program that reads it "
        "(wandb reads `WANDB_API_KEY`).",
        "",
    ]
    group = None
    for e in rows:
        top = e.key.split(".", 1)[0]
        if top != group:
            group = top
            lines += ["", f"## {top}", "", "| key | type | default | valid values | verl | description |",
                      "|---|---|---|---|---|---|"]
        verl = f"`{e.verl}`" if e.verl else ""
        lines.append(f"| `{e.key}` | {_cell(e.type)} | `{_cell(e.default)}` | {_cell(e.valid)} | {_cell(verl)} | "
                     f"{_cell(e.description)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
