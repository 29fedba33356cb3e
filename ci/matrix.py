"""The parity matrix (ci/matrix.yaml): validation, one leg's settings for ci/parity.sh, and the GitHub workflow.

    python ci/matrix.py workflow           write .github/workflows/parity.yml from ci/matrix.yaml
    python ci/matrix.py workflow --check   exit 1 (with a diff) when the committed workflow is stale
    python ci/matrix.py leg NAME           print NAME's settings as shell assignments (for ci/parity.sh)
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "ci" / "matrix.yaml"
WORKFLOW = ROOT / ".github" / "workflows" / "parity.yml"
LEG_KEYS = {"name", "device", "runner", "image", "docker_args", "preset", "dtypes", "tiers", "timeout_minutes"}
TIERS = ("ops", "replay", "e2e")
DTYPES = ("float32", "bfloat16", "float16")


def load_matrix(path: Path = MATRIX) -> dict:
    """The matrix, validated: every leg has exactly LEG_KEYS, known tiers and dtypes, an existing Dockerfile,
    an existing device preset; names are unique and the reference backend has a leg."""
    data = yaml.safe_load(Path(path).read_text())
    legs = data.get("legs") or []
    if not legs:
        raise ValueError(f"{path}: no legs")
    names = [leg.get("name") for leg in legs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate leg names in {names}")
    for leg in legs:
        where = f"{path}: leg {leg.get('name')!r}"
        if set(leg) != LEG_KEYS:
            raise ValueError(f"{where}: keys {sorted(leg)}; expected exactly {sorted(LEG_KEYS)}")
        bad = [t for t in leg["tiers"] if t not in TIERS] + [d for d in leg["dtypes"] if d not in DTYPES]
        if bad:
            raise ValueError(f"{where}: unknown tiers/dtypes {bad}; valid tiers {TIERS}, dtypes {DTYPES}")
        if not (ROOT / leg["image"]).is_file():
            raise ValueError(f"{where}: image {leg['image']} does not exist")
        if not (ROOT / "configs" / "device" / f"{leg['preset']}.yaml").is_file():
            raise ValueError(f"{where}: preset {leg['preset']} is not in configs/device/")
        if not isinstance(leg["runner"], list) or not leg["runner"]:
            raise ValueError(f"{where}: runner must be a non-empty list of labels")
    if data.get("reference") not in {leg["device"] for leg in legs}:
        raise ValueError(f"{path}: reference backend {data.get('reference')!r} has no leg")
    return data


def leg(name: str, data: dict | None = None) -> dict:
    data = data or load_matrix()
    for entry in data["legs"]:
        if entry["name"] == name:
            return entry
    raise ValueError(f"unknown leg {name!r}; legs: {', '.join(e['name'] for e in data['legs'])}")


def leg_shell(name: str) -> str:
    """``DEVICE=... PRESET=... DTYPES='...' TIERS='...'`` for ``eval`` in ci/parity.sh."""
    e = leg(name)
    values = {"DEVICE": e["device"], "PRESET": e["preset"], "DTYPES": " ".join(e["dtypes"]),
              "TIERS": " ".join(e["tiers"])}
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items()) + "\n"


def _job(e: dict) -> list[str]:
    tag = f"portrl-parity:{e['name']}"
    args = " ".join(e["docker_args"].split())
    run = (f"docker run --rm {args} -v \"$PWD:/work\" -w /work --entrypoint bash {tag} "
           f"ci/parity.sh {e['name']}").replace("  ", " ")
    return [
        f"  {e['name']}:",
        f"    name: parity {e['name']}",
        f"    runs-on: [{', '.join(e['runner'])}]",
        f"    timeout-minutes: {e['timeout_minutes']}",
        "    steps:",
        "      - uses: actions/checkout@v4",
        "      - name: Build the image",
        f"        run: docker build -f {e['image']} -t {tag} .",
        "      - name: Parity (" + ", ".join(e["tiers"]) + ")",
        "        run: |",
        f"          mkdir -p ci/reports/{e['name']} && chmod 777 ci/reports/{e['name']}",
        f"          {run}",
        "      - uses: actions/upload-artifact@v4",
        "        if: always()",
        "        with:",
        f"          name: parity-{e['name']}",
        f"          path: ci/reports/{e['name']}",
        "",
    ]


def render_workflow(data: dict | None = None) -> str:
    data = data or load_matrix()
    names = [e["name"] for e in data["legs"]]
    ref = next(e for e in data["legs"] if e["device"] == data["reference"])
    lines = [
        "# GENERATED from ci/matrix.yaml by `python ci/matrix.py workflow`; do not edit by hand.",
        "name: parity",
        "on:",
        "  workflow_dispatch: {}",
        "  schedule:",
        "    - cron: \"0 3 * * 1\"",
        "permissions:",
        "  contents: read",
        "jobs:",
    ]
    for e in data["legs"]:
        lines += _job(e)
    lines += [
        "  compare:",
        "    name: parity matrix",
        f"    needs: [{', '.join(names)}]",
        "    if: always()",
        f"    runs-on: [{', '.join(ref['runner'])}]",
        "    steps:",
        "      - uses: actions/checkout@v4",
        "      - uses: actions/download-artifact@v4",
        "        with:",
        "          path: ci/reports",
        "      - name: Build the image",
        f"        run: docker build -f {ref['image']} -t portrl-parity:{ref['name']} .",
        "      - name: Cross-hardware matrix",
        "        run: |",
        "          chmod -R a+rwX ci/reports",
        f"          docker run --rm -v \"$PWD:/work\" -w /work --entrypoint bash portrl-parity:{ref['name']} -c "
        f"'portrl parity compare --reference {data['reference']} --output ci/reports/matrix.md "
        "$(ls ci/reports/*/ops-*.json)'",
        "          cat ci/reports/matrix.md >> \"$GITHUB_STEP_SUMMARY\"",
        "      - uses: actions/upload-artifact@v4",
        "        if: always()",
        "        with:",
        "          name: parity-matrix",
        "          path: ci/reports/matrix.*",
    ]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workflow")
    w.add_argument("--check", action="store_true")
    sub.add_parser("leg").add_argument("name")
    args = p.parse_args(argv)
    try:
        if args.cmd == "leg":
            sys.stdout.write(leg_shell(args.name))
            return 0
        text = render_workflow()
    except ValueError as exc:
        print(f"ci/matrix.py: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = WORKFLOW.read_text() if WORKFLOW.exists() else ""
        if current != text:
            sys.stderr.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       str(WORKFLOW), "generated from ci/matrix.yaml"))
            print("\n.github/workflows/parity.yml is stale: run `python ci/matrix.py workflow`", file=sys.stderr)
            return 1
        return 0
    _write(WORKFLOW, text)
    print(f"wrote {WORKFLOW.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
