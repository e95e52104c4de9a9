"""The RL pipeline, one concept a module: config (TRL names) -> rewards -> advantages -> log-probs (chunked)
-> losses -> update (micro-batches) and optim (master weights) -> the LightningModules (grpo, ppo)."""
from .advantages import gae, group_advantages, masked_whiten
from .config import GRPOConfig, PPOConfig, RLConfig
from .grpo import GRPOModule
from .losses import Totals, grpo_loss, ppo_loss
from .optim import MasterWeightOptimizer
from .ppo import PPOModule
from .reward_model import RewardModel
from .rewards import ExactMatch, FormatRegex, LengthPenalty, WeightedReward

__all__ = ["ExactMatch", "FormatRegex", "GRPOConfig", "GRPOModule", "LengthPenalty", "MasterWeightOptimizer",
           "PPOConfig", "PPOModule", "RLConfig", "RewardModel", "Totals", "WeightedReward", "gae", "group_advantages", "grpo_loss",
           "masked_whiten", "ppo_loss"]
