"""Policy losses of the PPO family. Every one has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)
-> (loss, metrics)`` with metrics ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.

Notation: ``Δ = logp − old``, ``ρ = exp(clamp(Δ, −20, 20))``, ``ε_l``/``ε_h`` the clip bounds.
IS weights (``rollout_is_weights``, detached) multiply the per-token loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from portrl.algo.options import option, register_policy_loss_options
from portrl.algo.policy_common import aggregate, cfg, clip_bounds, metrics, prepare
from portrl.algo.registry import POLICY_LOSSES


def _weighted(loss_mat, w):
    return loss_mat if w is None else loss_mat * w


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """PPO clip (Schulman et al. 2017, arXiv 1707.06347) with asymmetric bounds (DAPO clip-higher,
    arXiv 2503.14476) and dual clip (Ye et al. 2020, arXiv 1912.09729):
    ``ℓc = max(−Aρ, −A·clip(ρ, 1−ε_l, 1+ε_h))``; for ``A < 0``: ``ℓ = min(ℓc, −A·c)`` (``c = clip_ratio_c > 1``).
    ``pg_clipfrac = mean[−A·clip(ρ) > −Aρ]``, ``pg_clipfrac_lower = mean[(ℓc > −A·c) ∧ A < 0]``."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "vanilla")
    eps_l, eps_h = clip_bounds(config)
    c = float(cfg(config, "clip_ratio_c"))
    if c <= 1.0:
        raise ValueError(f"vanilla: clip_ratio_c (dual clip) must be > 1.0, got {c}")
    delta = logp - old
    ratio = torch.exp(delta.clamp(-20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - eps_l, 1 + eps_h)
    lc = torch.maximum(l1, l2)
    l3 = -adv * c
    loss_mat = torch.where(adv < 0, torch.minimum(l3, lc), lc)
    loss = aggregate(_weighted(loss_mat, w), m, loss_agg_mode, config)
    return loss, metrics(m, delta, clipfrac=l2 > l1, clipfrac_lower=(lc > l3) & (adv < 0))


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence ratio ``s_i = Σ_t Δ m / max(Σ_t m, 1)``;
    token log-ratio ``logp − sg(logp) + sg(s_i)`` clamped to ≤ 10, so the value is ``exp(min(s_i, 10))``
    and the gradient ``exp(s_i)·∇logp_t``. ``ℓ = max(−Aρ, −A·clip(ρ, 1−ε_l, 1+ε_h))``.
    Always aggregated with ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored, as in verl)."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "gspo")
    eps_l, eps_h = clip_bounds(config)
    delta = logp - old
    mf = m.to(delta.dtype)
    seq = (torch.where(m, delta, 0.0).sum(-1) / mf.sum(-1).clamp(min=1)).detach()
    log_ratio = (logp - logp.detach() + seq[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - eps_l, 1 + eps_h)
    loss_mat = torch.maximum(l1, l2)
    loss = aggregate(_weighted(loss_mat, w), m, "seq-mean-token-mean", config)
    return loss, metrics(m, delta, clipfrac=l2 > l1)


@POLICY_LOSSES.register("sapo")
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):
    """SAPO (Soft Adaptive Policy Optimization, Qwen team 2025): a smooth gate instead of a
    hard clip, ``f = σ(τ(ρ−1))·4/τ``, ``τ = tau_pos`` if ``A > 0`` else ``tau_neg``; ``ℓ = −f·A``.
    Always ``seq-mean-token-mean``."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "sapo")
    tau_pos, tau_neg = float(cfg(config, "tau_pos")), float(cfg(config, "tau_neg"))
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    delta = logp - old
    ratio = torch.exp(delta.clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    loss = aggregate(_weighted(-gate * adv, w), m, "seq-mean-token-mean", config)
    return loss, metrics(m, delta)


@dataclass
class SAPOOptions:
    """``actor.tau_pos`` / ``actor.tau_neg``: SAPO's gate temperatures (verl's actor keys)."""

    SECTION: ClassVar[str] = "actor"
    tau_pos: float = option(1.0, gt=0.0, doc="gate temperature where A > 0")
    tau_neg: float = option(1.05, gt=0.0, doc="gate temperature where A <= 0")


register_policy_loss_options("sapo", SAPOOptions)


@POLICY_LOSSES.register("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None):
    """GPG (Chu et al. 2025, arXiv 2504.02546): plain policy gradient ``ℓ = −logp·A``, no ratio."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "gpg")
    loss = aggregate(_weighted(-logp * adv, w), m, loss_agg_mode, config)
    return loss, metrics(m, logp - old)


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_is_weights=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``ℓ = −sg(clip(ρ, 1−ε_l, 1+ε_h))·A·logp``; the clipped IS weight
    is a constant, so every token keeps its gradient ``−w·A·∇logp``. ``pg_clipfrac`` = share of tokens with
    ρ > 1+ε_h, ``pg_clipfrac_lower`` = share with ρ < 1−ε_l (verl reports one share, clipped either way:
    their sum)."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "cispo")
    eps_l, eps_h = clip_bounds(config)
    delta = logp - old
    ratio = torch.exp(delta.clamp(-20.0, 20.0))
    clipped = ratio.clamp(1 - eps_l, 1 + eps_h).detach()
    loss = aggregate(_weighted(-clipped * adv * logp, w), m, loss_agg_mode, config)
    return loss, metrics(m, delta, clipfrac=ratio > 1 + eps_h, clipfrac_lower=ratio < 1 - eps_l)


def _dppo(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, name)
    eps_l, eps_h = clip_bounds(config)
    c = float(cfg(config, "clip_ratio_c"))
    delta = logp - old
    ratio = torch.exp(delta.clamp(-20.0, 20.0))
    capped = torch.minimum(ratio, torch.full_like(ratio, c)).detach()
    p, q = torch.exp(logp.detach()), torch.exp(old)
    if name == "dppo_tv":
        diff = p - q
        valid = torch.where(adv > 0, diff <= eps_h, diff >= -eps_l)
    else:
        bkl = q * (old - logp.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        valid = torch.where(adv > 0, (bkl <= eps_h) | (p <= q), (bkl <= eps_l) | (p >= q))
    loss_mat = -adv * capped * logp * valid.to(logp.dtype)
    loss = aggregate(_weighted(loss_mat, w), m, loss_agg_mode, config)
    return loss, metrics(m, delta, clipfrac=~valid & (adv > 0), clipfrac_lower=~valid & (adv <= 0))


@POLICY_LOSSES.register("dppo_tv")
def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """DPPO, total-variation trust region (verl ``dppo_tv``): with ``p = e^{logp}``, ``q = e^{old}``, a token
    is valid if ``A > 0: p − q ≤ ε_h``, else ``p − q ≥ −ε_l`` (ε are TV thresholds, not ratio bounds).
    ``ℓ = −A·sg(min(ρ, c))·logp·valid`` with ``c = clip_ratio_c`` (default 3.0, ActorConfig's; verl's
    function default of 20 only applies without a config). Clip fractions: invalid tokens by sign of A."""
    return _dppo("dppo_tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)


@POLICY_LOSSES.register("dppo_kl")
def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """DPPO, binary-KL trust region (verl ``dppo_kl``): ``bkl = q(old − logp) + (1−q)·log((1−q+1e-8)/(1−p+1e-8))``;
    valid if ``A > 0: bkl ≤ ε_h or p ≤ q``, else ``bkl ≤ ε_l or p ≥ q``. Loss as ``dppo_tv``."""
    return _dppo("dppo_kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)


@POLICY_LOSSES.register("dro")
def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None):
    """DRO-style regularised policy gradient (verl ``dro``; cf. Richemond et al. 2024, arXiv 2405.19107):
    ``ℓ = −(logp·A − ½β(logp − old)²)`` with ``β = dro_beta > 0`` (required)."""
    old, logp, adv, m, w = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, "dro")
    beta = cfg(config, "dro_beta")
    if beta is None or float(beta) <= 0:
        raise ValueError(f"dro: config dro_beta must be set to a value > 0, got {beta!r}")
    delta = logp - old
    loss_mat = -(logp * adv - 0.5 * float(beta) * delta.square())
    loss = aggregate(_weighted(loss_mat, w), m, loss_agg_mode, config)
    return loss, metrics(m, delta)


@dataclass
class DROOptions:
    """``actor.policy_loss.dro_beta``: the weight of DRO's squared log-ratio penalty (required by ``dro``)."""

    SECTION: ClassVar[str] = "actor.policy_loss"
    dro_beta: Optional[float] = option(None, gt=0.0, doc="beta of the penalty 1/2 beta (logp - old)^2")


register_policy_loss_options("dro", DROOptions)
