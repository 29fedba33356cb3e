"""Masked statistics, the response mask and entropy from logits.

Masks are explicit: any tensor whose non-zero entries mark valid positions (bool, int or float 0/1).
Values at masked positions (even NaN or inf) never reach a result. Inputs are never modified.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype used inside: float64 if any input is float64, else float32."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def as_bool_mask(mask: torch.Tensor, like: Optional[torch.Tensor] = None, name: str = "response_mask") -> torch.Tensor:
    """``mask != 0`` as bool, checking that its shape equals ``like``'s."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """``Σ values·m`` over ``axis`` (all elements if None); masked values (NaN/inf too) are ignored."""
    m = as_bool_mask(mask, values, "mask")
    x = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return x.sum() if axis is None else x.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """``Σ values·m / Σ m`` (verl ``masked_mean``).

    Where ``Σ m == 0`` the result is 0, never NaN. Unlike verl (``/(Σm + 1e-8)``) the division is
    exact when ``Σ m > 0``; the 1e-8 bias in the reference is an accident of guarding against 0.
    """
    m = as_bool_mask(mask, values, "mask")
    s = masked_sum(values, m, axis)
    n = m.sum() if axis is None else m.sum(dim=axis)
    n = n.to(s.dtype)
    return torch.where(n > 0, s / n.clamp(min=1), torch.zeros((), dtype=s.dtype, device=s.device))


def _valid_count(mask: torch.Tensor) -> int:
    return int(mask.sum().item())


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over every valid element of the tensor (not per row).

    ``μ = masked_mean(x)``, ``v = masked_mean((x − μ)²)``, times ``n/(n−1)`` when unbiased (Bessel).
    Raises ValueError when ``n == 0`` (all masked) or, if unbiased, ``n == 1``.
    """
    m = as_bool_mask(mask, values, "mask")
    n = _valid_count(m)
    if n == 0:
        raise ValueError("masked_var: the mask selects no element (all-masked batch); the variance is undefined")
    if unbiased and n == 1:
        raise ValueError("masked_var: the mask selects a single element; the unbiased variance needs at least 2")
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x − μ)·rsqrt(var_unbiased + eps)`` over the valid elements (``+ μ`` again if not shift_mean).

    Statistics are computed in float32 (float64 for float64 input) and the result has that dtype.
    Masked positions are set to 0: verl leaves them at ``(x − μ)/σ``, an accident that puts non-zero
    advantages on padding. Raises ValueError when fewer than 2 elements are valid.
    """
    m = as_bool_mask(mask, values, "mask")
    x = values.to(compute_dtype(values))
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def get_response_mask(
    response_ids: torch.Tensor, eos_token: Union[int, Iterable[int]] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Mask of the response up to and **including** the first EOS: ``(cumsum(is_eos) − is_eos) == 0``.

    ``eos_token`` is one id or several (any of them ends the response). Rows without an EOS are all 1.
    """
    if not isinstance(response_ids, torch.Tensor) or response_ids.dim() != 2:
        raise ValueError("get_response_mask: response_ids must be a 2-D tensor (batch, response_length)")
    ids = [eos_token] if isinstance(eos_token, int) else list(eos_token)
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"get_response_mask: eos_token must be an int or a non-empty list of ints, got {eos_token!r}")
    is_eos = torch.isin(response_ids, torch.tensor(ids, device=response_ids.device, dtype=response_ids.dtype))
    is_eos = is_eos.to(torch.int64)
    return ((torch.cumsum(is_eos, dim=-1) - is_eos) == 0).to(dtype)


def entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, in nats: ``logsumexp(z) − Σ softmax(z)·z``.

    Computed in float32 (float64 for float64 logits) whatever the input dtype; the result has that
    dtype. With ``chunk_size`` the leading rows (logits flattened to ``(N, V)``) are processed
    ``chunk_size`` at a time so only one chunk is upcast at once. Differentiable. In training, divide
    the logits by the rollout temperature first.
    """
    if logits.dim() < 1:
        raise ValueError("entropy_from_logits: logits need a vocabulary dimension")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size must be >= 1, got {chunk_size}")
    dt = compute_dtype(logits)

    def _ent(z: torch.Tensor) -> torch.Tensor:
        z = z.to(dt)
        p = torch.softmax(z, dim=-1)
        return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)

    if chunk_size is None:
        return _ent(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    parts = [_ent(flat[i : i + chunk_size]) for i in range(0, flat.shape[0], chunk_size)]
    out = torch.cat(parts) if parts else flat.new_zeros((0,), dtype=dt)
    return out.reshape(logits.shape[:-1])


def clip_by_value(x: torch.Tensor, low, high) -> torch.Tensor:
    """``max(min(x, high), low)``; bounds may be tensors."""
    return torch.maximum(torch.minimum(x, torch.as_tensor(high, dtype=x.dtype, device=x.device)),
                         torch.as_tensor(low, dtype=x.dtype, device=x.device))
