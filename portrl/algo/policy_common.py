"""Shared pieces of the policy losses: config access, input checks, metrics.

``config`` is any Mapping (dict or omegaconf DictConfig). Defaults are verl's ActorConfig:
clip_ratio = 0.2 (clip_ratio_low/high fall back to it when missing or None), clip_ratio_c = 3.0,
tau_pos = 1.0, tau_neg = 1.05, clip_cov_ratio = 2e-4, clip_cov_lb = 1.0, clip_cov_ub = 5.0,
kl_cov_ratio = 2e-4, ppo_kl_coef = 0.1, dro_beta = None. ``global_batch_info`` feeds ``agg_loss``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from portrl.algo.aggregation import agg_loss, global_info
from portrl.algo.masked import as_bool_mask, compute_dtype, masked_mean

DEFAULTS = {
    "clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
    "tau_pos": 1.0, "tau_neg": 1.05, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
    "kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1, "dro_beta": None,
}


def cfg(config, key: str, default: Any = "__table__") -> Any:
    """``config[key]``; missing or None falls back to ``default`` (ActorConfig's by default)."""
    if default == "__table__":
        default = DEFAULTS[key]
    value = config.get(key, None) if config is not None else None
    return default if value is None else value


def clip_bounds(config) -> Tuple[float, float]:
    """``(ε_low, ε_high)``, each falling back to ``clip_ratio``."""
    base = float(cfg(config, "clip_ratio"))
    return float(cfg(config, "clip_ratio_low", base)), float(cfg(config, "clip_ratio_high", base))


def prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, who: str):
    """Check shapes, upcast to float32 (float64 stays), return ``(old, logp, A, m_bool, w | None)``."""
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if t.shape != log_prob.shape:
            raise ValueError(f"{who}: {name} shape {tuple(t.shape)} != log_prob shape {tuple(log_prob.shape)}")
    if log_prob.dim() != 2:
        raise ValueError(f"{who}: log_prob must be (batch, response_length), got shape {tuple(log_prob.shape)}")
    m = as_bool_mask(response_mask, log_prob)
    dt = compute_dtype(log_prob, old_log_prob, advantages)
    w = None
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != log_prob.shape:
            raise ValueError(f"{who}: rollout_is_weights shape {tuple(rollout_is_weights.shape)} != "
                             f"log_prob shape {tuple(log_prob.shape)}")
        w = rollout_is_weights.detach().to(dt)
    return old_log_prob.detach().to(dt), log_prob.to(dt), advantages.detach().to(dt), m, w


def aggregate(loss_mat, m, mode: str, config) -> torch.Tensor:
    return agg_loss(loss_mat, m, mode, **global_info(config))


def metrics(m, neg_approx_kl, clipfrac=None, clipfrac_lower=None, ppo_kl=None) -> Dict[str, torch.Tensor]:
    """``pg_clipfrac``, ``pg_clipfrac_lower`` (0 when a loss has none) and ``ppo_kl = masked_mean(−Δ)``."""
    zero = torch.zeros((), dtype=neg_approx_kl.dtype, device=neg_approx_kl.device)

    def frac(x: Optional[torch.Tensor]) -> torch.Tensor:
        return zero if x is None else masked_mean(x.to(neg_approx_kl.dtype), m).detach()

    kl = masked_mean(-neg_approx_kl, m) if ppo_kl is None else ppo_kl
    return {"pg_clipfrac": frac(clipfrac), "pg_clipfrac_lower": frac(clipfrac_lower), "ppo_kl": kl.detach()}
