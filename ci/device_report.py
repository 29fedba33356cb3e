"""The report of ci/device_check.sh: ``python ci/device_report.py OUT BACKEND``.

Reads what the check left in OUT (parts.tsv: one ``name, status, seconds, note`` line per part; doctor.log; the
parity reports ops-<dtype>.json and replay.json; the runs' run-<engine>/metrics.jsonl) and writes OUT/report.json
and OUT/report.md (each through a temporary file and a rename). Exit status 1 when a part failed, else 0.
Only the standard library: it must run where portrl itself does not import.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# per training step: times (s), peak device memory (GiB), throughput, and the rollout-vs-trainer gap (verl's names)
GAP_KEYS = ("training/rollout_log_probs_diff_mean", "training/rollout_log_probs_diff_max")
STEP_KEYS = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "memory/peak_gib/step", "perf/tokens_per_s",
             "training/rollout_probs_diff_max", "training/rollout_log_probs_diff_max", "actor/grad_norm",
             "memory/plan_gib/gen", "memory/peak_gib/gen", "memory/plan_gib/update_actor", "memory/peak_gib/update_actor",
             "memory/plan_gib/ref", "memory/peak_gib/ref",
             "perf/mfu/actor", "perf/roofline/update", "perf/roofline/rollout", "perf/throughput")


def read_parts(out: Path) -> list[dict]:
    parts = []
    for line in (out / "parts.tsv").read_text().splitlines():
        name, status, seconds, note = (line.split("\t") + [""] * 4)[:4]
        parts.append({"name": name, "status": status, "seconds": int(seconds or 0), "note": note})
    return parts


def read_json(path: Path) -> dict | None:
    try:
        text = path.read_text()
        return json.loads(text[text.index("{"):])  # doctor.log starts with log lines
    except (OSError, ValueError):
        return None


def doctor_details(out: Path) -> dict | None:
    doctor = read_json(out / "doctor.log")
    if doctor is None:
        return None
    checks = doctor.get("checks", [])
    counts = {s: sum(c.get("status") == s for c in checks) for s in ("ok", "warn", "fail")}
    flagged = [f"{c['status']}: {c['name']}: {c['message']}" + (f" (fix: {c['fix']})" if c.get("fix") else "")
               for c in checks if c.get("status") in ("warn", "fail")]
    return {"counts": counts, "flagged": flagged}


def ops_details(report: dict) -> dict:
    failing = [f"{c.get('verdict')}: {c['name']}" for c in report.get("cases", []) if c.get("verdict") != "pass"]
    selected = {op: info.get("selected") for op, info in report.get("impls", {}).items()}
    return {"summary": report.get("summary"), "not_pass": failing, "selected_impls": selected}


def replay_details(report: dict) -> dict:
    not_pass = {k: v.get("verdict") for k, v in report.get("checks", {}).items() if v.get("verdict") != "pass"}
    return {"verdict": report.get("verdict"), "not_pass": not_pass}


def run_details(run_dir: Path) -> list[dict]:
    steps = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        metrics = json.loads(line)
        if "timing_s/step" in metrics:
            steps.append({"step": metrics.get("step"), **{k: metrics[k] for k in STEP_KEYS if k in metrics}})
    return steps


def profile_details(run_dir: Path) -> list[dict]:
    """Per trace of the profiled step: its phase ranges and how many events ran on the device (Chrome trace
    categories ``kernel`` / ``gpu_memcpy``); a folder (a vendor profiler's own layout) is listed as it is."""
    found = []
    for path in sorted(run_dir.glob("profile/step_*/*")):
        entry: dict = {"trace": str(path.relative_to(run_dir))}
        if path.suffix == ".json":
            events = read_json(path) or {}
            names = [e for e in events.get("traceEvents", []) if isinstance(e, dict)]
            entry["phases"] = sorted({e["name"] for e in names if str(e.get("name", "")).startswith("portrl/")})
            entry["device_events"] = sum(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in names)
        found.append(entry)
    return found


def environment(out: Path) -> dict:
    for name in ("ops-float32.json", "ops-bfloat16.json", "replay.json"):
        report = read_json(out / name)
        if report:
            return {k: report.get(k) for k in ("backend", "device_name", "versions", "python", "host")}
    return {}


def build(out: Path, backend: str) -> dict:
    report = {"backend": backend, "environment": environment(out), "parts": read_parts(out)}
    for part in report["parts"]:
        name = part["name"]
        if part["status"] == "skipped":
            continue
        if name == "doctor":
            part["details"] = doctor_details(out)
        elif name.startswith("ops-") and (ops := read_json(out / f"{name}.json")):
            part["details"] = ops_details(ops)
        elif name == "replay" and (replay := read_json(out / "replay.json")):
            part["details"] = replay_details(replay)
        elif name == "rollout-gap" and (gap := read_json(out / "rollout-gap.json")):
            part["details"] = {"cases": [{k: c.get(k) for k in ("engine", "dtype", "verdict", *GAP_KEYS)}
                                         for c in gap.get("cases", [])]}
        elif name.startswith("grpo-"):
            run_dir = out / f"run-{name[len('grpo-'):]}"
            part["details"] = {"steps": run_details(run_dir), "profile": profile_details(run_dir)}
    report["failed"] = [p["name"] for p in report["parts"] if p["status"] == "fail"]
    report["not_run"] = [f"{p['name']}: {p['note']}" for p in report["parts"] if p["status"] == "skipped"]
    return report


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# portrl device check: {report['backend']}", ""]
    if env:
        versions = ", ".join(f"{k} {v}" for k, v in sorted((env.get("versions") or {}).items()))
        lines += [f"Device: {env.get('device_name')}; {versions}; Python {env.get('python')} ({env.get('host')}).", ""]
    lines += ["| part | status | seconds | note |", "| --- | --- | --- | --- |"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']} | {p['note']} |" for p in report["parts"]]
    for part in report["parts"]:
        details = part.get("details")
        if not details:
            continue
        lines += ["", f"## {part['name']}", ""]
        if part["name"] == "doctor":
            lines.append(f"checks: {details['counts']}")
            lines += [f"- {f}" for f in details["flagged"]]
        elif part["name"].startswith("ops-"):
            lines.append(f"verdicts: {details['summary']}")
            lines.append(f"implementations chosen: {details['selected_impls']}")
            lines += [f"- {case}" for case in details["not_pass"]]
        elif part["name"] == "rollout-gap":
            lines += [f"- {c['verdict']}: {c['engine']} {c['dtype']}: |dlogp| mean {c[GAP_KEYS[0]]:.3g}, "
                      f"max {c[GAP_KEYS[1]]:.3g}" for c in details["cases"]]
        elif part["name"] == "replay":
            lines.append(f"verdict: {details['verdict']}; not pass: {details['not_pass'] or 'none'}")
        else:
            lines += ["| step | " + " | ".join(STEP_KEYS) + " |", "|" + " --- |" * (len(STEP_KEYS) + 1)]
            lines += [f"| {s['step']} | " + " | ".join(f"{s[k]:.4g}" if k in s else "" for k in STEP_KEYS) + " |"
                      for s in details["steps"]]
            lines += [f"- profile: {t['trace']}" + (f": {len(t['phases'])} phase ranges, {t['device_events']} device "
                                                     "events" if "phases" in t else "") for t in details["profile"]]
    lines += ["", "Failed: " + (", ".join(report["failed"]) or "none"),
              "Not run: " + ("; ".join(report["not_run"]) or "nothing")]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python ci/device_report.py OUT BACKEND", file=sys.stderr)
        return 2
    out = Path(argv[0])
    report = build(out, argv[1])
    write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_atomic(out / "report.md", markdown(report))
    print(f"report: {out / 'report.md'}; failed: {', '.join(report['failed']) or 'none'}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
