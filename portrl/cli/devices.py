"""``portrl devices``: every registered backend, usable or not and why.

The table has one row per backend (name, usable, device count, device name, installed versions); the reason
a backend is not usable (with the command that fixes it) follows on its own line, so that nothing copied
from it runs into the versions column.
"""

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
    width = max([6] + [len(r["device_name"] or "") for r in rows])
    print(f"{'backend':<8} {'usable':<7} {'count':>5}  {'device':<{width}}  versions")
    for row in rows:
        versions = " ".join(f"{k}={v}" for k, v in row["versions"].items())
        print(f"{row['name']:<8} {'yes' if row['usable'] else 'no':<7} {row['device_count']:>5}  "
              f"{row['device_name'] or '-':<{width}}  {versions}")
        if not row["usable"]:
            print(f"         not usable: {row['reason']}")
    return 0
