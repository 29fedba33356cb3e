"""Parity cases of the ops: every implementation of every op that can run here, against native in float64.

Shapes (``SIZES``): "standard" keeps a float32 + bfloat16 run on two CPU cores within about a
minute; "large" is the 4 x 512-token batch of a 0.5B-class model for accelerators. Both use
hidden 1024 (16 query heads, 4 key/value heads of dim 64: grouped-query attention), vocab 32000.
"tiny" is for kernels run through an interpreter (Triton's TRITON_INTERPRET=1) in tests.

The vision path adds two families: ``attention_varlen_bidirectional`` (the ``attention_varlen`` op with
``causal=False`` on the segments a vision tower attends within: whole images and 8x8-patch windows, all heads
with their own key/value, head dim 80 as Qwen2.5-VL's vision tower) and ``rotary_multimodal`` (M-RoPE on the
3-D positions of rows holding an image, ``portrl/ops/rotary_multimodal.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from portrl.ops import registry
from portrl.ops.attention import attention_varlen, cu_seqlens_from_lengths, decode_attention
from portrl.ops.decode_layer import decode_layer
from portrl.ops.layers import apply_rotary, linear_prepacked, rms_norm, swiglu
from portrl.ops.logprobs import logprobs_entropy
from portrl.ops.rotary_multimodal import apply_multimodal_rotary, multimodal_rope_index
from portrl.parity.case import Case

if TYPE_CHECKING:
    from portrl.device.backend import Backend

SIZES: dict[str, dict[str, Any]] = {
    "standard": dict(seq_lens=(384, 256, 192, 128), heads=16, kv_heads=4, head_dim=64, hidden=1024,
                     intermediate=2816, vocab=32000, logprob_rows=128,
                     vision_segments=(196, 64, 64, 100), vision_heads=16, vision_head_dim=80),
    "tiny": dict(seq_lens=(16, 8, 5), heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=96, vocab=300,
                 logprob_rows=24, vision_segments=(16, 4, 4, 9), vision_heads=2, vision_head_dim=8),
    "large": dict(seq_lens=(512, 512, 512, 512), heads=16, kv_heads=4, head_dim=64, hidden=1024,
                  intermediate=2816, vocab=32000, logprob_rows=2048,
                  vision_segments=(1024, 1024) + (64,) * 32, vision_heads=16, vision_head_dim=80),
}

#: case families that exercise an op in another setting (their case names start with the family): family -> op
FAMILY_OPS = {"attention_varlen_bidirectional": "attention_varlen"}


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


def _attention_fn(fn, max_len, causal=True):
    return lambda x: {"out": fn(x["q"], x["k"], x["v"], x["cu_seqlens"], max_len, None, causal)}


def _vision_attention_inputs(s):
    segments, heads, d = s["vision_segments"], s["vision_heads"], s["vision_head_dim"]
    total = sum(segments)
    return lambda g: {"q": torch.randn(total, heads, d, generator=g), "k": torch.randn(total, heads, d, generator=g),
                      "v": torch.randn(total, heads, d, generator=g),
                      "cu_seqlens": cu_seqlens_from_lengths(list(segments))}


def mrope_section(head_dim: int) -> tuple[int, int, int]:
    """The temporal / height / width split of ``head_dim / 2`` rotary frequencies, in Qwen2-VL's 16/24/24
    proportions (head dim 128)."""
    t = head_dim // 8
    return t, (head_dim // 2 - t) // 2, head_dim // 2 - t - (head_dim // 2 - t) // 2


def _image_row_positions(n: int) -> torch.Tensor:
    """(3, n) M-RoPE positions of a row of ``n`` tokens: a short text, a square-ish image of about n/2 tokens,
    then text."""
    side = max(1, int((n // 2) ** 0.5))
    before = min(3, n - side * side)
    image_token = 1
    ids = [0] * before + [image_token] * (side * side) + [0] * (n - before - side * side)
    pos, _ = multimodal_rope_index(torch.tensor([ids]), torch.tensor([[1, 2 * side, 2 * side]]), image_token, 2)
    return pos[:, 0]


def _rotary_multimodal_inputs(s):
    total, d = sum(s["seq_lens"]), s["head_dim"]

    def make(g):
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        pos = torch.cat([_image_row_positions(n) for n in s["seq_lens"]], dim=1)  # (3, total)
        ang = pos.float()[..., None] * inv_freq
        emb = torch.cat([ang, ang], dim=-1)[:, :, None, :]  # (3, total, 1, D): one table per axis
        return {"x": torch.randn(total, s["heads"], d, generator=g), "cos": emb.cos(), "sin": emb.sin()}
    return make


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


def _decode_attention_inputs(s):
    """One decode step: a query per row against a cache view (its slots beyond the step unused) where each row's
    left padding (the longest sequence's length minus its own) is hidden."""
    rows, longest, d = len(s["seq_lens"]), max(s["seq_lens"]), s["head_dim"]

    def make(g):
        cache = torch.randn(2, rows, s["kv_heads"], longest + 8, d, generator=g)
        hidden = torch.arange(longest)[None] < torch.tensor([longest - n for n in s["seq_lens"]])[:, None]
        return {"q": torch.randn(rows, s["heads"], 1, d, generator=g), "k": cache[0, :, :, :longest],
                "v": cache[1, :, :, :longest], "hidden": hidden}
    return make


def _decode_layer_inputs(s):
    """One decode step of one decoder layer (portrl.ops.decode_layer): a token per row at slot ``longest`` of a
    cache whose keys are stored transposed, each row's left padding hidden, q/k/v with a bias."""
    rows, longest, d, kv = len(s["seq_lens"]), max(s["seq_lens"]), s["head_dim"], s["kv_heads"]
    hid, inter, qkv = s["hidden"], s["intermediate"], (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]

    def make(g):
        def w(*shape):
            return torch.randn(*shape, generator=g) / shape[-1] ** 0.5
        angle = torch.rand(rows, d, generator=g) * 6.0
        sin = angle.sin()
        sin[:, : d // 2] = -sin[:, : d // 2]  # signed, as portrl/rollout/fast_decode.py stores it
        hidden = torch.arange(longest + 1)[None] < torch.tensor([longest - n for n in s["seq_lens"]])[:, None]
        return {"x": torch.randn(rows, hid, generator=g), "ln1": 1 + 0.1 * torch.randn(hid, generator=g),
                "w_qkv": w(qkv, hid), "b_qkv": torch.randn(qkv, generator=g), "w_o": w(hid, s["heads"] * d),
                "ln2": 1 + 0.1 * torch.randn(hid, generator=g), "w_gu": w(2 * inter, hid), "w_down": w(hid, inter),
                "k_store": torch.randn(rows, kv, d, longest + 16, generator=g),
                "v_cache": torch.randn(rows, kv, longest + 8, d, generator=g), "cos": angle.cos(), "sin": sin,
                "hidden": hidden}
    return make


def _decode_layer_fn(s):
    """The op on copies of the state it updates; every output and the updated state compared."""
    longest, heads, kv, d = max(s["seq_lens"]), s["heads"], s["kv_heads"], s["head_dim"]

    def wrap(fn):
        def run(x):
            h, k, v = x["x"].clone(), x["k_store"].clone(), x["v_cache"].clone()
            qkv_w, gu_w = x["w_qkv"].split([heads * d, kv * d, kv * d]), x["w_gu"].chunk(2)
            outs = fn(h, x["ln1"], [t.contiguous() for t in qkv_w], x["b_qkv"], x["w_o"], None, x["ln2"],
                      [t.contiguous() for t in gu_w], x["w_down"], k, v, x["cos"], x["sin"], x["hidden"], longest,
                      1e-6, 1e-6, d ** -0.5, heads, kv)
            return dict(zip(("qkv", "o", "gu", "down"), outs), x=h, k_store=k, v_cache=v)
        return run
    return wrap


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
    max_len, max_segment = max(s["seq_lens"]), max(s["vision_segments"])
    section = mrope_section(s["head_dim"])
    return {
        "attention_varlen": (_attention_inputs(s), lambda fn: _attention_fn(fn, max_len), ("q", "k", "v")),
        "attention_varlen_bidirectional": (_vision_attention_inputs(s),
                                           lambda fn: _attention_fn(fn, max_segment, causal=False), ("q", "k", "v")),
        "decode_attention": (_decode_attention_inputs(s), lambda fn: (lambda x: {
            "out": fn(x["q"], x["k"], x["v"], x["hidden"], s["head_dim"] ** -0.5)}), ()),  # inference only (decode)
        "decode_layer": (_decode_layer_inputs(s), _decode_layer_fn(s), ()),  # inference only (decode)
        "linear_prepacked": (_linear_inputs(s), _linear_fn, ()),  # inference only (decode loops)
        "logprobs_entropy": (_logprobs_inputs(s), _logprobs_fn, ("hidden", "weight")),
        "rms_norm": (_rms_inputs(s), lambda fn: (lambda x: {"out": fn(x["x"], x["weight"], 1e-6)}), ("x", "weight")),
        "rotary": (_rotary_inputs(s), lambda fn: (lambda x: {"out": fn(x["x"], x["cos"], x["sin"])}), ("x",)),
        "rotary_multimodal": (_rotary_multimodal_inputs(s),
                              lambda fn: (lambda x: {"out": fn(x["x"], x["cos"], x["sin"], section)}), ("x",)),
        "swiglu": (_swiglu_inputs(s), lambda fn: (lambda x: {"out": fn(x["gate"], x["up"])}), ("gate", "up")),
    }


def _native(op: str):
    return {"attention_varlen": attention_varlen, "decode_attention": decode_attention, "decode_layer": decode_layer,
            "linear_prepacked": linear_prepacked,
            "logprobs_entropy": logprobs_entropy, "rms_norm": rms_norm, "rotary": apply_rotary,
            "rotary_multimodal": apply_multimodal_rotary, "swiglu": swiglu}[op]


def op_cases(backend: Backend, size: str = "standard", ops=None, all_impls: bool = True) -> tuple[list[Case], dict]:
    """Cases for each op (and each family of :data:`FAMILY_OPS`; ``ops`` may name either): the implementation
    the backend selects, plus (``all_impls``) every other one that can run here. Returns ``(cases, impls)``
    with ``impls[op] = {"selected": name, "available": {name: None | reason it cannot run}}`` for the report."""
    specs = op_specs(size)
    ops = list(ops) if ops else list(specs)
    unknown = [op for op in ops if op not in specs]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; valid: {', '.join(specs)}")
    cases, impls = [], {}
    for family in ops:
        op = FAMILY_OPS.get(family, family)
        make, wrap, grads = specs[family]
        selected, _ = registry.select(op, backend=backend)
        available = registry.implementations(op)
        impls[op] = {"selected": selected, "available": available}
        names = [selected] + ([n for n, why in available.items() if why is None and n != selected] if all_impls else [])
        ref = wrap(_native(op))
        for name in names:
            _, fn = registry.select(op, impl=name, backend=backend)
            cases.append(Case(name=f"{family}[{name}]", group="ops", make_inputs=make, fn=wrap(fn), ref_fn=ref,
                              grad_inputs=grads, inputs_key=f"ops/{family}", ref_key=f"ops/{family}",
                              info={"op": op, "impl": name, "selected": name == selected}))
    return cases, impls
