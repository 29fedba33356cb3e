"""Covariance-based losses (Clip-Cov, KL-Cov) and GMPO's geometric-mean loss.

Same signature and metrics as ``policy_losses``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from portrl.algo.aggregation import global_info
from portrl.algo.masked import masked_mean
from portrl.algo.options import option, register_policy_loss_options
from portrl.algo.policy_common import aggregate, cfg, clip_bounds, metrics, prepare
from portrl.algo.registry import POLICY_LOSSES


def _cov(adv, logp, m):
    """``(A − mean A)(logp − mean logp)`` with means over valid tokens, detached."""
    a, lp = adv.detach(), logp.detach()
    return (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))


@POLICY_LOSSES.register("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).

    ``ρ = exp(Δ)`` (no clamp), ``ℓ = max(−Aρ, −A·clip(ρ, 1−ε_l, 1+ε_h))·corr``. Candidates are valid,
    not-already-clipped tokens with ``clip_cov_lb < cov < clip_cov_ub``; ``k = max(int(clip_cov_ratio·Σm), 1)``
    of them, drawn at random (``torch.randperm``, the global RNG), get ``corr = 0`` (no gradient).
    ``pg_clipfrac`` = share of valid tokens with corr = 0.
    """
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "clip_cov")
    eps_l, eps_h = clip_bounds(config)
    ratio_c = float(cfg(config, "clip_cov_ratio"))
    lb, ub = float(cfg(config, "clip_cov_lb")), float(cfg(config, "clip_cov_ub"))
    delta = logp - old
    ratio = torch.exp(delta)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - eps_l, 1 + eps_h)
    cov = _cov(adv, logp, m)
    candidates = m & ~(l2 > l1) & (cov > lb) & (cov < ub)
    idx = torch.nonzero(candidates.reshape(-1)).reshape(-1)
    k = max(int(ratio_c * int(m.sum())), 1)
    corr = torch.ones_like(logp)
    if idx.numel() > 0:
        chosen = idx[torch.randperm(idx.numel(), device="cpu")[:k].to(idx.device)]
        corr = corr.reshape(-1).index_fill(0, chosen, 0.0).reshape(logp.shape)
    loss_mat = torch.maximum(l1, l2) * corr
    loss = aggregate(loss_mat if w is None else loss_mat * w, m, loss_agg_mode, config)
    return loss, metrics(m, delta, clipfrac=corr == 0)


@dataclass
class ClipCovOptions:
    """``actor.policy_loss.clip_cov_ratio`` / ``clip_cov_lb`` / ``clip_cov_ub`` (verl's keys and defaults)."""

    SECTION: ClassVar[str] = "actor.policy_loss"
    clip_cov_ratio: float = option(2e-4, ge=0.0, le=1.0, doc="share of the valid tokens whose gradient is cut")
    clip_cov_lb: float = option(1.0, doc="lower covariance bound of the tokens eligible for the cut")
    clip_cov_ub: float = option(5.0, doc="upper covariance bound of the tokens eligible for the cut")


register_policy_loss_options("clip_cov", ClipCovOptions)


@POLICY_LOSSES.register("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, rollout_is_weights=None):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): ``ℓ = −A·exp(Δ)`` (no clamp, no clip); the
    ``k = max(1, int(N_valid·kl_cov_ratio))`` valid tokens of largest ``cov`` get ``+ ppo_kl_coef·|Δ|``.
    Metric ``ppo_kl = masked_mean(|Δ|)``. Ties in the top-k follow ``torch.topk``."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "kl_cov")
    ratio_k = float(cfg(config, "kl_cov_ratio"))
    coef = float(cfg(config, "ppo_kl_coef"))
    delta = logp - old
    loss_flat = (-adv * torch.exp(delta)).reshape(-1)
    valid_idx = torch.nonzero(m.reshape(-1)).reshape(-1)
    if valid_idx.numel() > 0 and ratio_k > 0:
        cov = _cov(adv, logp, m).reshape(-1)[valid_idx]
        k = max(1, int(valid_idx.numel() * ratio_k))
        top = valid_idx[torch.topk(cov, k, largest=True).indices]
        bump = torch.zeros_like(loss_flat).index_add(0, top, coef * delta.reshape(-1)[top].abs())
        loss_flat = loss_flat + bump
    loss_mat = loss_flat.reshape(logp.shape)
    loss = aggregate(loss_mat if w is None else loss_mat * w, m, loss_agg_mode, config)
    return loss, metrics(m, delta, ppo_kl=masked_mean(delta.abs(), m))


@dataclass
class KLCovOptions:
    """``actor.policy_loss.kl_cov_ratio`` / ``ppo_kl_coef`` (verl's keys and defaults)."""

    SECTION: ClassVar[str] = "actor.policy_loss"
    kl_cov_ratio: float = option(2e-4, ge=0.0, le=1.0, doc="share of the valid tokens that get the |log-ratio| term")
    ppo_kl_coef: float = option(0.1, ge=0.0, doc="weight of that |log-ratio| term")


register_policy_loss_options("kl_cov", KLCovOptions)


@POLICY_LOSSES.register("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None):
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673).

    ``σ = sign(A)``, ``Δc = clamp(Δ, −ε_l, ε_h)`` (the clip is in log-ratio space),
    ``Δ* = σ·min(σΔ, σΔc)``, ``ρ_i = exp(Σ_t Δ* m / Σ_t m)``, ``Ā_i = Σ_t A m / Σ_t m`` (0 for empty rows),
    loss ``= Σ_i −Ā_i ρ_i / B_g · dp_size`` over all rows (fully masked rows count, as in verl), with
    ``B_g = global_batch_size`` if given, else the local B: verl ignores global_batch_info here, which
    breaks data-parallel equivalence. ``loss_agg_mode`` is ignored. IS weights enter as the per-sequence
    geometric mean ``exp(Σ log(w + 1e-10) m / Σ m)``. ``pg_clipfrac`` = share of tokens with A ≠ 0 where
    Δ* ≠ Δ (a token with A = 0 has Δ* = 0 but was not clipped), ``pg_clipfrac_lower`` = those with A < 0.
    """
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "geo_mean")
    eps_l, eps_h = clip_bounds(config)
    delta = logp - old
    sign = torch.sign(adv)
    clamped = delta.clamp(-eps_l, eps_h)
    delta_star = sign * torch.minimum(sign * delta, sign * clamped)
    mf = m.to(delta.dtype)
    n = mf.sum(-1)
    safe_n = n.clamp(min=1)
    ratio = torch.exp((delta_star * mf).sum(-1) / safe_n)
    seq_adv = (adv * mf).sum(-1) / safe_n
    seq_loss = -seq_adv * ratio
    if w is not None:
        seq_loss = seq_loss * torch.exp((torch.log(w + 1e-10) * mf).sum(-1) / safe_n)
    info = global_info(config)
    dp = info.get("dp_size", 1)
    bg = info.get("global_batch_size")
    if bg is None and dp > 1:
        raise ValueError("geo_mean: dp_size > 1 needs global_batch_size in global_batch_info")
    if bg is None and not bool(m.any()):
        raise ValueError("geo_mean: response_mask is all zero (all-masked batch) and no global_batch_size is given")
    bg = float(seq_loss.shape[0] if bg is None else bg)
    if bg <= 0:
        raise ValueError("geo_mean: the batch has no rows")
    loss = seq_loss.sum() / bg * dp
    clipped = (delta_star != delta) & (adv != 0)  # sign(0) = 0 zeroes Δ* without any clipping
    return loss, metrics(m, delta, clipfrac=clipped, clipfrac_lower=clipped & (adv < 0))
