"""Episodes played by an environment's own scripted policy, as trajectories to imitate.

    trajs = play_scripted(lambda: gym.make("agentrl/MiniWoB-v0", tokenizer=tok,
                                           task="warm-up"), seeds=range(40), max_turns=4)

A chat env may offer a scripted policy: `oracle_action()`, the answer to its current
observation in the env's own action language (`agentrl.envs.ChatEnv`). Each episode is reset
with its seed and played to its end with that answer, written as the policy would write it
(`ChatTemplateBridge.action_ids`: the text's tokens and the end-of-turn token). The
trajectories hold the observations as the policy would see them, images placed as in a
rollout, and the actions with no log-probs: data for a supervised warm-up
(`--warmup.episodes`), not for an RL update.

Episodes run one after another in this thread: a scripted answer costs nothing, and the env's
steps are what take the time (40 MiniWoB++ episodes: ~9 s). An episode the env discards (a
browser that failed: `info["discard"]`) is left out and counted; one that runs past
`max_turns` ends truncated and is kept (it shows the policy what to do on each of its turns).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.rollout.collector import placed_images
from agentrl.types import Trajectory, TrajectoryBuilder

if TYPE_CHECKING:
    import gymnasium as gym

    from agentrl.envs.chat import ChatTokenEnv

logger = logging.getLogger(__name__)


class NoScriptedPolicyError(TypeError):
    """The env has no scripted policy to play."""


@dataclass
class Scripted:
    """What `play_scripted` played: the kept trajectories, and how many episodes it left out
    (with the first reason)."""

    trajectories: list[Trajectory]
    discarded: int = 0
    first_error: str = ""


def scripted_bridge(env: gym.Env) -> ChatTokenEnv:
    """The token bridge under `env`'s wrappers, if its chat env has a scripted policy; else
    `NoScriptedPolicyError` naming the env."""
    from agentrl.envs.chat import ChatEnv, ChatTokenEnv

    bridge = env.unwrapped
    if not isinstance(bridge, ChatTokenEnv):
        raise NoScriptedPolicyError(
            f"{type(bridge).__name__} is not a chat env (agentrl.envs.ChatEnv served by "
            f"ChatTokenEnv): only chat envs can offer a scripted policy (oracle_action)")
    chat = bridge.chat_env
    if type(chat).oracle_action is ChatEnv.oracle_action:
        raise NoScriptedPolicyError(
            f"{type(chat).__name__} has no scripted policy: it does not implement "
            f"oracle_action(); a warm-up needs one (or drop --warmup.episodes)")
    return bridge


def play_scripted(
    env_fn: Callable[[], gym.Env], seeds: Iterable[int], *, max_turns: int | None = None,
    options: Callable[[int], dict[str, Any] | None] = lambda i: None,
) -> Scripted:
    """Play one episode per seed with the env's scripted policy (module docstring).
    `options(i)`: the i-th episode's reset options."""
    env = env_fn()
    try:
        bridge = scripted_bridge(env)
        out = Scripted([])
        for i, seed in enumerate(seeds):
            traj = _episode(env, bridge, seed, options(i), max_turns)
            if traj.discard:
                out.discarded += 1
                out.first_error = out.first_error or str(traj.info.get("error", ""))
                continue
            out.trajectories.append(traj)
    finally:
        env.close()
    if out.discarded:
        logger.warning("scripted episodes: %d of %d discarded by the env (first: %s)",
                       out.discarded, out.discarded + len(out.trajectories), out.first_error)
    return out


def _episode(env: gym.Env, bridge: ChatTokenEnv, seed: int, options: dict[str, Any] | None,
             max_turns: int | None) -> Trajectory:
    from agentrl.models.vision import vision_processor

    builder = TrajectoryBuilder()
    obs, info = env.reset(seed=seed, options=options)
    turn = 0
    terminated = truncated = False
    while True:
        tokens, _, placed = placed_images(obs, len(builder.token_ids),
                                          lambda: vision_processor(bridge.tokenizer))
        builder.add_observation(tokens, placed)
        action = bridge.bridge.action_ids(bridge.chat_env.oracle_action())
        turn_record = builder.add_action(action, None)
        obs, reward, terminated, truncated, info = env.step(action)
        turn_record.reward = float(reward)
        turn += 1
        if terminated or truncated:
            break
        if max_turns is not None and turn >= max_turns:
            truncated = True
            info = {**info, "truncated_by": "max_turns"}
            break
    return builder.build(terminated=terminated, truncated=truncated, info=dict(info),
                         discard=bool(info.get("discard", False)))
