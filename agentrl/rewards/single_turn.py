"""Single-turn RL as an environment: `RewardEnv` shows a prompt, scores one response, ends.

    env = RewardEnv(dataset=[{"prompt": "2+2?", "label": "4"}],
                    reward_fn=lambda prompt, response, label: float(label in response))

OpenRLHF-style reward files (`reward_func(queries, prompts, labels)`) load with
`load_reward_func(path)`. `SingleTurnEnv` ("agentrl/SingleTurn-v0", `agentrl train --dataset
data.jsonl --reward_fn rewards.py:score`) is the same env built from a file and a spec string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.data import read_rows
from agentrl.envs.chat import ChatEnv, StepResult
from agentrl.envs.template import Message
from agentrl.rewards.functions import RewardFn, call_reward_fn, reward_fn_from_spec


class RewardEnv(ChatEnv):
    """One-step environment over a prompt dataset and a reward function.

    Args:
        dataset: rows (mappings) or a .jsonl path; each row has `prompt_key` (a string, or a
            list of chat messages) and optionally `label_key`.
        reward_fn: `reward_fn(prompt, response, label) -> float | {"reward": float, ...}`;
            extra dict keys go to `info`.
        system_prompt: prepended as a system message when the prompt is a string.
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]] | str | Path,
        reward_fn: RewardFn,
        *,
        prompt_key: str = "prompt",
        label_key: str = "label",
        system_prompt: str | None = None,
    ) -> None:
        self.rows = (read_rows(dataset, what="dataset").rows
                     if isinstance(dataset, str | Path) else list(dataset))
        if not self.rows:
            raise ValueError("RewardEnv needs a non-empty dataset")
        for i, row in enumerate(self.rows):
            if prompt_key not in row:
                raise ValueError(
                    f"dataset row {i} has no {prompt_key!r} key (keys: {sorted(row)}); pass "
                    f"prompt_key= to name the prompt column"
                )
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        self.reward_fn = reward_fn
        self.prompt_key, self.label_key = prompt_key, label_key
        self.system_prompt = system_prompt
        self.index = -1

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        options = options or {}
        self.index = int(options.get("index", self.np_random.integers(len(self.rows))))
        prompt = self.rows[self.index][self.prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        else:
            messages = [dict(m) for m in prompt]
        return messages, {"index": self.index}

    def step(self, assistant_text: str) -> StepResult:
        row = self.rows[self.index]
        reward, extra = call_reward_fn(
            self.reward_fn,
            row[self.prompt_key],
            assistant_text,
            row.get(self.label_key),
            sample=self.index,
        )
        return [], reward, True, False, {**extra, "index": self.index}


class SingleTurnEnv(RewardEnv):
    """`RewardEnv` from a dataset file and a reward spec (what `agentrl train --dataset ...
    --reward_fn ...` builds); it pickles by the spec, as user functions may not."""

    def __init__(self, dataset: str, reward_fn: str, *, prompt_key: str = "prompt",
                 label_key: str = "label", system_prompt: str | None = None,
                 reward_options: dict[str, Any] | None = None) -> None:
        """`reward_options`: for a reward service URL, `RemoteReward`'s keyword arguments."""
        self.reward_spec, self.reward_options = reward_fn, dict(reward_options or {})
        super().__init__(dataset, reward_fn_from_spec(reward_fn, **self.reward_options),
                         prompt_key=prompt_key, label_key=label_key,
                         system_prompt=system_prompt)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "reward_fn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reward_fn = reward_fn_from_spec(self.reward_spec, **self.reward_options)
