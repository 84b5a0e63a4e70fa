"""agentrl: token-level Gymnasium environments, a recording OpenAI proxy, and RL trainers for
language-model agents.

`import agentrl` is light (stdlib, numpy, gymnasium) and registers the built-in environment ids,
so `gym.make("agentrl/MathTIR-v0")` works after it (or `gym.make("agentrl:agentrl/MathTIR-v0")`
with no import at all).
"""

from agentrl.completion import Completion, SamplingParams
from agentrl.envs import ChatEnv, ChatTokenEnv, TokenEnv, list_envs, load_plugins, register
from agentrl.rewards import RewardEnv, load_reward_func
from agentrl.trajectory_files import load_jsonl, save_jsonl
from agentrl.types import Image, Trajectory, TrajectoryBuilder, Turn

__version__ = "0.1.0"

# The library's own env; the built-in task envs (environments/catalog.py) and third-party ones
# register through the `agentrl.environments` entry-point group, loaded here.
register(
    "agentrl/SingleTurn-v0",
    "agentrl.rewards.single_turn:SingleTurnEnv",
    summary="Single-turn RL from a dataset file and a reward function (--dataset, --reward_fn).",
    aliases=("single-turn",),
    usage=("gym.make('agentrl/SingleTurn-v0', dataset='data.jsonl', reward_fn='rewards.py:score'), "
           "where data.jsonl has rows like {\"prompt\": \"2+2?\", \"label\": \"4\"} and "
           "rewards.py defines score(prompt, response, label) -> float (CLI: agentrl train "
           "--dataset data.jsonl --reward_fn rewards.py:score)"),
)
load_plugins()

__all__ = [
    "ChatEnv",
    "ChatTokenEnv",
    "Completion",
    "Image",
    "RewardEnv",
    "SamplingParams",
    "TokenEnv",
    "Trajectory",
    "TrajectoryBuilder",
    "Turn",
    "list_envs",
    "load_jsonl",
    "load_reward_func",
    "register",
    "save_jsonl",
]
