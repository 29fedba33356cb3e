"""``get_policy_loss(name)``: the registered policy loss (vanilla, gspo, sapo, gpg, cispo, dppo_tv, dppo_kl,
dro in ``policy_losses``; clip_cov, kl_cov, geo_mean in ``policy_losses_cov``; bypass_mode in
``policy_losses_bypass``)."""

from __future__ import annotations

from typing import Callable

import portrl.algo.policy_losses  # noqa: F401  (registers)
import portrl.algo.policy_losses_bypass  # noqa: F401
import portrl.algo.policy_losses_cov  # noqa: F401
from portrl.algo.registry import POLICY_LOSSES


def get_policy_loss(name: str) -> Callable:
    """``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)
    -> (loss, metrics)``; unknown names raise, listing the registered ones."""
    return POLICY_LOSSES.get(name)
