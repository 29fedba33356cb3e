"""Rule rewards chosen by data_source, custom reward functions, and the batch RewardManager."""

from portrl.rewards.custom import RewardFunctionError, load_custom_reward
from portrl.rewards.manager import RewardManager, RewardResult, per_source_metrics, place_on_last_token
from portrl.rewards.registry import compute_score, reward_kind

__all__ = [
    "RewardFunctionError", "RewardManager", "RewardResult", "compute_score", "load_custom_reward",
    "per_source_metrics", "place_on_last_token", "reward_kind",
]
