"""KL estimators, KL controllers, KL in the reward and the KL loss term.

Estimators of ``KL(π‖π_ref)`` from the sampled token's log-probs (Schulman, "Approximating KL
divergence", 2020), with ``d = logp − ref``:

* ``kl`` / ``k1``: ``d``
* ``abs``: ``|d|``
* ``mse`` / ``k2``: ``½ d²``
* ``low_var_kl`` / ``k3``: ``x = clamp(−d, −20, 20)``, ``clamp(eˣ − x − 1, −10, 10)``
* ``<name>+``: straight-through — value of ``<name>``, gradient of k2 (``∇ = d``), computed as
  ``k2 − sg(k2) + sg(value)``. ``k2+``/``mse+`` equal ``k2``. (These raised in older verl; here they work.)

Computed in float32 (float64 for float64 input). Positions are not masked here: callers mask.
"""

from __future__ import annotations


import torch

from portrl.algo.aggregation import agg_loss
from portrl.algo.masked import as_bool_mask, compute_dtype
from portrl.algo.registry import KL_PENALTIES


def _d(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if logp.shape != ref.shape:
        raise ValueError(f"kl_penalty: logprob shape {tuple(logp.shape)} != ref_logprob shape {tuple(ref.shape)}")
    dt = compute_dtype(logp, ref)
    return logp.to(dt) - ref.to(dt)


@KL_PENALTIES.register("kl")
def kl_k1(logp, ref):
    """k1 = logp − ref (unbiased, high variance, can be negative)."""
    return _d(logp, ref)


@KL_PENALTIES.register("abs")
def kl_abs(logp, ref):
    """|logp − ref|."""
    return _d(logp, ref).abs()


@KL_PENALTIES.register("mse")
def kl_k2(logp, ref):
    """k2 = ½ (logp − ref)²."""
    return 0.5 * _d(logp, ref).square()


@KL_PENALTIES.register("low_var_kl")
def kl_k3(logp, ref):
    """k3 = e^x − x − 1 with x = ref − logp (clamped to [−20, 20]); result clamped to ≤ 10.

    Computed as ``expm1(x) − x``: the same value, without the cancellation that ``exp(x) − 1`` suffers
    for the small x typical of a policy close to its reference (float32 lost ~1e-7 absolute there).
    """
    x = (-_d(logp, ref)).clamp(-20.0, 20.0)
    return (torch.expm1(x) - x).clamp(-10.0, 10.0)


def _straight_through(base):
    def fn(logp, ref):
        k2 = kl_k2(logp, ref)
        return k2 - k2.detach() + base(logp, ref).detach()

    fn.__doc__ = f"Straight-through: value of {base.__name__}, gradient of k2 (d = logp − ref)."
    fn.__name__ = f"{base.__name__}_plus"
    return fn


kl_k1_plus = KL_PENALTIES.register("kl+", _straight_through(kl_k1))
kl_abs_plus = KL_PENALTIES.register("abs+", _straight_through(kl_abs))
kl_k3_plus = KL_PENALTIES.register("low_var_kl+", _straight_through(kl_k3))

for _alias, _target in {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "k1+": "kl+", "k3+": "low_var_kl+",
                        "k2+": "mse", "mse+": "mse"}.items():
    KL_PENALTIES.alias(_alias, _target)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """Per-token KL estimate ``(B,T)`` by ``name`` (see module docstring). Unknown names raise, listing all."""
    return KL_PENALTIES.get(name)(logprob, ref_logprob)


class FixedKLController:
    """Constant coefficient β; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, arXiv 1909.08593):
    ``e = clip(current_kl/target − 1, −0.2, 0.2)``; ``β ← β·(1 + e·n_steps/horizon)``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def get_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """``fixed`` -> FixedKLController, ``adaptive`` -> AdaptiveKLController; other types raise."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl type {type!r}; valid: adaptive, fixed")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl,
    kl_penalty_name: str = "kl",
):
    """KL in the reward (Ouyang et al. 2022 / Ziegler et al. 2019): ``r = scores − β·kl_penalty(old, ref)·m``.

    ``β = kl_ctrl.value`` before the update. ``current_kl`` is the mean over rows with at least one valid
    token of each row's masked-mean KL (verl also averages in fully masked rows as 0; here they are
    skipped so padding rows do not shrink the KL). Then ``kl_ctrl.update(current_kl, n_steps=B)``.
    Returns ``(token_level_rewards, metrics)`` with ``actor/reward_kl_penalty`` and ``..._coeff``.
    """
    m = as_bool_mask(response_mask, token_level_scores)
    kld = torch.where(m, kl_penalty(old_log_probs, ref_log_probs, kl_penalty_name), 0.0)
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld.to(token_level_scores.dtype)
    n = m.sum(dim=-1)
    valid = n > 0
    if not bool(valid.any()):
        raise ValueError("apply_kl_penalty: response_mask is all zero (all-masked batch)")
    row_kl = kld.sum(dim=-1) / n.clamp(min=1)
    current_kl = float(row_kl[valid].mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    kl_loss_type: str = "low_var_kl",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """KL as a loss term (GRPO, Shao et al. 2024): ``agg_loss(kl_penalty(logp, ref, type), m, mode)``.
    The caller multiplies by ``kl_loss_coef`` and adds it to the policy loss."""
    kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kl, response_mask, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                    global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
