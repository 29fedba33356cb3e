"""PF-PPO (Policy Filtration for PPO, Zhang et al. 2024, arXiv 2409.06957; verl ``algorithm.use_pf_ppo``):
after the advantages, the step's batch is resampled, with replacement, by weights of each response's score,
so the update sees more of the responses whose reward is most reliable.

Weights from the score ``s_i = Σ_t token_level_scores`` (the reward before any KL penalty), as verl's
``compute_pf_ppo_reweight_data``:

* ``pow``: ``|s_i|^weight_pow``;
* ``max_min``: 1 for the rows holding the batch's highest or lowest score, else 0;
* ``max_random``: 0.4 for the rows holding the highest score, else 0.1;

then ``w_i + 1e-8`` (so no row has probability exactly 0). ``B`` row indices are drawn from the multinomial of
the weights, with replacement, from a seeded generator (the same seed draws the same rows).

verl resamples only in its GAE branch (other estimators ignore ``use_pf_ppo`` silently); portrl's trainer
resamples after the advantages of any estimator of the policy-gradient objective (the config checks refuse it
with pairs, online DPO).
"""

from __future__ import annotations

import torch

REWEIGHT_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """The (B,) sampling weights of the scores (see the module docstring), float64."""
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    if reweight_method == "pow":
        w = s.abs().pow(float(weight_pow))
    elif reweight_method == "max_min":
        w = ((s == s.max()) | (s == s.min())).to(torch.float64)
    elif reweight_method == "max_random":
        w = torch.where(s == s.max(), 0.4, 0.1).to(torch.float64)
    else:
        raise ValueError(f"pf_ppo reweight_method {reweight_method!r} is unknown; valid: {list(REWEIGHT_METHODS)}")
    return (w + 1e-8).clamp(min=1e-8)


def pf_ppo_resample_indices(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0,
                            seed: int = 0) -> torch.Tensor:
    """``B`` row indices (long) drawn with replacement with probabilities proportional to :func:`pf_ppo_weights`."""
    w = pf_ppo_weights(scores, reweight_method, weight_pow)
    if w.numel() == 0:
        raise ValueError("pf_ppo: the batch is empty")
    gen = torch.Generator().manual_seed(int(seed))
    return torch.multinomial(w, w.numel(), replacement=True, generator=gen)
