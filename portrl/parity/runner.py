"""``portrl parity ops``: run every op and algorithm case on a backend in one dtype; build the report.

Each case is evaluated on the backend's device with inputs rounded to the dtype, and compared with a
float64 host reference computed in the same run from the same rounded inputs (see
:mod:`portrl.parity.case`, metrics in :mod:`portrl.parity.metrics`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from portrl.parity.algo_cases import algo_cases
from portrl.parity.case import Case, evaluate, evaluate_reference, make_inputs
from portrl.parity.metrics import compare_outputs
from portrl.parity.ops_cases import op_cases
from portrl.parity.report import REPORT_VERSION, environment
from portrl.parity.tolerances import tolerance, worst

if TYPE_CHECKING:
    from portrl.device.backend import Backend

log = logging.getLogger(__name__)

GROUPS = ("ops", "algo")


def _torch_dtype(name: str) -> torch.dtype:
    tolerance(name)  # a clear error for dtypes without a row
    return getattr(torch, name)


def run_cases(cases: Iterable[Case], backend: Backend, dtype: str, seed: int = 0) -> list[dict[str, Any]]:
    """Evaluate ``cases`` on ``backend``'s device in ``dtype``; one result dict per case.

    A case that raises is reported with verdict "fail" and the error, and the run continues.
    """
    tdtype = _torch_dtype(dtype)
    device = backend.device(0) if backend.device_type != "cpu" else backend.device()
    inputs_cache: dict[str, Any] = {}
    ref_cache: dict[str, Any] = {}
    results = []
    for case in cases:
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"name": case.name, "group": case.group, **case.info}
        try:
            key = case.inputs_key or case.name
            if key not in inputs_cache:
                inputs_cache[key] = make_inputs(case, seed)
            inputs = inputs_cache[key]
            if case.ref_key and case.ref_key in ref_cache:
                ref = ref_cache[case.ref_key]
            else:
                ref = evaluate_reference(case, inputs, tdtype, seed)
                if case.ref_key:
                    ref_cache[case.ref_key] = ref
            out = evaluate(case, inputs, device, tdtype, seed)
            entry.update(compare_outputs(out, ref, dtype))
        except Exception as exc:  # report and continue: one broken case must not hide the others
            log.exception("parity case %s failed", case.name)
            entry.update(verdict="fail", error=f"{type(exc).__name__}: {exc}", outputs={}, max_rel_err=None)
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        log.info("%-40s %-5s max_rel_err=%s (%.1fs)", case.name, entry["verdict"], entry["max_rel_err"],
                 entry["seconds"])
        results.append(entry)
    return results


def run_ops_parity(backend: Backend, dtype: str, *, size: str = "standard", groups=GROUPS, ops=None, seed: int = 0,
                   all_impls: bool = True) -> dict[str, Any]:
    """The full report of ``portrl parity ops`` for one backend and dtype."""
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ValueError(f"unknown parity groups {bad}; valid: {', '.join(GROUPS)}")
    if dtype not in backend.supported_dtypes():
        log.warning("backend %s does not list %s among its training dtypes (%s); running anyway", backend.name,
                    dtype, ", ".join(backend.supported_dtypes()))
    backend.manual_seed(seed)
    cases: list[Case] = []
    impls: dict[str, Any] = {}
    if "ops" in groups:
        op_list, impls = op_cases(backend, size=size, ops=ops, all_impls=all_impls)
        cases += op_list
    if "algo" in groups:
        cases += algo_cases()
    t0 = time.perf_counter()
    results = run_cases(cases, backend, dtype, seed=seed)
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("pass", "warn", "fail")}
    return {
        "kind": "ops", "version": REPORT_VERSION, **environment(backend), "dtype": dtype, "size": size,
        "seed": seed, "tolerance": tolerance(dtype).__dict__, "impls": impls, "cases": results,
        "summary": {**counts, "total": len(results), "verdict": worst(r["verdict"] for r in results),
                    "seconds": round(time.perf_counter() - t0, 2)},
    }
