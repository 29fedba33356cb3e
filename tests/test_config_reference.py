"""The configuration reference (docs/reference/configuration.md) is the typed config as it is now.

Regenerated in a fresh process (other tests register algorithms with options in theirs), it must equal the
committed page: a key added, removed or changed without `python -m portrl.config.reference > docs/reference/
configuration.md` fails here. Every key needs a description (a comment on its field, an option's doc, or
portrl/config/reference_text.py), and the reference's own tables name only keys that exist.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from portrl.config.keys import schema_keys
from portrl.config.reference import COMMAND, Entry, render
from portrl.config.reference_text import RULES_ELSEWHERE, VERL_NAMES

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "configuration.md"


@pytest.fixture(scope="module")
def generated() -> str:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-m", "portrl.config.reference"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout


def test_committed_reference_is_the_generated_one(generated):
    assert PAGE.read_text() == generated, f"docs/reference/configuration.md is stale: run `{COMMAND}`"


def test_every_key_is_in_the_reference_with_a_description(generated):
    rows = [line for line in generated.splitlines() if line.startswith("| `")]
    keys = [row.split("`")[1] for row in rows]
    leaves = [k for k, tp in schema_keys().items() if not (isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"))]
    assert sorted(keys) == sorted(leaves)
    undescribed = [row.split("`")[1] for row in rows if row.rstrip().endswith("|  |") or row.rstrip().endswith("| |")]
    assert not undescribed, f"keys without a description (a comment on the field, or reference_text.py): {undescribed}"


def test_tables_of_the_reference_name_only_schema_keys():
    keys = set(schema_keys())
    assert not [k for k in VERL_NAMES if k not in keys]
    assert not [k for k in RULES_ELSEWHERE if k not in keys]


def test_render_escapes_table_cells_and_names_its_command():
    page = render([Entry("a.b", "str", "x|y", "one of 'x', 'y'", "", "a | b")])
    assert "`x\\|y`" in page and "a \\| b" in page and COMMAND in page
