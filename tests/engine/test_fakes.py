"""The fake engines keep the Engine contract the proxy and rollouts rely on: the streaming one
is a whole `Engine`, its deltas concatenate to what `generate` returns, and stops, limits and
cancellation behave as a real engine's do."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.completion import CompletionDelta, SamplingParams
from agentrl.engine.base import Engine, PromptTooLongError
from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine


def test_the_streaming_fake_is_an_engine_and_the_plain_one_does_not_stream(tiny_tokenizer):
    assert isinstance(StreamingFakeEngine(tiny_tokenizer), Engine)
    plain = FakeEngine(tiny_tokenizer)
    assert not hasattr(plain, "generate_stream") and not isinstance(plain, Engine)


async def test_stream_concatenates_to_generate(tiny_tokenizer):
    engine = StreamingFakeEngine(tiny_tokenizer, version=3)
    params = SamplingParams(n=2, max_tokens=64, top_logprobs=2)
    whole = await engine.generate([1, 2, 3], params)
    deltas: list[CompletionDelta] = [d async for d in engine.generate_stream([1, 2, 3], params)]
    for i, c in enumerate(whole):
        mine = [d for d in deltas if d.index == i]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert [lp for d in mine for lp in d.logprobs or []] == c.logprobs
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["stop"]
        assert all(d.policy_version == 3 for d in mine)
    assert whole[0].token_ids != whole[1].token_ids  # the choices differ ("(choice 1)")


async def test_stops_limits_and_cancellation(tiny_tokenizer):
    engine = FakeEngine(tiny_tokenizer, reply="one two. three", max_context=8)
    [cut] = await engine.generate([1], SamplingParams(stop=(".",), max_tokens=64))
    assert tiny_tokenizer.decode(cut.token_ids) == "one two" and cut.stop_reason == "."
    [short] = await engine.generate([1], SamplingParams(max_tokens=2))
    assert len(short.token_ids) == 2 and short.finish_reason == "length"
    with pytest.raises(PromptTooLongError):
        await engine.generate(list(range(8)), SamplingParams())
    engine.latency_s = 5.0
    task = asyncio.create_task(engine.generate([1], SamplingParams()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted == 1 and engine.active == 0
