"""The catalog of error messages (docs/reference/errors.md) is the source's, and its extraction reads messages right.

Regenerated in a fresh process, it must equal the committed page: an error message added or changed without
`python -m portrl.error_catalog > docs/reference/errors.md` fails here.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

from portrl.error_catalog import COMMAND, Message, _code, _config_check, _template, render

ROOT = Path(__file__).resolve().parents[1]


def test_committed_catalog_is_the_generated_one():
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-m", "portrl.error_catalog"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    assert page == done.stdout, f"docs/reference/errors.md is stale: run `{COMMAND}`"
    assert "invalid config" in page and "unknown config key" in page and "portrl/backends/" in page


def call(source: str) -> ast.Call:
    node = ast.parse(source).body[0].value
    assert isinstance(node, ast.Call)
    return node


def test_templates_show_run_time_parts_by_name():
    assert _template(call('E(f"{path} has no {cfg.data.name!r}; valid: {\', \'.join(x)}")').args[0]) == \
        "{path} has no {cfg.data.name}; valid: {...}"
    assert _template(call('E("a" + f"{b}")').args[0]) == "a{b}"
    assert _template(call("E(message)").args[0]) is None  # written elsewhere: listed there


def test_config_check_lines():
    assert _config_check("portrl/config/checks.py", call('p.need(x > 0, "trainer.seed", "must be >= 0")')) == \
        "trainer.seed={value} must be >= 0"
    assert _config_check("portrl/config/checks.py", call('problems.append(f"rollout.n={n} must be >= 1")')) == \
        "rollout.n={n} must be >= 1"
    assert _config_check("portrl/data/x.py", call('problems.append("x")')) is None


def test_code_spans_hold_backticks_and_pipes():
    assert _code("use `portrl sft`") == "`` use `portrl sft` ``"
    assert _code("a <|im_end|> b") == "`a <|im_end|> b`"
    page = render([Message("Config", "portrl/config/x.py", "ConfigError", "bad")])
    assert "## Config" in page and "| `bad` | ConfigError | `portrl/config/x.py` |" in page
