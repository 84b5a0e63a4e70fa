"""Agents as commands (`agentrl train --agent_cmd "CMD ARGS"`, #32 item 2): an agent in any
language or environment, one process per episode.

The process gets its session in its environment: OPENAI_BASE_URL and ANTHROPIC_BASE_URL (the
session's `/sessions/<id>/v1` and `/sessions/<id>`, which the OpenAI and Anthropic SDKs read),
OPENAI_API_KEY and ANTHROPIC_API_KEY, and AGENTRL_SESSION_ID. It reads its task, one JSON
value, on stdin; the last line it prints is its answer. Its exit status and the tail
of its stderr are kept in its trajectories' info (`exit_status`, `stderr_tail`); a non-zero
status fails the episode (`AgentFailed("exit")`).

Each process runs in a process group of its own, killed when its episode ends (an agent's
leftover children included) or is ended (a timeout); `agentrl/process_reaper.py` kills the
groups still running if the process that started them dies, even by SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from agentrl import process_reaper
from servers.agents import AgentAnswer, AgentFailed

STDERR_TAIL_CHARS = 2000
"""How much of an agent's stderr is kept with its session (the end of it)."""


def command_argv(command: str, flag: str = "--agent_cmd") -> list[str]:
    """The command's argv, or a one-line ValueError naming it when it cannot start: empty, not
    shell words, or a program that is not found or not executable. Starts nothing."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"{flag} {command!r} cannot start: {e}") from None
    if not argv:
        raise ValueError(f"{flag} is empty: pass the agent's command, e.g. \"python3 agent.py\"")
    program = argv[0]
    if os.sep in program:
        path = Path(program)
        if not path.is_file():
            raise ValueError(f"{flag} {command!r} cannot start: {program} does not exist")
        if not os.access(path, os.X_OK):
            raise ValueError(f"{flag} {command!r} cannot start: {program} is not executable "
                             f"(chmod +x it, or name its interpreter first)")
    elif shutil.which(program) is None:
        raise ValueError(f"{flag} {command!r} cannot start: {program!r} is not found on PATH")
    return argv


def session_env(base_url: str, api_key: str) -> dict[str, str]:
    """The variables that point an agent at its session (`base_url`: `.../sessions/<id>/v1`)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    return {"OPENAI_BASE_URL": f"{root}/v1", "OPENAI_API_KEY": api_key,
            "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": api_key,
            "AGENTRL_SESSION_ID": root.rsplit("/", 1)[-1]}


class CommandAgent:
    """An agent function (`servers.agents.AgentFn`) that runs `command` once per episode."""

    def __init__(self, command: str, *, cwd: str | None = None) -> None:
        self.command = command
        self.argv = command_argv(command)
        self.cwd = cwd

    async def __call__(self, task: Any, base_url: str, api_key: str) -> AgentAnswer:
        env = {**os.environ, **session_env(base_url, api_key)}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)
        except OSError as e:
            raise AgentFailed("start", f"--agent_cmd {self.command!r} did not start: {e}") from None
        process_reaper.group_reaper().watch(proc.pid)
        try:
            out, err = await proc.communicate(json.dumps(task).encode() + b"\n")
        finally:  # done, failed or cancelled (a timeout): nothing of the agent stays
            process_reaper.kill_group(proc.pid)
            if proc.returncode is None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
            process_reaper.group_reaper().forget(proc.pid)
        tail = err.decode(errors="replace")[-STDERR_TAIL_CHARS:]
        info: dict[str, object] = {"exit_status": proc.returncode, "stderr_tail": tail}
        if proc.returncode != 0:
            last = (tail.strip().splitlines() or [""])[-1][:300]
            raise AgentFailed("exit", f"--agent_cmd exited with status {proc.returncode}"
                                      f"{': ' + last if last else ''}", info)
        lines = out.decode(errors="replace").splitlines()
        return AgentAnswer(lines[-1] if lines else "", info)
