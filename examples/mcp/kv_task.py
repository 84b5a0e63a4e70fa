"""Train on an MCP server's tools: a task whose tools are those of kv_server.py (beside this file).

    python examples/mcp/kv_task.py    # one episode with the tiny tokenizer, the policy scripted

The task asks the policy to store a value under a key with the server's `put` tool and then
say "done"; its reward reads the server (`get`): 1.0 if the value is there. The prompt, the
tool schemas and every call's answer come from the server; the task only says what to do and
how it is scored. `make_env` is what `agentrl.register` takes (README: "Train on any MCP
server's tools").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

import agentrl
from agentrl.envs.mcp_tools import CallTool, MCPToolEnv

SERVER = {"command": [sys.executable, str(Path(__file__).with_name("kv_server.py"))]}


class StoreTask(agentrl.ChatEnv):
    """Store a value under a key with the `put` tool, then say done (reward 1 if stored)."""

    def __init__(self, call_tool: CallTool) -> None:
        self.call_tool = call_tool  # the env's server, to score the episode by its state

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> list:
        self.key = str(self.np_random.choice(["apple", "river", "stone"]))
        self.value = str(int(self.np_random.integers(10, 100)))
        return [{"role": "user", "content": f"Store {self.value} under the key {self.key!r} "
                                            f"with the put tool, then say done."}]

    def step(self, assistant_text: str) -> tuple[list, float, bool, bool, dict]:
        stored = self.call_tool("get", {"key": self.key})  # turns without a tool call end here
        reward = float(not stored.is_error and stored.text == self.value)
        return [], reward, True, False, {"stored": stored.text}


def make_env(call_timeout_s: float = 30.0) -> MCPToolEnv:
    """The env: StoreTask with kv_server.py's tools, each call given `call_timeout_s`."""
    return MCPToolEnv(StoreTask, SERVER, call_timeout_s=call_timeout_s)


agentrl.register("examples/KeyValue-v0", make_env, aliases=("kv-store",))


def main() -> None:
    env = gym.make("examples/KeyValue-v0", tokenizer="tiny")
    tok = env.unwrapped.tokenizer
    obs, _ = env.reset(seed=0)
    print(tok.decode(obs["tokens"]))  # the prompt: the server's tools in the system message
    task = env.unwrapped.chat_env.task
    call = {"name": "put", "arguments": {"key": task.key, "value": task.value}}
    for text in (f"<tool_call>{json.dumps(call)}</tool_call>", "done"):  # what a policy samples
        action = np.array(tok.encode(text) + [tok.eos_token_id])
        obs, reward, terminated, _, _ = env.step(action)
        print(f"{text!r} -> {tok.decode(obs['tokens'])!r} reward={reward} "
              f"terminated={terminated}")
    env.close()  # stops the server process


if __name__ == "__main__":
    main()
