"""verl's bypass mode of rollout correction: the rollout engine's log-probs stand in for the old policy.

With ``algorithm.rollout_correction.bypass_mode`` the trainer skips the old-log-prob forward and sets
``old_log_probs = rollout_log_probs`` (two policies instead of three), and the actor's loss is ``bypass_mode``,
which dispatches on ``rollout_correction.loss_type``:

* ``ppo_clip`` (default): the ``vanilla`` PPO clip loss with ``old = rollout``; its ratio ``π/π_rollout`` already
  is the importance ratio, so no IS weights are applied (they would count it twice);
* ``reinforce``: :func:`compute_policy_loss_reinforce` with the truncated IS weights
  ``w = min(π_θ/π_rollout, threshold)`` (detached; token or sequence level, ``rollout_is``; none when
  ``rollout_is`` is null: plain REINFORCE).

``compute_policy_loss_reinforce`` is verl's function of that name; verl registers no loss mode for it on its own
(it is reached through bypass mode), and neither does portrl. Rejection sampling (``rollout_rs``, the veto) is
decoupled mode's in portrl (``portrl.algo.rollout_correction``); a config with it and bypass mode is refused.
"""

from __future__ import annotations

from typing import Any, Dict

from portrl.algo.policy_common import aggregate, cfg, metrics, prepare
from portrl.algo.policy_losses import compute_policy_loss_vanilla
from portrl.algo.registry import POLICY_LOSSES
from portrl.algo.rollout_correction import LEVELS, rollout_is_weights as truncated_is_weights

LOSS_TYPES = ("ppo_clip", "reinforce")


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode="seq-mean-token-sum", config=None, rollout_is_weights=None):
    """REINFORCE with optional IS correction (verl ``compute_policy_loss_reinforce``): ``ℓ = −A·logp`` or, with
    weights, ``ℓ = −A·logp·w`` (``w`` detached); no ratio, no clipping. ``rollout_log_prob`` only feeds the metric
    ``ppo_kl = mean(rollout − logp)``. Default aggregation ``seq-mean-token-sum`` as verl's."""
    rollout, logp, adv, m, w = prepare(rollout_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
                                       "reinforce")
    loss_mat = -adv * logp if w is None else -adv * logp * w
    loss = aggregate(loss_mat, m, loss_agg_mode, config)
    return loss, metrics(m, logp - rollout)


def bypass_settings(config) -> Dict[str, Any]:
    """``rollout_correction`` of the loss config (a mapping with ``loss_type``, ``rollout_is``,
    ``rollout_is_threshold``), checked; a missing one is a ValueError."""
    rc = cfg(config, "rollout_correction", None)
    if rc is None:
        raise ValueError("bypass_mode: the loss config has no rollout_correction; set "
                         "algorithm.rollout_correction.bypass_mode=true to use loss_mode bypass_mode")
    loss_type = rc.get("loss_type", "ppo_clip")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"bypass_mode: rollout_correction.loss_type {loss_type!r} is unknown; valid: {list(LOSS_TYPES)}")
    level = rc.get("rollout_is", None)
    if level is not None and level not in LEVELS:
        raise ValueError(f"bypass_mode: rollout_correction.rollout_is {level!r} is unknown; valid: null, {list(LEVELS)}")
    return {"loss_type": loss_type, "rollout_is": level, "rollout_is_threshold": float(rc.get("rollout_is_threshold", 2.0))}


@POLICY_LOSSES.register("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, rollout_is_weights=None):
    """verl ``bypass_mode``: ``old_log_prob`` is the rollout engine's log-prob; see the module docstring. The IS
    weights are computed here from the current policy (``rollout_is_weights`` given by the caller are ignored, as in
    verl); with them the metric ``rollout_corr/is_weight_mean`` (mean weight over valid tokens)."""
    settings = bypass_settings(config)
    weights = None
    if settings["rollout_is"] is not None:
        weights = truncated_is_weights(log_prob.detach(), old_log_prob, response_mask, settings["rollout_is"],
                                       settings["rollout_is_threshold"])
    if settings["loss_type"] == "ppo_clip":
        loss, out = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                config, rollout_is_weights=None)
    else:
        loss, out = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                  config, rollout_is_weights=weights)
    if weights is not None:
        m = response_mask.bool()
        out = dict(out)
        out["rollout_corr/is_weight_mean"] = (weights[m].sum() / m.sum().clamp(min=1)).detach()
    return loss, out

