"""RL algorithms as LightningModules, rewards, tasks and policy construction."""
from .grpo import GRPOConfig, GRPOModule, group_advantages, grpo_loss
from .ppo import PPOConfig, PPOModule, gae, ppo_loss
from .rewards import ExactMatch, FormatRegex, LengthPenalty, WeightedReward

__all__ = ["ExactMatch", "FormatRegex", "GRPOConfig", "GRPOModule", "LengthPenalty", "PPOConfig", "PPOModule",
           "WeightedReward", "gae", "group_advantages", "grpo_loss", "ppo_loss"]
