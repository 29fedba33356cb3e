"""Clipped value loss for the PPO critic, the critic's explained variance, and the entropy loss term."""

from __future__ import annotations

from typing import Tuple

import torch

from portrl.algo.aggregation import agg_loss
from portrl.algo.masked import as_bool_mask, compute_dtype, entropy_from_logits, masked_mean, masked_var


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean", dp_size: int = 1,
                       batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, Schulman et al. 2017; the clipping of OpenAI baselines ppo2):
    ``v̂c = clip(vpreds, values − c, values + c)``, ``L = max((vpreds − R)², (v̂c − R)²)``,
    ``vf_loss = ½·agg_loss(L, m, mode, global counts)``, ``vf_clipfrac = masked_mean((v̂c−R)² > (vpreds−R)²)``.
    Returns ``(vf_loss, vf_clipfrac)``; ``values`` (old critic values) and ``returns`` get no gradient."""
    for name, t in (("returns", returns), ("values", values)):
        if t.shape != vpreds.shape:
            raise ValueError(f"compute_value_loss: {name} shape {tuple(t.shape)} != vpreds shape {tuple(vpreds.shape)}")
    if cliprange_value is None or cliprange_value < 0:
        raise ValueError(f"compute_value_loss: cliprange_value must be >= 0, got {cliprange_value!r}")
    m = as_bool_mask(response_mask, vpreds)
    dt = compute_dtype(vpreds, returns, values)
    v, r, old = vpreds.to(dt), returns.detach().to(dt), values.detach().to(dt)
    clipped = torch.maximum(torch.minimum(v, old + cliprange_value), old - cliprange_value)
    l1, l2 = (v - r).square(), (clipped - r).square()
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), m, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                          global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    return loss, masked_mean((l2 > l1).to(dt), m).detach()


@torch.no_grad()
def explained_variance(returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """How much of the value targets' variance the critic explains, over every valid token of the batch:
    ``EV = 1 − Var(R − V) / Var(R)`` (population variances; verl's ``critic/vf_explained_var``). 1 is a
    perfect critic, 0 one no better than the batch mean, negative worse than that. A 0-dim float64 tensor,
    NaN when the returns do not vary (every response scored the same) or the mask selects nothing."""
    if returns.shape != values.shape:
        raise ValueError(f"explained_variance: returns shape {tuple(returns.shape)} != values shape {tuple(values.shape)}")
    m = as_bool_mask(response_mask, returns)
    if not bool(m.any()):
        return torch.tensor(float("nan"), dtype=torch.float64)
    r, v = returns.detach().double(), values.detach().double()
    var_r = masked_var(r, m, unbiased=False)
    if float(var_r) <= 0.0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return (1.0 - masked_var(r - v, m, unbiased=False) / var_r).cpu()


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                         chunk_size=None, **global_counts) -> torch.Tensor:
    """``agg_loss(entropy_from_logits(logits), m, mode)``; logits ``(B,T,V)``. The actor subtracts
    ``entropy_coeff`` times this from its loss."""
    return agg_loss(entropy_from_logits(logits, chunk_size=chunk_size), response_mask, loss_agg_mode, **global_counts)
