"""Multi-turn: guess a hidden number with higher/lower feedback."""

from __future__ import annotations

import re
from typing import Any

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message

_INT = re.compile(r"-?\d+")


class GuessNumberEnv(ChatEnv):
    """Guess a number in [1, high] with higher/lower hints; reward 1 when found, else 0."""

    def __init__(self, high: int = 16, max_guesses: int = 6) -> None:
        if high < 2 or max_guesses < 1:
            raise ValueError(f"need high >= 2 and max_guesses >= 1, got {high}, {max_guesses}")
        self.high, self.max_guesses = high, max_guesses
        self.secret, self.guesses = 0, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> list[Message]:
        self.secret = int(self.np_random.integers(1, self.high + 1))
        self.guesses = 0
        prompt = (
            f"I picked a whole number between 1 and {self.high}. Guess it: answer with one "
            f"number, and I will say higher or lower."
        )
        return [{"role": "user", "content": prompt}]

    def step(self, assistant_text: str) -> StepResult:
        self.guesses += 1
        found = _INT.search(assistant_text)
        info = {"secret": self.secret, "guesses": self.guesses}
        if found is None:
            feedback = "Please answer with a single whole number."
        elif int(found.group()) == self.secret:
            return [], 1.0, True, False, info
        else:
            feedback = "Higher." if int(found.group()) < self.secret else "Lower."
        truncated = self.guesses >= self.max_guesses
        return [{"role": "user", "content": feedback}], 0.0, False, truncated, info
