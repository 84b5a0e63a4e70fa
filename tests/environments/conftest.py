"""Fixtures for the math envs: a shared real sandbox, a failing fake one, a scripted driver."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

import agentrl  # noqa: F401 - registers the env ids

from ._helpers import ScriptedSandbox


@pytest.fixture(scope="session")
def sandbox():
    from agentrl.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

    try:
        return Sandbox(SandboxConfig(timeout_s=5.0, memory_mb=256))
    except SandboxUnavailableError as e:
        pytest.skip(f"sandbox isolation unavailable here: {e}")


@pytest.fixture
def broken_sandbox() -> ScriptedSandbox:
    return ScriptedSandbox()


@pytest.fixture
def tir(tiny_tokenizer, sandbox):
    """make(**kwargs) -> the token-level MathTIR env on 8 easy eval problems."""
    envs = []

    def make(tokenizer=tiny_tokenizer, **kwargs):
        kwargs = {"split": "eval", "num_problems": 8, **kwargs}
        env = gym.make("agentrl/MathTIR-v0", tokenizer=tokenizer, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


@pytest.fixture
def write_jsonl(tmp_path):
    def write(rows, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write
