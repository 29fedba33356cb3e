"""Error metrics of one result tensor against its float64 reference, and the verdict by dtype.

With ``a`` the result and ``r`` the reference (both taken to float64 on the host), over the
positions finite in both::

    cosine        = <a, r> / (|a| |r|)                      (1 when both are 0; None for a scalar)
    max_abs_err   = max |a - r|
    rmse          = sqrt(mean (a - r)^2)
    rel_err       = |a - r| / |r|       on "normal" elements, |r| >= small_value
    max_rel_err, mean_rel_err           over the normal elements
    small_value_err = max |a - r|       on "small" elements, |r| < small_value
    share_over    = (#normal with rel_err > rel_bound + #small with abs err > small_abs_bound) / n
    scaled_err    = max |a - r| / max |r|
    nan_inf_mismatch = #positions where a and r differ in being NaN, +Inf or -Inf

Verdict (thresholds in :mod:`portrl.parity.tolerances`): ``fail`` on any NaN/Inf mismatch or a cosine
at or below ``cosine_min``; else ``pass`` when ``share_over <= share_bound``; else ``warn`` when
``scaled_err <= scaled_bound`` and ``fail`` above it.
"""

from __future__ import annotations

from typing import Any

import torch

from portrl.parity.tolerances import Tolerance, tolerance, worst


def _nonfinite_kind(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf (elementwise)."""
    kind = torch.zeros(x.shape, dtype=torch.int8)
    kind[torch.isnan(x)] = 1
    kind[torch.isposinf(x)] = 2
    kind[torch.isneginf(x)] = 3
    return kind


def _f(x: torch.Tensor | float) -> float:
    return float(x)


def compare_tensors(result: torch.Tensor, reference: torch.Tensor, dtype) -> dict[str, Any]:
    """Metrics and verdict of ``result`` against ``reference`` under ``dtype``'s tolerances.

    ``dtype`` is the precision the result was computed in (it picks the row of the table), not
    necessarily ``result.dtype`` (log-probs of a bfloat16 model come back in float32).
    """
    tol = tolerance(dtype)
    if tuple(result.shape) != tuple(reference.shape):
        raise ValueError(f"result shape {tuple(result.shape)} != reference shape {tuple(reference.shape)}")
    a = result.detach().to("cpu", torch.float64).reshape(-1)
    r = reference.detach().to("cpu", torch.float64).reshape(-1)
    n = a.numel()
    ka, kr = _nonfinite_kind(a), _nonfinite_kind(r)
    mismatch = int((ka != kr).sum())
    both = (ka == 0) & (kr == 0)
    a, r = a[both], r[both]
    m: dict[str, Any] = {"numel": n, "nan_inf_mismatch": mismatch}
    if a.numel() == 0:
        m.update(cosine=None, max_abs_err=0.0, rmse=0.0, max_rel_err=0.0, mean_rel_err=0.0, small_value_err=0.0,
                 share_over=0.0, scaled_err=0.0)
        m["verdict"] = verdict(m, tol)
        return m
    diff = (a - r).abs()
    small = r.abs() < tol.small_value
    normal = ~small
    rel = diff[normal] / r[normal].abs()
    over = int((rel > tol.rel_bound).sum()) + int((diff[small] > tol.small_abs_bound).sum())
    m.update(
        cosine=_cosine(a, r) if n > 1 else None,
        max_abs_err=_f(diff.max()),
        rmse=_f(diff.square().mean().sqrt()),
        max_rel_err=_f(rel.max()) if rel.numel() else 0.0,
        mean_rel_err=_f(rel.mean()) if rel.numel() else 0.0,
        small_value_err=_f(diff[small].max()) if bool(small.any()) else 0.0,
        share_over=over / n,
        scaled_err=_scaled(diff, r),
    )
    m["verdict"] = verdict(m, tol)
    return m


def _scaled(diff: torch.Tensor, r: torch.Tensor) -> float:
    return _f(diff.max()) / max(_f(r.abs().max()), 1e-300)  # an all-zero reference: any error is huge


def _cosine(a: torch.Tensor, r: torch.Tensor) -> float:
    na, nr = _f(a.norm()), _f(r.norm())
    if na == 0.0 and nr == 0.0:
        return 1.0
    if na == 0.0 or nr == 0.0:
        return 0.0
    return _f(torch.dot(a, r)) / (na * nr)


def verdict(m: dict[str, Any], tol: Tolerance) -> str:
    """pass / warn / fail of one metrics dict (see the module docstring)."""
    if m["nan_inf_mismatch"]:
        return "fail"
    cos = m.get("cosine")
    if cos is not None and not cos > tol.cosine_min:
        return "fail"
    if m["share_over"] <= tol.share_bound:
        return "pass"
    return "warn" if m["scaled_err"] <= tol.scaled_bound else "fail"


def compare_outputs(results: dict[str, torch.Tensor], references: dict[str, torch.Tensor], dtype) -> dict[str, Any]:
    """Per-output metrics of a case and its verdict (the worst of its outputs)."""
    missing = sorted(set(references) ^ set(results))
    if missing:
        raise ValueError(f"result and reference outputs differ: {missing}")
    outputs = {k: compare_tensors(results[k], references[k], dtype) for k in references}
    return {"outputs": outputs, "verdict": worst(o["verdict"] for o in outputs.values()),
            "max_rel_err": max((o["max_rel_err"] for o in outputs.values()), default=0.0)}

