"""Multi-turn: guess a hidden number with higher/lower feedback.

The env names its state for GiGPO (`info["state_key"]`, `agentrl.anchors`): the range of numbers
the hints so far leave open, `"lo-hi"`. Episodes that reach the same range by different guesses
are in the same state, which the observation ("Higher.") does not show.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message

_INT = re.compile(r"-?\d+")


class GuessNumberEnv(ChatEnv):
    """Guess a number in [1, high] with higher/lower hints; reward 1 when found, else 0.

    `progress_reward` > 0 adds a per-step reward: `progress_reward` x the fraction of [1, high]
    a guess rules out (0 for a guess outside the open range or no number), so an episode's
    steps are scored one by one (the default 0 keeps the final reward only).
    """

    def __init__(self, high: int = 16, max_guesses: int = 6,
                 progress_reward: float = 0.0) -> None:
        if high < 2 or max_guesses < 1 or progress_reward < 0:
            raise ValueError(f"need high >= 2, max_guesses >= 1 and progress_reward >= 0, got "
                             f"{high}, {max_guesses}, {progress_reward}")
        self.high, self.max_guesses, self.progress_reward = high, max_guesses, progress_reward
        self.secret, self.guesses = 0, 0
        self.lo, self.hi = 1, high

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self.secret = int(self.np_random.integers(1, self.high + 1))
        self.guesses = 0
        self.lo, self.hi = 1, self.high
        prompt = (
            f"I picked a whole number between 1 and {self.high}. Guess it: answer with one "
            f"number, and I will say higher or lower."
        )
        return [{"role": "user", "content": prompt}], {"state_key": self._state()}

    def _state(self) -> str:
        return f"{self.lo}-{self.hi}"

    def step(self, assistant_text: str) -> StepResult:
        self.guesses += 1
        found = _INT.search(assistant_text)
        open_before = self.hi - self.lo + 1
        if found is None:
            feedback = "Please answer with a single whole number."
        elif int(found.group()) == self.secret:
            self.lo = self.hi = self.secret
            info = {"secret": self.secret, "guesses": self.guesses, "state_key": self._state()}
            return [], 1.0, True, False, info
        elif int(found.group()) < self.secret:
            feedback, self.lo = "Higher.", max(self.lo, int(found.group()) + 1)
        else:
            feedback, self.hi = "Lower.", min(self.hi, int(found.group()) - 1)
        reward = self.progress_reward * (open_before - (self.hi - self.lo + 1)) / self.high
        info = {"secret": self.secret, "guesses": self.guesses, "state_key": self._state()}
        truncated = self.guesses >= self.max_guesses
        return [{"role": "user", "content": feedback}], reward, False, truncated, info
