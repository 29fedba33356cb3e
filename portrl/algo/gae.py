"""GAE, and its VC-PPO (decoupled λ) and VAPO (length-adaptive λ) variants.

GAE (Schulman et al. 2016, arXiv 1506.02438), verl's masked form, backwards over t from
``nextV = 0, last = 0``::

    δ_t  = r_t + γ·nextV − V_t
    cand = δ_t + γλ·last
    if m_t: nextV ← V_t; last ← cand        (masked positions are skipped: values carried through)
    A_t  = last

``returns = A + V`` (unwhitened) and ``A ← masked_whiten(A, m)`` over all valid tokens of the batch.
Multi-turn rollouts: the tool / environment tokens between the model's turns have ``m = 0``, so they are no time
steps (nextV and the running advantage are carried across them, as in verl): A and returns on the model's tokens
equal GAE on the response with the tool tokens removed (tests/test_agent_mask.py); the critic's values and any
reward on a tool token are not used.
Decisions: both outputs are 0 at masked positions (verl leaves whitened and carried values there);
a batch with fewer than 2 valid tokens cannot be whitened (ValueError). ``lam``/``gamma`` may be a
float or a ``(B,)`` tensor (per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypedDict, Union

import torch

from portrl.algo.groups import check_rewards
from portrl.algo.masked import compute_dtype, masked_whiten
from portrl.algo.options import option
from portrl.algo.spec import estimator

Coef = Union[float, torch.Tensor]


class _Bounds(TypedDict, total=False):
    """The keyword arguments of :func:`portrl.algo.options.option` the options below share."""

    ge: float
    gt: float
    le: float
    doc: str


_LAM_ACTOR: _Bounds = dict(ge=0.0, le=1.0, doc="VC-PPO decoupled GAE: lambda of the policy advantages (null: algorithm.lam)")
_LAM_CRITIC: _Bounds = dict(ge=0.0, le=1.0, doc="VC-PPO decoupled GAE: lambda of the value targets (null: 1.0)")
_VAPO_ALPHA: _Bounds = dict(gt=0.0, doc="VAPO length-adaptive actor lambda 1 - 1/(alpha*len), clamped to [0, 1]")


@dataclass
class GAEOptions:
    """``algorithm.lam_actor`` / ``lam_critic`` / ``vapo_alpha`` of ``gae`` (any set: the decoupled form)."""

    lam_actor: Optional[float] = option(None, **_LAM_ACTOR)
    lam_critic: Optional[float] = option(None, **_LAM_CRITIC)
    vapo_alpha: Optional[float] = option(None, **_VAPO_ALPHA)


@dataclass
class VCPPOOptions:
    """``algorithm.lam_actor`` / ``lam_critic`` of ``vcppo_gae``."""

    lam_actor: Optional[float] = option(None, **_LAM_ACTOR)
    lam_critic: Optional[float] = option(None, **_LAM_CRITIC)


@dataclass
class VAPOOptions:
    """``algorithm.lam_critic`` / ``vapo_alpha`` of ``vapo_gae`` (vapo_alpha null: 0.05)."""

    lam_critic: Optional[float] = option(None, **_LAM_CRITIC)
    vapo_alpha: Optional[float] = option(None, **_VAPO_ALPHA)


def _per_row(x: Coef, batch: int, dt, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dt, device=device)
    if t.dim() == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"gae: {name} must be a float or a ({batch},) tensor, got shape {tuple(t.shape)}")
    return t


@torch.no_grad()
def gae_advantage_return_raw(token_level_rewards, values, response_mask, gamma: Coef, lam: Coef):
    """Unwhitened GAE ``(A, returns)``, both zero at masked positions."""
    m = check_rewards(token_level_rewards, response_mask, "gae")
    if values is None:
        raise ValueError("gae: needs values (B,T) from the critic")
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"gae: values shape {tuple(values.shape)} != rewards shape {tuple(token_level_rewards.shape)}")
    dt = compute_dtype(token_level_rewards, values)
    r, v = token_level_rewards.to(dt), values.to(dt)
    batch, length = r.shape
    g = _per_row(gamma, batch, dt, r.device, "gamma")
    gl = g * _per_row(lam, batch, dt, r.device, "lam")
    next_v = torch.zeros(batch, dtype=dt, device=r.device)
    last = torch.zeros(batch, dtype=dt, device=r.device)
    cols = []
    for t in reversed(range(length)):
        cand = r[:, t] + g * next_v - v[:, t] + gl * last
        next_v = torch.where(m[:, t], v[:, t], next_v)
        last = torch.where(m[:, t], cand, last)
        cols.append(last)
    adv = torch.stack(cols[::-1], dim=1)
    zero = torch.zeros((), dtype=dt, device=r.device)
    returns = torch.where(m, adv + v, zero)
    return torch.where(m, adv, zero), returns


@estimator("gae", options=GAEOptions, needs_critic=True, per_token_rewards=True)
@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma: Coef = 1.0, lam: Coef = 1.0,
                                 lam_actor: Optional[Coef] = None, lam_critic: Optional[Coef] = None,
                                 vapo_alpha: Optional[float] = None):
    """GAE (module docstring). With ``lam_actor``/``lam_critic``/``vapo_alpha`` it is the decoupled form:
    see ``compute_decoupled_gae``. Returns ``(whitened A, returns)``."""
    if lam_actor is not None or lam_critic is not None or vapo_alpha is not None:
        return compute_decoupled_gae(token_level_rewards, values, response_mask, gamma, lam,
                                     lam_actor=lam_actor, lam_critic=lam_critic, vapo_alpha=vapo_alpha)
    adv, returns = gae_advantage_return_raw(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, response_mask), returns


def vapo_length_adaptive_lambda(response_mask: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO (Yue et al. 2025, arXiv 2504.05118) ``λ_i = 1 − 1/(α·l_i)``, ``l_i`` = valid length, clamped to
    [0, 1] (the paper states no clamp; for ``l ≤ 1/α`` it would be ≤ 0). Empty rows get 0."""
    if alpha <= 0:
        raise ValueError(f"vapo_alpha must be > 0, got {alpha}")
    lengths = (response_mask != 0).sum(dim=-1).to(torch.float64)
    lam = torch.where(lengths > 0, 1 - 1 / (alpha * lengths.clamp(min=1)), torch.zeros_like(lengths))
    return lam.clamp(0.0, 1.0)


@torch.no_grad()
def compute_decoupled_gae(token_level_rewards, values, response_mask, gamma: Coef = 1.0, lam: Coef = 1.0,
                          lam_actor: Optional[Coef] = None, lam_critic: Optional[Coef] = None,
                          vapo_alpha: Optional[float] = None):
    """Decoupled GAE (VC-PPO, Yuan et al. 2025, arXiv 2503.01491): value targets from
    ``λ_critic`` (default 1.0: Monte-Carlo returns when γ = 1), advantages from ``λ_actor`` (default
    ``lam``), whitened. With ``vapo_alpha`` the actor λ is VAPO's per-sequence length-adaptive λ
    (``lam_actor`` must then be None). Returns ``(whitened A_actor, returns_critic)``."""
    if vapo_alpha is not None and lam_actor is not None:
        raise ValueError("gae: give either lam_actor or vapo_alpha (VAPO's length-adaptive actor λ), not both")
    critic_lam = 1.0 if lam_critic is None else lam_critic
    actor_lam: Union[torch.Tensor, float]
    if vapo_alpha is not None:
        actor_lam = vapo_length_adaptive_lambda(response_mask, vapo_alpha).to(token_level_rewards.device)
    else:
        actor_lam = lam if lam_actor is None else lam_actor
    _, returns = gae_advantage_return_raw(token_level_rewards, values, response_mask, gamma, critic_lam)
    adv, _ = gae_advantage_return_raw(token_level_rewards, values, response_mask, gamma, actor_lam)
    return masked_whiten(adv, response_mask), returns


@estimator("vcppo_gae", options=VCPPOOptions, needs_critic=True, per_token_rewards=True)
@torch.no_grad()
def compute_vcppo_gae(token_level_rewards, values, response_mask, gamma: Coef = 1.0, lam: Coef = 1.0,
                      lam_actor: Optional[Coef] = None, lam_critic: Optional[Coef] = None):
    """VC-PPO decoupled GAE: ``compute_decoupled_gae`` with critic λ default 1.0, actor λ default ``lam``."""
    return compute_decoupled_gae(token_level_rewards, values, response_mask, gamma, lam,
                                 lam_actor=lam_actor, lam_critic=lam_critic)


@estimator("vapo_gae", options=VAPOOptions, needs_critic=True, per_token_rewards=True)
@torch.no_grad()
def compute_vapo_gae(token_level_rewards, values, response_mask, gamma: Coef = 1.0, lam: Coef = 1.0,
                     lam_critic: Optional[Coef] = None, vapo_alpha: Optional[float] = None):
    """VAPO GAE: actor λ length-adaptive with ``α = vapo_alpha`` (default 0.05), critic λ default 1.0."""
    return compute_decoupled_gae(token_level_rewards, values, response_mask, gamma, lam,
                                 lam_critic=lam_critic, vapo_alpha=0.05 if vapo_alpha is None else vapo_alpha)
