"""A parity case: fixed seeded inputs, the function under test, its float64 reference, values and gradients.

Evaluation of a case at ``(device, dtype)``:

1. ``make_inputs(generator)`` builds the inputs on the host (floating tensors in float32).
2. Floating tensors are rounded to ``dtype`` and moved to ``device``; the reference gets the *same
   rounded values* in float64 on the host, so only the computation's error is measured, not the
   rounding of the inputs.
3. ``fn(inputs)`` (and ``ref_fn`` for the reference) returns named output tensors.
   The global host RNG is seeded with the run's seed before each evaluation (for cases that draw).
4. With ``grad_inputs``, the scalar ``S = sum_k <w_k, out_k>`` over the differentiable outputs is
   back-propagated; ``w_k`` are fixed weights seeded by the case (or its ref_key) and output name,
   drawn from {-1, -1/2, 1/2, 1} (exact in every dtype; 1 for scalar outputs).
   The gradients join the outputs as ``grad.<input>``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # "ops" or "algo"
    make_inputs: Callable[[torch.Generator], dict[str, Any]]
    fn: Callable[[dict[str, Any]], Tensors]
    ref_fn: Callable[[dict[str, Any]], Tensors] | None = None
    grad_inputs: tuple[str, ...] = ()
    #: cases sharing an inputs_key get the same inputs (same seed); default: the case name
    inputs_key: str | None = None
    #: cases sharing a ref_key also share one reference (the implementations of one op)
    ref_key: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _cast(inputs: dict[str, Any], device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                v = v.to(dtype)
            v = v.to(device)
        out[k] = v
    return out


def _weights(case_name: str, out_name: str, shape) -> torch.Tensor:
    if len(shape) == 0:
        return torch.ones(())
    g = torch.Generator().manual_seed(zlib.crc32(f"{case_name}/{out_name}".encode()))
    levels = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    return levels[torch.randint(0, 4, tuple(shape), generator=g)]


def _run(case: Case, fn, inputs: dict[str, Any], seed: int) -> Tensors:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # cases that draw from the global RNG (clip_cov) draw the same on both sides
        return _run_seeded(case, fn, inputs)


def _run_seeded(case: Case, fn, inputs: dict[str, Any]) -> Tensors:
    x = dict(inputs)
    for k in case.grad_inputs:
        x[k] = x[k].detach().requires_grad_(True)
    with torch.enable_grad():
        outs = fn(x)
        bad = [k for k, v in outs.items() if not isinstance(v, torch.Tensor) or not v.is_floating_point()]
        if bad:
            raise TypeError(f"case {case.name}: outputs {bad} are not floating tensors")
        results = {k: v.detach() for k, v in outs.items()}
        if case.grad_inputs:
            terms = [(v * _weights(case.ref_key or case.name, k, v.shape).to(v.device, v.dtype)).sum()
                     for k, v in outs.items() if v.requires_grad]
            if not terms:
                raise RuntimeError(f"case {case.name}: no output depends on {case.grad_inputs}")
            total = terms[0]
            for t in terms[1:]:
                total = total + t.to(total.dtype)
            grads = torch.autograd.grad(total, [x[k] for k in case.grad_inputs], allow_unused=True)
            for k, g in zip(case.grad_inputs, grads):
                results[f"grad.{k}"] = torch.zeros_like(x[k]) if g is None else g.detach()
    return results


def make_inputs(case: Case, seed: int) -> dict[str, Any]:
    """The case's host inputs for ``seed`` (float32 floating tensors)."""
    g = torch.Generator().manual_seed(seed + zlib.crc32((case.inputs_key or case.name).encode()) % 100_000)
    return case.make_inputs(g)


def evaluate(case: Case, inputs: dict[str, Any], device, dtype: torch.dtype, seed: int = 0) -> Tensors:
    """Outputs (and ``grad.*``) of ``case.fn`` on ``device`` with floating inputs rounded to ``dtype``."""
    return _run(case, case.fn, _cast(inputs, device, dtype), seed)


def evaluate_reference(case: Case, inputs: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> Tensors:
    """The float64 host reference on the inputs rounded to ``dtype`` (exactly the values the device saw)."""
    rounded = _cast(inputs, "cpu", dtype)
    return _run(case, case.ref_fn or case.fn, _cast(rounded, "cpu", torch.float64), seed)
