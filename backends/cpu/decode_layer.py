"""The CPU's one-call decode layer (op ``decode_layer``, implementation ``fused``): the whole layer of a one-token
decode step in one native call (backends/cpu/decode_layer.cpp, the AVX-512 or AVX2 build backends/cpu/isa.py
chooses), for float32 CPU tensors with nothing to differentiate and at most ``ROWS_MAX`` rows (the rows kernel's
range); anything else takes the native op (portrl.ops.decode_layer). The step's last norm and head go through the
same library (:func:`bind_head`), so a whole decode step runs on the same threads.

Op by op the layer is ~10 torch calls and five parallel regions, and torch's OpenMP threads sleep between regions
(GOMP_SPINCOUNT=1000); on a VM each wake costs 50-100 us, and for a small model the calls' set-up is most of the
step. decode_layer.cpp says how its phases share the calling thread and helper threads (spin_pool.h) that stay
awake from one call of a step to the next.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portrl.backends.cpu import isa, native_build
from portrl.ops.decode_layer import decode_layer as native_decode_layer
from portrl.ops.layers import rms_norm

LIBRARY = "decode_layer"
#: most rows the fused layer serves: the rows kernel's (backends/cpu/kernels.py ROWS_MAX, kept equal by a test)
ROWS_MAX = 64


def _served(tensors: tuple, caches: tuple) -> bool:
    """Float32 CPU tensors (None: an absent bias), every one but the caches contiguous (the caches' layout the
    kernel checks itself)."""
    return (all(t is None or t.is_contiguous() for t in tensors)
            and all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in (*tensors, *caches)))


def _fits(x: torch.Tensor, tensors: tuple, caches: tuple) -> bool:
    """Whether the kernel serves these arguments: 1 to ROWS_MAX rows, :func:`_served`, nothing to differentiate."""
    return (x.dim() == 2 and 0 < x.shape[0] <= ROWS_MAX and _served(tensors, caches)
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*tensors, *caches))))


def _kernel(variant: str | None, name: str = "layer"):
    """The build's op ``name`` (``layer`` or ``head``) for ``variant`` (None: backends/cpu/isa.py's), or None where
    it cannot load."""
    variant = variant or isa.chosen().variant
    if variant is None or not native_build.try_load(LIBRARY, variant):
        return None
    return getattr(getattr(torch.ops, native_build.ops_namespace(LIBRARY, variant)), name)


def _outputs(x: torch.Tensor, widths: tuple) -> tuple:
    """The four outputs (qkv, o, gu, down), fresh, for ``x``'s rows."""
    return tuple(x.new_empty(x.shape[0], n) for n in widths)


def _widths(qkv_w, o_w, gate_up_w, down_w) -> tuple:
    """The four outputs' widths: qkv, o, gate/up, down."""
    return sum(w.shape[0] for w in qkv_w), o_w.shape[0], sum(w.shape[0] for w in gate_up_w), down_w.shape[0]


def decode_layer_fused(x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, k_store, v_cache, cos, sin, hidden,
                       start, eps1, eps2, scale, heads, kv_heads, out=None, variant: str | None = None):
    """The ``decode_layer`` op's contract (portrl.ops.decode_layer), in one native call where it fits (see the
    module docstring). ``variant`` (``avx512`` / ``avx2``): that build, which
    this CPU must run (tests); None: backends/cpu/isa.py's."""
    args = (x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, k_store, v_cache, cos, sin, hidden, start, eps1,
            eps2, scale, heads, kv_heads)
    layer = _kernel(variant)
    if layer is None or not _fits(x, (x, ln1, *qkv_w, qkv_b, o_w, o_b, ln2, *gate_up_w, down_w, cos, sin),
                                  (k_store, v_cache)):
        return native_decode_layer(*args, out=out)
    out = out if out is not None else _outputs(x, _widths(qkv_w, o_w, gate_up_w, down_w))
    layer(*args, *out)
    return tuple(out)


def bind(ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w, eps1, eps2, scale, heads, kv_heads,
         variant: str | None = None):
    """``decode_layer_fused`` with one layer's weights, as ``step(x, k_store, v_cache, cos, sin, hidden, start,
    out=None)`` (portrl.ops.decode_layer.bind_layer's contract). The weights are checked and the build resolved
    here, once: a step checks only its own tensors, a large part of a small layer's call (docs/performance.md). A
    step with gradients on, or tensors the kernel does not serve, goes through :func:`decode_layer_fused`."""
    weights = (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w)
    tail = (eps1, eps2, scale, heads, kv_heads)
    flat = (ln1, *qkv_w, qkv_b, o_w, o_b, ln2, *gate_up_w, down_w)
    layer = _kernel(variant) if _served(flat, ()) else None
    widths = _widths(qkv_w, o_w, gate_up_w, down_w)

    def step(x, k_store, v_cache, cos, sin, hidden, start, out=None):
        # gradients on: the weights (parameters) would need them, which only the op gives
        if layer is None or torch.is_grad_enabled() or not _fits(x, (x, cos, sin), (k_store, v_cache)):
            return decode_layer_fused(x, *weights, k_store, v_cache, cos, sin, hidden, start, *tail, out=out,
                                      variant=variant)
        out = out if out is not None else _outputs(x, widths)
        layer(x, *weights, k_store, v_cache, cos, sin, hidden, start, *tail, *out)
        return tuple(out)

    return step


def bind_head(norm_w, eps, head_w, head_b, variant: str | None = None):
    """A decode step's last norm and head, ``logits = rms(x, norm_w, eps) head_w^T + head_b``, as ``head(x)``
    (portrl.ops.decode_layer.bind_head's contract) on the layers' threads: decode_layer.cpp's op ``head``, whose
    logits equal the backend's ``rms_norm`` then the rows kernel's bit for bit (tested). None where the kernel does
    not serve the weights (not contiguous float32 CPU tensors) or cannot load: the caller keeps its own head. A step
    it does not serve (gradients on, more than ROWS_MAX rows, other tensors): the native ``rms_norm`` then
    ``F.linear``."""
    head = _kernel(variant, "head") if _served((norm_w, head_w, head_b), ()) else None
    if head is None:
        return None

    def step(x):
        if torch.is_grad_enabled() or not _fits(x, (x,), ()):
            return F.linear(rms_norm(x, norm_w, eps), head_w, head_b)
        return head(x, norm_w, eps, [head_w], head_b)

    return step


#: a decode loop with more rows keeps its op-by-op layer (backends/cpu/decode_kernel.py reads this)
decode_layer_fused.max_rows = ROWS_MAX  # type: ignore[attr-defined]
#: one layer's weights bound once for a decode loop's steps (portrl.ops.decode_layer.bind_layer reads this)
decode_layer_fused.bind = bind  # type: ignore[attr-defined]
#: the step's last norm and head on the same threads (portrl.ops.decode_layer.bind_head reads this)
decode_layer_fused.bind_head = bind_head  # type: ignore[attr-defined]
