"""The metrics a refactor must not change: short runs of the default command and of every algorithm preset, their
logged values written to one JSON file, and two such files compared (issue 59, item 7).

    python benchmarks/metrics_fingerprint.py run OUT.json [--presets grpo,ppo,...] [--steps 3] [--default-steps 60]
    python benchmarks/metrics_fingerprint.py compare BEFORE.json AFTER.json

``run``: ``portrl train`` with no algorithm (the README's main command, ``--default-steps`` steps, its validations
included) and ``portrl train algorithm=PRESET`` for each preset (``--steps`` steps, no validation), each in a process
of its own in a scratch folder, on the default tiny model and task, seed 0. Every value of every step's line of the
run's ``metrics.jsonl`` is kept except what measures the machine rather than the learning (``timing_s/``, ``perf/``,
``memory/``). ``compare`` prints each run's verdict: identical (every kept value equal, bitwise as JSON floats), or
the keys that differ with their largest gap; exit 1 if any run differs. Both files must come from the same machine:
floating-point order differs by ISA (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "algorithm").glob("*.yaml"))
MACHINE_KEYS = ("timing_s/", "perf/", "memory/")


def kept(line: Dict[str, object]) -> Dict[str, object]:
    """One metrics line without the values that measure the machine."""
    return {k: v for k, v in line.items() if not k.startswith(MACHINE_KEYS)}


def run_one(overrides: List[str], scratch: Path) -> List[Dict[str, object]]:
    """Run ``portrl train OVERRIDES`` in a scratch folder; its metrics lines, kept values only."""
    out = scratch / "run"
    cmd = [sys.executable, "-m", "portrl", "train", *overrides, f"trainer.output_dir={out}",
           "trainer.progress_bar=false", "trainer.plot=false", "trainer.export_hf=false", "trainer.save_final=false"]
    proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"{' '.join(overrides) or 'default'}: exit {proc.returncode}: {tail}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [kept(json.loads(s)) for s in lines if s.strip()]


def run(args: argparse.Namespace) -> None:
    """Every run of the fingerprint, written to ``args.out`` after each (write, then rename)."""
    runs: Dict[str, List[Dict[str, object]]] = {}
    plan = [("default", [f"trainer.total_steps={args.default_steps}"])] if args.default_steps else []
    plan += [(p, [f"algorithm={p}", f"trainer.total_steps={args.steps}", "trainer.val_before_train=false",
                  "trainer.test_freq=0"]) for p in args.presets.split(",") if p]
    for name, overrides in plan:
        with tempfile.TemporaryDirectory() as tmp:
            runs[name] = run_one(overrides, Path(tmp))
        print(f"{name}: {len(runs[name])} lines", flush=True)
        part = Path(str(args.out) + ".part")
        part.write_text(json.dumps(runs, indent=1, sort_keys=True))
        os.replace(part, args.out)


def gap(a: object, b: object) -> float:
    """The absolute difference of two numbers; infinity when either is not a number."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    return float("inf")


def compare(before: Path, after: Path) -> int:
    """Print each run's verdict; 1 if any run differs or is missing from one side."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'before' if name in a else 'after'}")
            bad += 1
            continue
        diffs: Dict[str, float] = {}
        for la, lb in zip(a[name], b[name]):
            for key in set(la) | set(lb):
                if la.get(key) != lb.get(key):
                    diffs[key] = max(diffs.get(key, 0.0), gap(la.get(key), lb.get(key)))
        if len(a[name]) != len(b[name]):
            diffs["<lines>"] = float(abs(len(a[name]) - len(b[name])))
        values = sum(len(line) for line in a[name])
        print(f"{name}: identical ({len(a[name])} lines, {values} values)" if not diffs else
              f"{name}: {len(diffs)} keys differ: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(diffs.items())))
        bad += bool(diffs)
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="run the default command and the presets; write their metrics")
    r.add_argument("out", type=Path)
    r.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated (default all: {','.join(PRESETS)})")
    r.add_argument("--steps", type=int, default=3, help="steps of each preset's run (default 3)")
    r.add_argument("--default-steps", type=int, default=60, help="steps of the default run; 0 skips it (default 60)")
    c = sub.add_parser("compare", help="compare two fingerprints")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.verb == "run":
        run(args)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
