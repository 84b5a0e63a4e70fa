"""MCPToolEnv (and its MCPConnection) against real MCP servers: a process over stdio and one over
streamable HTTP, both running the server written below (the `mcp` package's MCPServer)."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from gymnasium.utils.env_checker import check_env

from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.envs.mcp_connection import MCPServerSpec, MCPStartError
from agentrl.envs.mcp_tools import MCPToolEnv
from agentrl.envs.tool_calls import find_tool_calls
from agentrl.plugins import load_module_file
from agentrl.rollout import collect_sync

SERVER = '''
import os, sys, time
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("test-kv")
store = {}

@app.tool()
def put(key: str, value: str) -> str:
    """Store value under key."""
    store[key] = value
    return "ok"

@app.tool()
def get(key: str) -> str:
    """The value under key."""
    if key not in store:
        raise ToolError(f"no key {key!r}")
    return store[key]

@app.tool()
def hang(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "woke"

@app.tool()
def die() -> str:
    """Exit the server."""
    print("server: dying on request", file=sys.stderr, flush=True)
    os._exit(3)

@app.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()

if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        app.run("streamable-http", port=int(sys.argv[2]))
    else:
        app.run()
'''


@pytest.fixture(scope="module")
def server_command(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("mcp") / "kv_server.py"
    path.write_text(SERVER)
    return [sys.executable, str(path)]


@pytest.fixture(scope="module")
def http_url(server_command):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*server_command, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no HTTP server"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


class Remember(ChatEnv):
    """Store 'blue' under 'w' with the server's put tool, then say done: reward 1 if stored."""

    def __init__(self, call_tool):
        self.call_tool = call_tool

    def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "Store 'blue' under the key w, then say done."}]

    def step(self, text):
        got = self.call_tool("get", {"key": "w"})
        return [], float(got.text == "blue"), True, False, {"stored": got.text}


def _call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _pid(env: MCPToolEnv) -> int:
    return int(env.call_tool("pid", {}).text)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_tools_render_in_the_template_and_calls_answer_through_the_token_env(
        server_command, tiny_tokenizer):
    env = ChatTokenEnv(MCPToolEnv(Remember, {"command": server_command}, tools_in="template",
                                  new_server_per_episode=True), tiny_tokenizer)
    tok = tiny_tokenizer
    pid = _pid(env.chat_env)
    try:
        obs, _ = env.reset(seed=0)
        prompt = tok.decode(obs["tokens"])
        assert "<tools>" in prompt and '"name": "put"' in prompt
        assert "Store value under key." in prompt and '"required": ["key", "value"]' in prompt

        def act(text):
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            obs, reward, terminated, truncated, info = env.step(np.asarray(ids))
            return tok.decode(obs["tokens"]), reward, terminated, truncated, info

        seen, reward, terminated, _, info = act(_call("put", key="w", value="blue"))
        assert "<tool_response>\nok\n</tool_response>" in seen and not terminated
        seen, *_ = act(_call("get", key="w"))
        assert "<tool_response>\nblue\n</tool_response>" in seen
        seen, _, terminated, truncated, info = act(_call("get", key="nope"))
        assert "Error executing tool get: no key 'nope'" in seen
        assert not (terminated or truncated) and info["num_tool_errors"] == 1
        seen, *_ = act(_call("gett", key="w"))
        assert "unknown tool 'gett'. Did you mean 'get'?" in seen
        seen, *_ = act('<tool_call>{"name": "put", "arguments": {oops</tool_call>')
        assert "not valid JSON" in seen
        seen, reward, terminated, truncated, info = act("done")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["stored"] == "blue" and info["num_tool_calls"] == 3
        assert info["num_tool_errors"] == 3 and info["drift_events"] == 0
        env.reset(seed=1)  # new_server_per_episode: a new process, with an empty store
        assert _gone(pid, within_s=0.5)
        pid = _pid(env.chat_env)
        assert env.chat_env.call_tool("get", {"key": "w"}).is_error
    finally:
        env.close()
    assert _gone(pid, within_s=0.5), "close() returned with the server still running"


def test_streamable_http_server_folds_its_tools_into_the_system_message(http_url,
                                                                        tiny_tokenizer):
    env = MCPToolEnv(Remember, {"url": http_url})
    try:
        assert env.tools is None  # tools_in="system": the template gets no `tools`
        messages, _ = env.reset(seed=0)
        system = messages[0]
        assert system["role"] == "system" and messages[1]["role"] == "user"
        assert '"name": "hang"' in system["content"] and "<tool_call>" in system["content"]
        new, reward, terminated, truncated, _ = env.step(
            "I will store it. " + _call("put", key="w", value="blue"))
        assert new == [{"role": "tool", "name": "put", "content": "ok"}]
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert env.step("done")[1] == 1.0
        with pytest.raises(TypeError, match="holds a live server and cannot be pickled"):
            pickle.dumps(env)
    finally:
        env.close()
    token_env = ChatTokenEnv(MCPToolEnv(Remember, {"url": http_url}), tiny_tokenizer)
    try:
        check_env(token_env, skip_render_check=True)
    finally:
        token_env.close()
    other = MCPToolEnv(Remember, {"url": http_url})  # the server is shared, not ours to stop
    try:
        assert other.call_tool("get", {"key": "w"}).text == "blue"
    finally:
        other.close()


def test_a_hanging_tool_discards_the_episode_in_the_rollout_and_stops_the_server(
        server_command, tiny_tokenizer):
    env = MCPToolEnv(Remember, {"command": server_command}, call_timeout_s=1.0)
    pid = _pid(env)
    engine = FakeEngine(tiny_tokenizer, reply=_call("hang", seconds=60))
    start = time.monotonic()
    [traj] = collect_sync(engine, lambda: ChatTokenEnv(env, tiny_tokenizer), num_prompts=1,
                          sampling=SamplingParams(max_tokens=512), env_timeout_s=30)
    took = time.monotonic() - start
    assert traj.discard and traj.truncated and traj.info["mcp_failure"] == "timeout"
    assert "'hang'" in traj.info["error"] and "did not answer within 1 s" in traj.info["error"]
    assert traj.info["truncated_by"] == "mcp_server"
    assert took < 15, f"the hung call took {took:.1f} s to end its episode"
    assert _gone(pid, within_s=0.5), "the rollout closed the env with the server still running"


def test_a_server_that_dies_mid_episode_discards_it_and_reset_starts_another(server_command):
    env = MCPToolEnv(Remember, {"command": server_command})
    try:
        env.reset(seed=0)
        first = _pid(env)
        new, reward, terminated, truncated, info = env.step(_call("die"))
        assert (new, reward, terminated, truncated) == ([], 0.0, False, True)
        assert info["discard"] and info["mcp_failure"] == "died"
        assert "server: dying on request" in info["error"]  # the stderr tail says why
        assert _gone(first)
        env.reset(seed=1)
        second = _pid(env)
        assert second != first
        new, *_ = env.step(_call("put", key="w", value="blue"))
        assert new[0]["content"] == "ok"
    finally:
        env.close()
    assert _gone(second, within_s=0.5)


def test_a_server_that_cannot_start_names_the_command_and_its_stderr():
    script = "import sys; print('fatal: KV_PATH is not set', file=sys.stderr); sys.exit(2)"
    with pytest.raises(MCPStartError, match=r"(?s)could not start the MCP server `.*-c .*"
                                            r"stderr ends with:\nfatal: KV_PATH is not set"):
        MCPToolEnv(Remember, {"command": [sys.executable, "-c", script]})
    with pytest.raises(MCPStartError, match=r"`no-such-mcp-server --port 1`: FileNotFoundError"):
        MCPToolEnv(Remember, {"command": ["no-such-mcp-server", "--port", "1"]})
    slow = "import sys, time; print('loading weights', file=sys.stderr, flush=True); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(MCPStartError, match=r"(?s)did not finish the MCP handshake within 0.5 s"
                                            r".*loading weights"):
        MCPToolEnv(Remember, {"command": [sys.executable, "-c", slow]}, start_timeout_s=0.5)
    assert time.monotonic() - start < 10  # and the silent process was stopped, not waited for
    with pytest.raises(MCPStartError, match=r"`http://127.0.0.1:9/mcp`: .*Connect"):
        MCPToolEnv(Remember, {"url": "http://127.0.0.1:9/mcp"})


def test_bad_server_configs_and_options_say_what_to_write():
    with pytest.raises(ValueError, match="unknown MCP server key 'comand'. Did you mean 'command'"):
        MCPServerSpec.from_config({"comand": ["x"]})
    with pytest.raises(ValueError, match="got both"):
        MCPServerSpec.from_config({"command": ["x"], "url": "http://h/mcp"})
    with pytest.raises(ValueError, match="got neither"):
        MCPServerSpec.from_config({})
    with pytest.raises(TypeError, match=r"not a string; e.g. \['python', 'kv.py'\]"):
        MCPServerSpec.from_config({"command": "python kv.py"})
    with pytest.raises(ValueError, match="url must start with http"):
        MCPServerSpec.from_config({"url": "localhost:8000/mcp"})
    with pytest.raises(ValueError, match="did you mean 'template'"):
        MCPToolEnv(Remember, {"command": ["x"]}, tools_in="templates")
    with pytest.raises(ValueError, match="call_timeout_s must be a positive number"):
        MCPToolEnv(Remember, {"command": ["x"]}, call_timeout_s=0)


def test_find_tool_calls_reads_hermes_blocks():
    text = ('Let me look. <tool_call>{"name": "get", "arguments": {"key": "a"}}</tool_call>\n'
            '<tool_call>{"name": "put", "arguments": "{\\"key\\": \\"b\\", \\"value\\": \\"1\\"}"}'
            '</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "keys"}')
    calls = find_tool_calls(text)
    assert [(c.name, dict(c.arguments)) for c in calls[:2]] == [
        ("get", {"key": "a"}), ("put", {"key": "b", "value": "1"})]
    assert calls[2].error is not None and 'needs a string "name"' in calls[2].error
    assert (calls[3].name, dict(calls[3].arguments), calls[3].error) == ("keys", {}, None)
    assert find_tool_calls("no calls here") == []


def test_the_example_plays_an_episode_to_reward_one():
    example = load_module_file(Path(__file__).parents[2] / "examples" / "mcp" / "kv_task.py")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main()
    text = out.getvalue()
    assert '"name": "put"' in text and "stored '" in text
    assert text.rstrip().endswith("'done' -> '' reward=1.0 terminated=True")
