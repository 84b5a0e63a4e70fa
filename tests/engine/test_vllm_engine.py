"""The vLLM backend against a fake of vLLM's documented API (vLLM cannot be installed here)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from agentrl.engine import PromptTooLongError, create_engine
from agentrl.types import SamplingParams

from . import fake_vllm


@pytest.fixture
def engine(monkeypatch):
    fake_vllm.install(monkeypatch)
    eng = create_engine("some/model", backend="vllm", gpu_memory_utilization=0.3)
    yield eng
    eng.close()


def llm():
    return fake_vllm.AsyncLLM.instances[-1]


async def test_generate_maps_params_and_outputs(engine):
    assert engine.max_context == fake_vllm.MAX_LEN
    args = llm().args.kwargs
    assert args["logprobs_mode"] == "processed_logprobs" and args["enable_sleep_mode"]
    assert args["gpu_memory_utilization"] == 0.3
    cs = await engine.generate([5, 6], SamplingParams(max_tokens=4, n=2, top_logprobs=1))
    assert len(cs) == 2
    for c in cs:
        assert c.token_ids == [7, 8, 9, 10] and c.finish_reason == "length"
        assert c.logprobs == [-0.5] * 4 and c.policy_version == 0
        assert c.top_logprobs == [[(t, -0.5)] for t in c.token_ids]
    [s] = await engine.generate([5], SamplingParams(max_tokens=10, stop_token_ids=(8,)))
    assert (s.token_ids, s.finish_reason, s.stop_reason) == ([6, 7, 8], "stop", 8)
    [n] = await engine.generate([5], SamplingParams(max_tokens=2, logprobs=False))
    assert n.logprobs is None


async def test_raw_logprobs_mode_is_per_engine(engine, monkeypatch):
    with pytest.raises(ValueError, match="raw_logprobs=True"):
        await engine.generate([5], SamplingParams(max_tokens=2, raw_logprobs=True))
    raw = create_engine("m", backend="vllm", raw_logprobs=True)
    try:
        [c] = await raw.generate([5], SamplingParams(max_tokens=2, raw_logprobs=True))
        assert c.logprobs == [-0.25, -0.25]
    finally:
        raw.close()


async def test_bad_input(engine):
    with pytest.raises(PromptTooLongError):
        await engine.generate([1] * fake_vllm.MAX_LEN, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate([fake_vllm.VOCAB], SamplingParams())


async def test_update_weights_through_collective_rpc(engine):
    engine.bucket_bytes = 1  # one tensor per call
    engine.update_weights({"w": torch.tensor(3), "other": torch.tensor(0)}, version=5)
    assert llm().rpc_calls == ["agentrl_load_weights", "agentrl_load_weights"]
    assert llm().prefix_resets == 1
    [c] = await engine.generate([5], SamplingParams(max_tokens=2))
    assert c.token_ids == [8, 11] and c.policy_version == 5 and engine.version == 5


async def test_cancel_aborts_and_sleep_wake(engine):
    task = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=50)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert llm().aborted
    engine.sleep()
    assert llm().sleeping
    engine.wake()
    [c] = await engine.generate([1], SamplingParams(max_tokens=1))
    assert c.token_ids == [2]


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)
    with pytest.raises(ImportError, match=r"agentrl\[vllm\]"):
        create_engine("m", backend="vllm")
