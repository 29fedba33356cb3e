"""Every recipe under examples/ composes into a valid config (its presets, keys and values exist)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from portrl.config import compose

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.sh"))


def _wrapped(script: Path):
    """``(base script, extra arguments)`` of a recipe that runs another with more overrides
    (``exec "$(dirname "$0")/base.sh" key=value ... "$@"``), else None."""
    found = re.search(r'^exec "\$\(dirname "\$0"\)/([\w.-]+\.sh)" (.*?)(?<!\\)$', script.read_text(), flags=re.M | re.S)
    if found is None:
        return None
    return script.with_name(found.group(1)), shlex.split(found.group(2).replace("\\\n", " ").replace('"$@"', ""))


def _train_arguments(script: Path) -> list[str]:
    """The arguments of the script's `portrl train` call, its shell variables set to their defaults (a wrapper
    recipe: its base's, then its own overrides)."""
    wrapped = _wrapped(script)
    if wrapped is not None:
        return _train_arguments(wrapped[0]) + wrapped[1]
    text = script.read_text()
    defaults = dict(re.findall(r'^(\w+)=\$\{\w+:-([^}]*)\}', text, flags=re.M))
    call = re.search(r"^portrl train (.*?)(?<!\\)$", text, flags=re.M | re.S).group(1).replace("\\\n", " ")
    call = call.replace('"$@"', "")
    for name, value in defaults.items():
        call = call.replace(f'"${name}"', value).replace(f"${name}", value)
    return shlex.split(call.replace("$HOME", "/home/user"))


def test_every_recipe_is_found():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_recipe_composes(script):
    args = _train_arguments(script)
    device = args[args.index("--device") + 1]
    preset = args[args.index("--preset") + 1]
    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    cfg = compose(device=device, preset=preset, overrides=overrides)
    assert cfg.device.name == device and (cfg.model.path or cfg.model.size == "tiny") and cfg.data.train_files
    base = _wrapped(script)[0] if _wrapped(script) else script
    header = base.read_text().split("set -euo pipefail")[0]
    assert "Expected" in header, f"{script.name}: the header must state the expected score"
