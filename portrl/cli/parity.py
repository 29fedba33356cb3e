"""``portrl parity ops | record | replay | e2e | rollout | mesh | compare``: the cross-hardware parity harness.

Exit status: 0 when every verdict is pass or warn, 1 when any fails, 2 for bad input (argparse's usage errors,
and a device, golden, envelope or report that cannot be used: one line, portrl.errors.UserError).

A report or golden path that already holds something is refused before any work (``--on-existing move_aside``
renames it aside instead; portrl.outputs); ``e2e --rebuild-envelope`` is the one command asked to replace a
file, the envelope.

Each subcommand imports its parity modules and the device layer when it runs (they load torch and the models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from portrl.errors import UserError
from portrl.outputs import add_on_existing_argument, claim
from portrl.parity.tolerances import TOLERANCES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="parity_command", metavar="SUBCOMMAND", required=True)

    ops = sub.add_parser("ops", help="every op and algorithm function against a float64 reference, values and grads")
    ops.add_argument("--device", default=None, help="backend name (default: --device / PORTRL_DEVICE / detection)")
    ops.add_argument("--dtype", default="float32", choices=list(TOLERANCES))
    ops.add_argument("--report", required=True, help="JSON report to write")
    ops.add_argument("--size", default="standard", help="case shapes: standard (CPU-friendly) or large")
    ops.add_argument("--group", action="append", choices=["ops", "algo"], help="only these groups (repeatable)")
    ops.add_argument("--op", action="append", help="only these ops (repeatable)")
    ops.add_argument("--seed", type=int, default=0)
    add_on_existing_argument(ops)

    rec = sub.add_parser("record", help="record a golden RL step of the tiny model (reference backend, float32)")
    rec.add_argument("--output", required=True, help="golden directory to write")
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--seed", type=int, default=0)
    add_on_existing_argument(rec)

    rep = sub.add_parser("replay", help="recompute a golden on a backend and compare")
    rep.add_argument("--golden", required=True, help="golden directory (from `portrl parity record`)")
    rep.add_argument("--device", default=None)
    rep.add_argument("--dtype", default="float32", choices=list(TOLERANCES))
    rep.add_argument("--report", default=None, help="JSON report to write")
    add_on_existing_argument(rep)

    e2e = sub.add_parser("e2e", help="short fixed-seed training run checked against the committed envelope")
    e2e.add_argument("--device", default=None)
    e2e.add_argument("--envelope", default=None, help="envelope JSON (default: the committed one)")
    e2e.add_argument("--rebuild-envelope", action="store_true", help="measure the envelope over several seeds and "
                     "replace the envelope file (--envelope, or the committed one) with it")
    e2e.add_argument("--seeds", type=int, default=4, help="seeds for --rebuild-envelope")
    e2e.add_argument("--preset", default=None, help="device preset (configs/device; default: the backend's name)")
    e2e.add_argument("--report", default=None)
    e2e.add_argument("--work-dir", default=None, help="where the runs write (in a new temporary folder inside it; "
                     "default: the system's temporary directory)")
    add_on_existing_argument(e2e)

    gap = sub.add_parser("rollout", help="each rollout engine's log-probs against the trainer's forward on the same "
                         "tokens (verl's rollout_probs_diff), by dtype")
    gap.add_argument("--device", default=None)
    gap.add_argument("--engine", action="append", help="engines to measure (repeatable; default: the backend's)")
    gap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"],
                     help="dtypes (repeatable; default: float32 and bfloat16)")
    gap.add_argument("--report", default=None, help="JSON report to write")
    gap.add_argument("--work-dir", default=None, help="where the runs write (a temporary folder inside it)")
    gap.add_argument("--rebuild-golden", action="store_true", help="write the measured gaps into the CPU goldens "
                     "(backends/cpu/rollout_gap_golden.json; cpu only; other engines' entries stay)")
    add_on_existing_argument(gap)

    mesh = sub.add_parser("mesh", help="GRPO steps under tensor, sequence and data parallel meshes (CPU processes "
                          "over gloo) against one rank")
    mesh.add_argument("--case", action="append", help="only these meshes (repeatable; default: all of "
                      "portrl.parity.mesh.CASES: tp2, sp2, tp2_fsdp2, sp2_fsdp2, sp4_gqa, tp2_fsdp2_lora)")
    mesh.add_argument("--report", default=None, help="JSON report to write")
    mesh.add_argument("--work-dir", default=None, help="where the cases write (a temporary folder inside it)")
    add_on_existing_argument(mesh)

    cmp_ = sub.add_parser("compare", help="Markdown cross-hardware matrix of ops reports")
    cmp_.add_argument("reports", nargs="+", help="reports from `portrl parity ops`")
    cmp_.add_argument("--reference", default="cpu", help="backend whose errors divide the others'")
    cmp_.add_argument("--output", default=None, help="Markdown file to write (default: stdout), and its summary "
                      "beside it as .json")
    add_on_existing_argument(cmp_)


def _backend(name):
    """The backend named by ``--device`` (else $PORTRL_DEVICE, else detection); unknown or unusable: BackendError."""
    from portrl.device import resolve_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)

    return resolve_backend(name)


def _reading(fn, *args, **kwargs):
    """``fn(*args)``, which reads a file the user named: a missing or malformed one is a UserError."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from exc


def _ops(args) -> int:
    from portrl.parity.ops_cases import SIZES  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.report import write_json  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.runner import GROUPS, run_ops_parity  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.size not in SIZES:
        raise UserError(f"unknown parity size {args.size!r} (--size); valid: {', '.join(SIZES)}")
    claim(args.report, "--report", args.on_existing)
    report = run_ops_parity(_backend(args.device), args.dtype, size=args.size, groups=tuple(args.group or GROUPS),
                            ops=args.op, seed=args.seed)
    path = write_json(args.report, report, replace=False)
    s = report["summary"]
    print(f"{report['backend']} ({report['device_name']}) {args.dtype}: {s['pass']} pass, {s['warn']} warn, "
          f"{s['fail']} fail of {s['total']} cases in {s['seconds']} s -> {path}")
    for c in report["cases"]:
        if c["verdict"] != "pass":
            print(f"  {c['verdict']:4s} {c['name']}: max_rel_err={c.get('max_rel_err')} {c.get('error', '')}")
    return 1 if s["fail"] else 0


def _record(args) -> int:
    from portrl.parity.golden import record_golden  # noqa: PLC0415  (CLI start-up: loaded by the command)

    out = claim(args.output, "--output", args.on_existing)
    out = record_golden(out, _backend(args.device), seed=args.seed)
    print(f"golden written to {out}")
    return 0


def _replay(args) -> int:
    from portrl.parity.golden import read_golden, replay_golden  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.report import write_json  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.report:
        claim(args.report, "--report", args.on_existing)
    backend = _backend(args.device)
    _reading(read_golden, args.golden)  # a missing or foreign golden is bad input, found before the replay
    report = replay_golden(args.golden, backend, args.dtype)
    if args.report:
        write_json(args.report, report, replace=False)
    for name, m in report["checks"].items():
        print(f"  {m['verdict']:4s} {name}: max_abs_err={m['max_abs_err']:.3g} max_rel_err={m['max_rel_err']:.3g}")
    print(f"replay on {report['backend']} {args.dtype}: {report['verdict']}")
    return 1 if report["verdict"] == "fail" else 0


def _e2e(args) -> int:
    from portrl.parity.e2e import build_envelope, check_run, default_envelope_path  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.report import write_json  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.report and not args.rebuild_envelope:
        claim(args.report, "--report", args.on_existing)
    backend = _backend(args.device)
    path = Path(args.envelope) if args.envelope else default_envelope_path()
    if args.rebuild_envelope:
        env = build_envelope(backend, seeds=args.seeds, work_dir=args.work_dir, preset=args.preset)
        write_json(path, env)
        print(f"envelope over {args.seeds} seeds written to {path}")
        return 0
    _reading(_check_envelope, path)
    report = check_run(backend, path, work_dir=args.work_dir, preset=args.preset)
    if args.report:
        write_json(args.report, report, replace=False)
    for v in report["violations"]:
        print(f"  outside: {v}")
    print(f"e2e on {report['backend']}: {report['verdict']} ({len(report['violations'])} points outside the envelope)")
    return 1 if report["verdict"] == "fail" else 0


def _rollout(args) -> int:
    from portrl.parity.report import write_json  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.rollout_gap import golden_of, golden_path, run_rollout_gap  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.report:
        claim(args.report, "--report", args.on_existing)
    backend = _backend(args.device)
    if args.rebuild_golden and backend.name != "cpu":
        raise UserError(f"--rebuild-golden writes the CPU goldens; this backend is {backend.name!r} (use --device cpu)")
    offered = backend.rollout_engines()
    unknown = [e for e in args.engine or () if e not in offered]
    if unknown:
        raise UserError(f"rollout engine {unknown[0]!r} (--engine) is not offered by backend {backend.name!r} here; "
                        f"valid: {', '.join(offered)}")
    report = run_rollout_gap(backend, args.engine, tuple(args.dtype or ("float32", "bfloat16")), args.work_dir)
    if args.report:
        write_json(args.report, report, replace=False)
    if args.rebuild_golden:  # the measured engines and dtypes replace theirs; the others' goldens stay
        old = json.loads(golden_path().read_text()) if golden_path().is_file() else {}
        write_json(golden_path(), {**old, **golden_of(report)})
        print(f"goldens written to {golden_path()}")
    for c in report["cases"]:
        golden = c["cpu_golden"] or {}
        print(f"  {c['verdict']:4s} {c['engine']} {c['dtype']}: |dlogp| mean {c['training/rollout_log_probs_diff_mean']:.3g}"
              f" max {c['training/rollout_log_probs_diff_max']:.3g} (cpu golden: mean "
              f"{golden.get('training/rollout_log_probs_diff_mean', float('nan')):.3g})")
    print(f"rollout-vs-trainer on {report['backend']}: {report['verdict']}")
    return 1 if report["verdict"] == "fail" else 0


def _mesh(args) -> int:
    from portrl.parity.mesh import case_named, run_mesh_parity  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.report import write_json  # noqa: PLC0415  (CLI start-up: loaded by the command)

    cases = _reading(case_named, args.case)
    if args.report:
        claim(args.report, "--report", args.on_existing)
    report = run_mesh_parity([c.name for c in cases], args.work_dir)
    if args.report:
        write_json(args.report, report, replace=False)
    for c in report["cases"]:
        if "error" in c:
            print(f"  {c['verdict']:4s} {c['case']} ({c['world']} ranks): {c['error']}")
            continue
        print(f"  {c['verdict']:4s} {c['case']} ({c['world']} ranks): |dlogp| max {c['logp_max_abs']:.2g}, loss "
              f"{c['loss_max_rel']:.2g}, grad norm {c['grad_norm_max_rel']:.2g}, parameters "
              f"{c['param_norm_max_diff']:.2g}")
    bounds = report["bounds"]
    print(f"mesh parity ({report['steps']} GRPO steps vs one rank; bounds {bounds['logp_max_abs']:g} absolute on "
          f"log-probs, {bounds['relative']:g} relative): {report['verdict']}")
    return 1 if report["verdict"] == "fail" else 0


def _compare(args) -> int:
    from portrl.parity.compare import compare_files  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.parity.report import write_json, write_text  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.output:
        for path in (args.output, Path(args.output).with_suffix(".json")):
            claim(path, "--output", args.on_existing)
    md, summary = _reading(compare_files, args.reports, reference=args.reference)
    if args.output:
        write_text(args.output, md, replace=False)
        write_json(Path(args.output).with_suffix(".json"), summary, replace=False)
    else:
        sys.stdout.write(md)
    return 1 if summary["verdict"] == "fail" else 0


def _check_envelope(path: Path) -> None:
    """The envelope exists, is JSON and was measured with this portrl's run settings (before any run starts)."""
    from portrl.parity.e2e import RUN_OVERRIDES  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if not path.is_file():
        raise FileNotFoundError(f"no envelope at {str(path)!r}: build one with `portrl parity e2e --rebuild-envelope`")
    try:
        env = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"envelope {str(path)!r} is not JSON ({exc}); rebuild it with "
                         "`portrl parity e2e --rebuild-envelope`") from None
    if not isinstance(env, dict) or env.get("overrides") != list(RUN_OVERRIDES):
        raise ValueError(f"envelope {str(path)!r} was measured with other run settings; rebuild it with "
                         "`portrl parity e2e --rebuild-envelope`")


def run(args) -> int:
    handlers = {"ops": _ops, "record": _record, "replay": _replay, "e2e": _e2e, "rollout": _rollout,
                "mesh": _mesh, "compare": _compare}
    return handlers[args.parity_command](args)

