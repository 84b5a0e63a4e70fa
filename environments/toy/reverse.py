"""Single-turn: reverse a word. Reward is the fraction of positions right (partial credit)."""

from __future__ import annotations

from typing import Any

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message

WORDS = [
    "cat",
    "dog",
    "sun",
    "map",
    "pen",
    "cup",
    "hat",
    "box",
    "red",
    "top",
    "bus",
    "egg",
    "fox",
    "ice",
    "jam",
    "key",
    "leg",
    "net",
    "owl",
    "pig",
    "rat",
    "sky",
    "toy",
    "van",
    "web",
    "yes",
    "zoo",
    "ant",
    "bee",
    "cow",
]


class ReverseEnv(ChatEnv):
    """Reverse a short word; reward = fraction of characters in the right place."""

    def __init__(self, words: tuple[str, ...] = tuple(WORDS)) -> None:
        if not words:
            raise ValueError("ReverseEnv needs at least one word")
        self.words = tuple(words)
        self.word = ""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self.word = str(self.np_random.choice(self.words))
        prompt = (
            f"Reverse the letters of the word '{self.word}'. Answer with the reversed word only."
        )
        return [{"role": "user", "content": prompt}], {"word": self.word}

    def step(self, assistant_text: str) -> StepResult:
        target = self.word[::-1]
        answer = assistant_text.strip().strip(".'\"").lower()
        hits = sum(a == b for a, b in zip(answer, target, strict=False))
        reward = hits / max(len(target), len(answer), 1)
        return [], reward, True, False, {"target": target, "exact": answer == target}
