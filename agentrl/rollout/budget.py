"""What one episode may spend, and the one check of it.

The rollout loop (`agentrl.rollout.collect`) is the only place that enforces these budgets,
for every env it drives, bridged chat envs included: an episode that runs out ends
`truncated` with `info["truncated_by"]` set to "max_turns" or "max_episode_tokens", and an
episode whose env call outlives `env_timeout_s` is abandoned and discarded. Envs do not
re-implement them; an env may still end an episode by a rule of its own task (math-tir's
`max_turns`, GuessNumber's `max_guesses`), which is part of what the task means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def check_budget(value: int | None, flag: str) -> None:
    """Raise a ValueError naming `flag` unless `value` is None or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag} must be an integer >= 1 (or unset for no limit), got {value!r}")


def check_deadline(value: float | None, flag: str) -> None:
    """Raise a ValueError naming `flag` unless `value` is None or a finite number of seconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a number of seconds > 0 (or unset for no deadline), "
                         f"got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EpisodeBudget:
    """Per-episode budgets of turns, tokens and time in env code; None means no limit."""

    max_turns: int | None = None
    """Most policy turns; the episode ends truncated after the last one."""
    max_episode_tokens: int | None = None
    """Most tokens in the episode (prompt, actions, observations); an observation that would
    leave no room for another action is not appended."""
    env_timeout_s: float | None = None
    """Longest one env call (building the env, `reset`, `step`, `close`) may take; an episode
    whose call runs past it is abandoned and discarded (see `agentrl.rollout.collector`)."""

    def __post_init__(self) -> None:
        check_budget(self.max_turns, "max_turns")
        check_budget(self.max_episode_tokens, "max_episode_tokens")
        check_deadline(self.env_timeout_s, "env_timeout_s")

    def sample_limit(self, context_len: int, max_new_tokens: int) -> int:
        """Most tokens the next turn may sample after `context_len` tokens: the per-turn
        `max_new_tokens`, within what the episode has left."""
        if self.max_episode_tokens is None:
            return max_new_tokens
        return min(max_new_tokens, self.max_episode_tokens - context_len)

    def exhausted(self, *, turns: int, tokens: int) -> str | None:
        """Why an episode that has taken `turns` policy turns and would hold `tokens` tokens
        cannot take another turn: "max_turns", "max_episode_tokens", or None if it can."""
        if self.max_turns is not None and turns >= self.max_turns:
            return "max_turns"
        if self.max_episode_tokens is not None and tokens >= self.max_episode_tokens:
            return "max_episode_tokens"
        return None
