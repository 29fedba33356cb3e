"""TRL ``GRPOTrainer`` loss-type names as aliases of verl's aggregation modes.

The per-token objective of TRL's ``grpo``/``bnpo``/``dr_grpo``/``dapo`` is the PPO clip without
dual clip (portrl ``vanilla`` with ``clip_ratio_c`` large); they differ only in how tokens are
averaged, which is what these aliases map (single process, one gradient-accumulation step):

* ``grpo``    -> ``seq-mean-token-mean`` (mean over sequences of each sequence's token mean).
  TRL counts fully masked rows in the sequence mean; portrl does that when ``global_batch_size``
  (all rows) is passed, and excludes them with local counts.
* ``bnpo``    -> ``token-mean`` (local tokens).
* ``dapo``    -> ``token-mean`` (TRL's default; global token count = ``batch_num_tokens``).
* ``dr_grpo`` -> ``seq-mean-token-sum-norm`` with ``loss_scale_factor = max_completion_length``
  (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).

TRL's ``cispo`` (upper cap only), ``vespo`` and ``luspo`` are different objectives and are not aliases.
"""

from __future__ import annotations

import portrl.algo.aggregation  # noqa: F401  (registers the aliases' targets)
from portrl.algo.registry import LOSS_AGG_MODES

TRL_LOSS_TYPE_TO_AGG_MODE = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def register_trl_aliases() -> None:
    """Register TRL names as aliases in the ``loss_agg_mode`` registry (idempotent)."""
    for alias, target in TRL_LOSS_TYPE_TO_AGG_MODE.items():
        LOSS_AGG_MODES.alias(alias, target)


def trl_loss_type_to_agg_mode(loss_type: str) -> str:
    """The verl aggregation mode equal to TRL's ``loss_type``; other names raise listing the valid ones."""
    try:
        return TRL_LOSS_TYPE_TO_AGG_MODE[loss_type]
    except KeyError:
        raise ValueError(f"TRL loss_type {loss_type!r} has no aggregation-mode equivalent; "
                         f"valid: {', '.join(sorted(TRL_LOSS_TYPE_TO_AGG_MODE))}") from None
