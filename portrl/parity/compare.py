"""``portrl parity compare``: the cross-hardware matrix of several ops reports, in Markdown.

Rows are cases, columns ``backend/dtype``; a cell is the case's max relative error and verdict.
A second table divides each backend's errors by the reference backend's errors on the same case
and dtype (``RATIO_LIMITS`` in :mod:`portrl.parity.tolerances`: pass <= 1, warn <= 2 for RMSE, mean
relative and small-value error; pass <= 1, warn <= 10 for max relative error). Per output the
ratio of each metric is taken, errors first raised to the dtype's floor; the cell shows the worst
metric's ratio and the verdict of the worst.
"""

from __future__ import annotations

from typing import Any

from portrl.parity.report import read_report
from portrl.parity.tolerances import RATIO_LIMITS, VERDICTS, ratio_verdict, tolerance, worst

MARK = {"pass": "pass", "warn": "WARN", "fail": "FAIL"}


def _column(report: dict[str, Any]) -> str:
    return f"{report['backend']}/{report['dtype']}"


def _floors(dtype: str) -> dict[str, float]:
    tol = tolerance(dtype)
    return {"rmse": tol.ratio_abs_floor, "mean_rel_err": tol.ratio_floor,
            "small_value_err": tol.small_abs_bound, "max_rel_err": tol.ratio_floor}


def case_ratios(case: dict[str, Any], ref_case: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Error ratios of one case against the same case of the reference backend: ``{"ratio", "metric",
    "verdict"}`` for the worst output and metric (verdict "fail" when either side errored)."""
    if case.get("error") or ref_case.get("error") or not case.get("outputs"):
        return {"ratio": None, "metric": None, "verdict": "fail"}
    floors = _floors(dtype)
    best: dict[str, Any] = {"ratio": 0.0, "metric": None, "verdict": "pass"}
    for out_name, m in case["outputs"].items():
        ref = ref_case["outputs"].get(out_name)
        if ref is None:
            return {"ratio": None, "metric": f"{out_name} missing in reference", "verdict": "fail"}
        for metric in RATIO_LIMITS:
            ratio = max(m[metric], floors[metric]) / max(ref[metric], floors[metric])
            v = ratio_verdict(metric, ratio)
            if (VERDICTS.index(v), ratio) > (VERDICTS.index(best["verdict"]), best["ratio"]):
                best = {"ratio": ratio, "metric": f"{out_name}.{metric}", "verdict": v}
    return best


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def compare_reports(reports: list[dict[str, Any]], reference: str = "cpu") -> tuple[str, dict[str, Any]]:
    """``(markdown, summary)`` of the matrix; ``reference`` is the backend whose errors are the denominators."""
    if not reports:
        raise ValueError("compare needs at least one report")
    columns = [_column(r) for r in reports]
    dup = {c for c in columns if columns.count(c) > 1}
    if dup:
        raise ValueError(f"two reports for the same backend/dtype: {sorted(dup)}")
    sizes = {r.get("size") for r in reports}
    if len(sizes) > 1:
        raise ValueError(f"reports were run at different sizes {sorted(map(str, sizes))}; rerun with one --size")
    names: list[str] = []
    for r in reports:
        names += [c["name"] for c in r["cases"] if c["name"] not in names]
    by_col = {_column(r): {c["name"]: c for c in r["cases"]} for r in reports}
    lines = ["## Errors against the float64 reference (max relative error, verdict)", "",
             "| case | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in names:
        cells = []
        for col in columns:
            c = by_col[col].get(name)
            cells.append("n/a" if c is None else f"{_fmt(c.get('max_rel_err'))} {MARK[c['verdict']]}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    summary: dict[str, Any] = {"columns": columns, "ratios": {}}
    refs = {r["dtype"]: r for r in reports if r["backend"] == reference}
    others = [r for r in reports if r["backend"] != reference]
    if others:
        lines += ["", f"## Error ratio against the reference backend ({reference}, same dtype): pass <= 1, "
                  "warn <= 2 (max rel err <= 10), fail above", ""]
        ratio_cols = [r for r in others if r["dtype"] in refs]
        missing = [_column(r) for r in others if r["dtype"] not in refs]
        if missing:
            lines.append(f"No {reference} report in the same dtype for: {', '.join(missing)}.")
            lines.append("")
        if ratio_cols:
            lines += ["| case | " + " | ".join(_column(r) for r in ratio_cols) + " |",
                      "|---" * (len(ratio_cols) + 1) + "|"]
            for name in names:
                cells = []
                for r in ratio_cols:
                    c, ref = by_col[_column(r)].get(name), by_col[_column(refs[r["dtype"]])].get(name)
                    if c is None or ref is None:
                        cells.append("n/a")
                        continue
                    res = case_ratios(c, ref, r["dtype"])
                    summary["ratios"].setdefault(_column(r), {})[name] = res
                    ratio = "-" if res["ratio"] is None else f"{res['ratio']:.2f}"
                    cells.append(f"{ratio} {MARK[res['verdict']]}")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    verdicts = [c["verdict"] for r in reports for c in r["cases"]]
    verdicts += [v["verdict"] for col in summary["ratios"].values() for v in col.values()]
    summary["verdict"] = worst(verdicts)
    lines += ["", f"Overall: {MARK[summary['verdict']]}"]
    return "\n".join(lines) + "\n", summary


def compare_files(paths, reference: str = "cpu") -> tuple[str, dict[str, Any]]:
    return compare_reports([read_report(p) for p in paths], reference)
