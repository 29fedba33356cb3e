"""Native RMSNorm, rotary embedding and SwiGLU (the formulas Hugging Face Llama/Qwen2 use), and the linear
layer of a decode loop whose weights stay fixed (``linear_prepacked``)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``; the normalisation runs in at least float32 and is cast
    back to x's dtype before the weight multiplies (as Qwen2RMSNorm / LlamaRMSNorm)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must have shape ({x.shape[-1]},) (x's last dim); got {tuple(weight.shape)}")
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim split in halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, "half" layout: ``x * cos + rotate_half(x) * sin``; cos/sin broadcast to x."""
    if x.shape[-1] % 2:
        raise ValueError(f"rotary needs an even last dim, got {x.shape[-1]}")
    if cos.shape != sin.shape or cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"cos and sin must share a shape whose last dim is {x.shape[-1]}; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    return x * cos + rotate_half(x) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``silu(g) = g * sigmoid(g)``."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    return torch.nn.functional.silu(gate) * up


def linear_weight_parts(weight: Union[torch.Tensor, Sequence[torch.Tensor]]) -> list:
    """``weight`` as a list of 2-D matrices with one in_features (a single matrix gives a list of one).

    A sequence stands for the matrices stacked along out features (``torch.cat(parts)``), as a decode loop
    fuses the q/k/v or gate/up projections of a layer; ValueError when a part is not 2-D or widths differ."""
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if not parts or any(p.dim() != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("linear_prepacked weight must be 2-D (out_features, in_features), or a sequence of such "
                         f"with one in_features; got {[tuple(p.shape) for p in parts]}")
    return parts


def linear_prepacked(weight: Union[torch.Tensor, Sequence[torch.Tensor]], bias: Optional[torch.Tensor] = None,
                     rows: Optional[int] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function ``x -> x @ weight^T + bias`` for a decode loop that applies the same weight many times.

    Contract for every implementation: ``weight`` is a matrix (out_features, in_features) or a sequence of
    them stacked along out features (:func:`linear_weight_parts`); the returned function equals
    ``F.linear(x, torch.cat(parts), bias)`` for any ``x (..., in_features)``; it may be specialised (a weight
    laid out once for the matmul kernel, or the parts read where they are) for inputs of ``rows`` rows (the
    product of x's leading dims) and must stay correct for any other count. ``weight`` and ``bias`` must not
    change while the function is in use (a specialised copy would go stale). The native one is ``F.linear``
    itself, on the parts concatenated once.
    """
    parts = linear_weight_parts(weight)
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    return lambda x: torch.nn.functional.linear(x, w, bias)
