"""agentrl: token-level Gymnasium environments, a recording OpenAI proxy, and RL trainers for
language-model agents.

`import agentrl` is light (stdlib, numpy, gymnasium) and registers the built-in environment ids,
so `gym.make("agentrl/MathTIR-v0")` works after it (or `gym.make("agentrl:agentrl/MathTIR-v0")`
with no import at all).
"""

from agentrl.envs import (
    ChatEnv,
    ChatTokenEnv,
    RewardEnv,
    TokenEnv,
    list_envs,
    load_reward_func,
    register,
)
from agentrl.types import (
    Completion,
    Image,
    SamplingParams,
    Trajectory,
    TrajectoryBuilder,
    Turn,
    load_jsonl,
    save_jsonl,
)

__version__ = "0.1.0"

# Built-ins are registered by "module:attr" strings: their modules import only when made.
register(
    "agentrl/Reverse-v0",
    "environments.toy.reverse:ReverseEnv",
    summary="Single-turn: reverse a short word (partial credit per letter).",
    aliases=("reverse",),
)
register(
    "agentrl/GuessNumber-v0",
    "environments.toy.guess:GuessNumberEnv",
    summary="Multi-turn: guess a number in [1, 16] from higher/lower hints (reward 1 if found).",
    aliases=("guess-number",),
)
register(
    "agentrl/Digits-v0",
    "environments.toy.digits:DigitsEnv",
    summary="Answer in digits only; reward = digit fraction per turn (tiny-model learning task).",
    aliases=("digits",),
)
register(
    "agentrl/MathTIR-v0",
    "environments.math_tir.env:MathTIREnv",
    summary="Multi-turn tool-integrated math: write Python, see its output, answer in \\boxed{}.",
    aliases=("math-tir",),
)
register(
    "agentrl/Math-v0",
    "environments.math_tir.env:MathEnv",
    summary="Single-turn math: answer in \\boxed{}, graded with math-verify.",
    aliases=("math",),
)
register(
    "agentrl/SingleTurn-v0",
    "agentrl.envs.reward:SingleTurnEnv",
    summary="Single-turn RL from a dataset file and a reward function (--dataset, --reward_fn).",
    aliases=("single-turn",),
)
register(
    "agentrl/ScreenClick-v0",
    "environments.screenshot.click:ScreenClickEnv",
    summary="Screenshots (VLM): click the red square on 3 screens; image-blind ceiling 1/16.",
    aliases=("screen-click",),
)
register(
    "agentrl/ScreenForm-v0",
    "environments.screenshot.form:ScreenFormEnv",
    summary="Screenshots (VLM): read a drawn form's instructions, click fields, type, submit.",
    aliases=("screen-form",),
)

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
