"""A task a tiny random model can learn in a few dozen RL steps: answer in digits only.

Reward per turn = fraction of the answer's characters that are digits. With `turns > 1` the
user asks again after each answer (per-step rewards, for multi-turn learning tests). Its
scripted policy (`oracle_action`) counts on in digits, for warm-up tests.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message


class DigitsEnv(ChatEnv):
    """Answer using digits only; reward = fraction of digit characters (per turn)."""

    def __init__(self, turns: int = 1) -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.turns, self.turn, self.start = turns, 0, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> list[Message]:
        self.turn = 0
        self.start = n = int(self.np_random.integers(1, 100))
        return [{"role": "user", "content": f"Count from {n}. Use digits only."}]

    def oracle_action(self) -> str:
        """The scripted answer (digits only: reward 1): the next three numbers of the count."""
        n = self.start + 3 * self.turn
        return "".join(str(k) for k in range(n, n + 3))

    def step(self, assistant_text: str) -> StepResult:
        self.turn += 1
        text = assistant_text.strip()
        reward = sum(c.isdigit() for c in text) / len(text) if text else 0.0
        done = self.turn >= self.turns
        new = [] if done else [{"role": "user", "content": "More digits."}]
        return new, reward, done, False, {}
