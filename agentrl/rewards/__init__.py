"""Rewards: reward functions and the specs that name them, batched scoring, reward services
and reward models, and single-turn RL as an environment (`RewardEnv`)."""

from agentrl.rewards.batched import BatchedReward, RewardServiceError
from agentrl.rewards.functions import (
    REWARD_MODEL_PREFIX,
    RewardFn,
    RewardFunctionError,
    call_reward_fn,
    load_reward_func,
    reward_fn_from_spec,
)
from agentrl.rewards.remote import RemoteReward
from agentrl.rewards.single_turn import RewardEnv, SingleTurnEnv

__all__ = [
    "REWARD_MODEL_PREFIX",
    "BatchedReward",
    "RemoteReward",
    "RewardEnv",
    "RewardFn",
    "RewardFunctionError",
    "RewardServiceError",
    "SingleTurnEnv",
    "call_reward_fn",
    "load_reward_func",
    "reward_fn_from_spec",
]
