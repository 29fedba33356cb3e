"""Parity cases of the ops: every implementation of every op that can run here, against native in float64.

Shapes (``SIZES``): "standard" keeps a float32 + bfloat16 run on two CPU cores within about a
minute; "large" is the 4 x 512-token batch of a 0.5B-class model for accelerators. Both use
hidden 1024 (16 query heads, 4 key/value heads of dim 64: grouped-query attention), vocab 32000.
"tiny" is for kernels run through an interpreter (Triton's TRITON_INTERPRET=1) in tests.
"""

from __future__ import annotations

from typing import Any

import torch

from portrl.ops import registry
from portrl.ops.attention import attention_varlen, cu_seqlens_from_lengths
from portrl.ops.layers import apply_rotary, linear_prepacked, rms_norm, swiglu
from portrl.ops.logprobs import logprobs_entropy
from portrl.parity.case import Case

SIZES: dict[str, dict[str, Any]] = {
    "standard": dict(seq_lens=(384, 256, 192, 128), heads=16, kv_heads=4, head_dim=64, hidden=1024,
                     intermediate=2816, vocab=32000, logprob_rows=128),
    "tiny": dict(seq_lens=(16, 8, 5), heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=96, vocab=300,
                 logprob_rows=24),
    "large": dict(seq_lens=(512, 512, 512, 512), heads=16, kv_heads=4, head_dim=64, hidden=1024,
                  intermediate=2816, vocab=32000, logprob_rows=2048),
}


def size_spec(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown parity size {size!r}; valid: {', '.join(SIZES)}")
    return SIZES[size]


def _positions(seq_lens) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in seq_lens])


def _attention_inputs(s):
    total = sum(s["seq_lens"])

    def make(g):
        return {
            "q": torch.randn(total, s["heads"], s["head_dim"], generator=g),
            "k": torch.randn(total, s["kv_heads"], s["head_dim"], generator=g),
            "v": torch.randn(total, s["kv_heads"], s["head_dim"], generator=g),
            "cu_seqlens": cu_seqlens_from_lengths(list(s["seq_lens"])),
        }
    return make


def _attention_fn(fn, max_len):
    return lambda x: {"out": fn(x["q"], x["k"], x["v"], x["cu_seqlens"], max_len)}


def _logprobs_inputs(s):
    n, h, v = s["logprob_rows"], s["hidden"], s["vocab"]

    def make(g):
        return {
            "hidden": torch.randn(n, h, generator=g),
            "weight": torch.randn(v, h, generator=g) * (2.0 / h ** 0.5),
            "labels": torch.randint(0, v, (n,), generator=g),
        }
    return make


def _logprobs_fn(fn):
    def run(x):
        logp, ent = fn(x["hidden"], x["weight"], x["labels"], 0.7)
        return {"logp": logp, "entropy": ent}
    return run


def _rms_inputs(s):
    total = sum(s["seq_lens"])
    return lambda g: {"x": 3.0 * torch.randn(total, s["hidden"], generator=g),
                      "weight": 1.0 + 0.1 * torch.randn(s["hidden"], generator=g)}


def _rotary_inputs(s):
    total, d = sum(s["seq_lens"]), s["head_dim"]

    def make(g):
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = _positions(s["seq_lens"]).float()[:, None] * inv_freq[None]
        emb = torch.cat([ang, ang], dim=-1)[:, None, :]
        return {"x": torch.randn(total, s["heads"], d, generator=g), "cos": emb.cos(), "sin": emb.sin()}
    return make


def _swiglu_inputs(s):
    total = sum(s["seq_lens"])
    return lambda g: {"gate": 2.0 * torch.randn(total, s["intermediate"], generator=g),
                      "up": torch.randn(total, s["intermediate"], generator=g)}


def _linear_inputs(s):
    rows = len(s["seq_lens"])  # one decode step: a token per sequence
    return lambda g: {"x": torch.randn(rows, s["hidden"], generator=g),
                      "weight": torch.randn(s["intermediate"], s["hidden"], generator=g) / s["hidden"] ** 0.5,
                      "bias": torch.randn(s["intermediate"], generator=g)}


def _linear_fn(fn):
    return lambda x: {"out": fn(x["weight"], x["bias"], x["x"].shape[0])(x["x"])}


def op_specs(size: str = "standard") -> dict[str, tuple]:
    """op -> (make_inputs, wrap(fn) -> case fn, grad_inputs)."""
    s = size_spec(size)
    max_len = max(s["seq_lens"])
    return {
        "attention_varlen": (_attention_inputs(s), lambda fn: _attention_fn(fn, max_len), ("q", "k", "v")),
        "linear_prepacked": (_linear_inputs(s), _linear_fn, ()),  # inference only (decode loops)
        "logprobs_entropy": (_logprobs_inputs(s), _logprobs_fn, ("hidden", "weight")),
        "rms_norm": (_rms_inputs(s), lambda fn: (lambda x: {"out": fn(x["x"], x["weight"], 1e-6)}), ("x", "weight")),
        "rotary": (_rotary_inputs(s), lambda fn: (lambda x: {"out": fn(x["x"], x["cos"], x["sin"])}), ("x",)),
        "swiglu": (_swiglu_inputs(s), lambda fn: (lambda x: {"out": fn(x["gate"], x["up"])}), ("gate", "up")),
    }


def _native(op: str):
    return {"attention_varlen": attention_varlen, "linear_prepacked": linear_prepacked,
            "logprobs_entropy": logprobs_entropy, "rms_norm": rms_norm,
            "rotary": apply_rotary, "swiglu": swiglu}[op]


def op_cases(backend, size: str = "standard", ops=None, all_impls: bool = True) -> tuple[list[Case], dict]:
    """Cases for each op: the implementation the backend selects, plus (``all_impls``) every other one that
    can run here. Returns ``(cases, impls)`` with ``impls[op] = {"selected": name, "available": {name: None |
    reason it cannot run}}`` for the report."""
    specs = op_specs(size)
    ops = list(ops) if ops else list(specs)
    unknown = [op for op in ops if op not in specs]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; valid: {', '.join(specs)}")
    cases, impls = [], {}
    for op in ops:
        make, wrap, grads = specs[op]
        selected, _ = registry.select(op, backend=backend)
        available = registry.implementations(op)
        impls[op] = {"selected": selected, "available": available}
        names = [selected] + ([n for n, why in available.items() if why is None and n != selected] if all_impls else [])
        ref = wrap(_native(op))
        for name in names:
            _, fn = registry.select(op, impl=name, backend=backend)
            cases.append(Case(name=f"{op}[{name}]", group="ops", make_inputs=make, fn=wrap(fn), ref_fn=ref,
                              grad_inputs=grads, inputs_key=f"ops/{op}", ref_key=f"ops/{op}",
                              info={"op": op, "impl": name, "selected": name == selected}))
    return cases, impls
