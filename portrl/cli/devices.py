"""``portrl devices``: every registered backend, usable or not and why."""

from __future__ import annotations

import json


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from portrl.device import all_backends

    rows = []
    for backend in all_backends():
        r = backend.probe()
        rows.append({
            "name": backend.name, "usable": r.usable, "reason": r.reason, "device_type": backend.device_type,
            "device_count": r.device_count, "device_name": r.device_name, "versions": dict(r.versions),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'backend':<8} {'usable':<7} {'count':>5}  {'device / reason':<48} versions")
    for row in rows:
        what = row["device_name"] if row["usable"] else row["reason"]
        versions = " ".join(f"{k}={v}" for k, v in row["versions"].items())
        print(f"{row['name']:<8} {'yes' if row['usable'] else 'no':<7} {row['device_count']:>5}  {what:<48} {versions}")
    return 0
