"""Helpers for the math env tests: scripted policy text and a sandbox with scripted results
(by default one that always fails)."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np

from agentrl.sandbox import ExecResult

SANDBOX_ERROR = ExecResult("sandbox_error", None, "", "agentrl.sandbox: cannot start\n", 0.0)
"""What a call looks like when the sandbox's infrastructure fails."""


class ScriptedSession:
    """A session that answers every call with the same result."""

    def __init__(self, result: ExecResult) -> None:
        self.result = result
        self.closed = False

    def run(self, code: str, timeout_s: float | None = None) -> ExecResult:
        return self.result

    def close(self) -> None:
        self.closed = True


class ScriptedSandbox:
    """A sandbox whose sessions answer every call with `result` (default: a sandbox_error)."""

    def __init__(self, result: ExecResult = SANDBOX_ERROR) -> None:
        self.result = result
        self.sessions: list[ScriptedSession] = []

    def session(self) -> ScriptedSession:
        self.sessions.append(ScriptedSession(self.result))
        return self.sessions[-1]


def act(env: gym.Env, text: str):
    """Step the token env with `text` as the policy's tokens, closed by the end-of-turn id."""
    tok = env.unwrapped.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return env.step(np.asarray(ids, dtype=np.int64))


def decode(env: gym.Env, obs: dict) -> str:
    return env.unwrapped.tokenizer.decode(obs["tokens"].tolist(), skip_special_tokens=False)


def code(src: str) -> str:
    return f"Let me compute.\n```python\n{src}\n```"


def tool_call(src: str) -> str:
    body = json.dumps({"name": "python", "arguments": {"code": src}})
    return f"<tool_call>{body}</tool_call>"
