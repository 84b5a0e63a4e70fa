"""What several benchmarks share: their chat prompts, and a timer of TRL trainers' steps."""

from __future__ import annotations

from typing import Any

QUESTIONS = [
    "What is 2+3?",
    "What is 7*6?",
    "Name a primary color.",
    "What is the capital of France?",
    "What is 10-4?",
    "Spell the word cat backwards.",
    "What is 9+10?",
    "How many legs does a dog have?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "Give me three tips for sleeping well.",
    "What is the boiling point of water?",
    "Tell me a short story about a robot.",
    "Why is the sky blue?",
    "List four fruits.",
    "What does a CPU do?",
]


def trl_step_timer(times: list[float]) -> Any:
    """A transformers TrainerCallback appending each optimizer step's seconds to `times`."""
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - self.t)

    return StepTimer()
