"""``portrl devices``: every registered backend, usable or not and why, and every plugin that failed to load.

The table has one row per backend (name, usable, device count, device name, installed versions), each printed as
soon as its backend is probed (a host without a vendor's device answers from its device nodes, importing
nothing; the plugin check after the table imports the rollout engines, which takes seconds); the reason
a backend is not usable (with the command that fixes it) follows on its own line, so that nothing copied
from it runs into the versions column. A backend or rollout-engine plugin that failed to load
(:func:`portrl.device.broken_backends`, :func:`portrl.rollout.broken_engines`) is listed after the table with its
error. ``--json``: a list of rows; backend rows have ``"kind": "backend"``, broken plugins ``"kind": "backend"``
or ``"rollout_engine"`` with ``"usable": false`` and their ``"error"``.
"""

from __future__ import annotations

import json

from portrl.device import all_backends, broken_backends
from portrl.device.backend import Backend


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


#: the device column's width (printed before any backend is probed; a longer name shifts its row's versions)
DEVICE_WIDTH = 16
#: the words the table uses for each kind of plugin
_KIND_WORDS = {"backend": "backend", "rollout_engine": "rollout engine", "algorithm": "algorithm plugin"}


def _broken_rows() -> list[dict]:
    # lazy: the rollout and algorithm packages import torch, which only this part of the command needs
    from portrl.algo.registry import load_plugins  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.rollout import broken_engines  # noqa: PLC0415  (CLI start-up: loaded by the command)

    groups = {"backend": broken_backends(), "rollout_engine": broken_engines(), "algorithm": load_plugins()}
    return [{"kind": kind, "name": name, "usable": False, "plugin": b.value, "error": b.error, "reason": b.message}
            for kind, broken in groups.items() for name, b in broken.items()]


def _row(backend: Backend) -> dict:
    r = backend.probe()
    return {"kind": "backend", "name": backend.name, "usable": r.usable, "reason": r.reason,
            "device_type": backend.device_type, "device_count": r.device_count, "device_name": r.device_name,
            "versions": dict(r.versions)}


def run(args) -> int:
    backends = all_backends()
    if args.json:
        print(json.dumps([_row(b) for b in backends] + _broken_rows(), indent=2))
        return 0
    # the table first, each row as soon as its backend is probed: the plugin check after it imports the rollout
    # engines (seconds), and a host without a vendor's device answers from its device nodes at once
    width = DEVICE_WIDTH
    print(f"{'backend':<8} {'usable':<7} {'count':>5}  {'device':<{width}}  versions", flush=True)
    for backend in backends:
        row = _row(backend)
        versions = " ".join(f"{k}={v}" for k, v in row["versions"].items())
        print(f"{row['name']:<8} {'yes' if row['usable'] else 'no':<7} {row['device_count']:>5}  "
              f"{row['device_name'] or '-':<{width}}  {versions}", flush=True)
        if not row["usable"]:
            print(f"         not usable: {row['reason']}", flush=True)
    broken = _broken_rows()
    if broken:
        print("plugins that failed to load:")
        for row in broken:
            print(f"  {_KIND_WORDS[row['kind']]} {row['name']}: {row['reason']}")
    return 0
