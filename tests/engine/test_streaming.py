"""TransformersEngine.generate_stream: token-by-token deltas that concatenate to `generate`'s
completions, sent while the request runs; closing or cancelling the stream aborts it."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.completion import Completion, CompletionDelta, SamplingParams
from agentrl.engine.transformers_engine import TransformersEngine


@pytest.fixture
def exact_engine(model, tiny_tokenizer):
    # No prefix cache: a request resumed from cached KV may differ in the last float bits, and
    # these tests compare logprobs exactly between two runs of the same prompt.
    eng = TransformersEngine(model, tiny_tokenizer, max_batch_size=8, prefix_cache_bytes=0)
    yield eng
    eng.close()


@pytest.fixture
def slow_model(model):
    """Each forward pass takes >= 10 ms, so a request of many tokens is surely still running
    when the consumer gets its first delta, however busy the machine is."""
    handle = model.register_forward_pre_hook(lambda *_: time.sleep(0.01))
    yield model
    handle.remove()


async def collect(stream) -> list[CompletionDelta]:
    return [d async for d in stream]


def joined(deltas: list[CompletionDelta], n: int) -> list[Completion]:
    """Concatenate each choice's deltas; checks that only its last delta has a finish reason."""
    out = []
    for i in range(n):
        ds = [d for d in deltas if d.index == i]
        assert ds and all(d.finish_reason is None for d in ds[:-1])
        assert ds[-1].finish_reason is not None
        out.append(
            Completion(
                token_ids=[t for d in ds for t in d.token_ids],
                logprobs=[x for d in ds for x in d.logprobs or []],
                finish_reason=ds[-1].finish_reason,
                policy_version=ds[-1].policy_version,
                stop_reason=ds[-1].stop_reason,
                top_logprobs=[x for d in ds for x in d.top_logprobs or []] or None,
            )
        )
    return out


@pytest.mark.parametrize("n", [1, 2])
async def test_stream_concatenates_to_generate_for_same_seed(exact_engine, prompts, n):
    params = SamplingParams(temperature=1.0, max_tokens=12, n=n, seed=3, top_logprobs=2)
    for p in prompts[:2]:
        ref = await exact_engine.generate(p, params)
        deltas = await collect(exact_engine.generate_stream(p, params))
        assert joined(deltas, n) == ref
        # Token by token: one delta per sampled token per choice.
        assert len(deltas) == sum(len(c.token_ids) for c in ref)
        assert all(len(d.token_ids) == 1 for d in deltas)
    assert exact_engine.num_running == 0


async def test_greedy_stream_equals_generate(exact_engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=16)
    for p in prompts[:3]:
        ref = await exact_engine.generate(p, params)
        assert joined(await collect(exact_engine.generate_stream(p, params)), 1) == ref


async def test_stop_string_keeps_tokens_and_names_the_string(exact_engine, tiny_tokenizer, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    [free] = await exact_engine.generate(prompts[0], greedy)
    text = tiny_tokenizer.decode(free.token_ids[2:4], skip_special_tokens=True).strip()
    if not text:
        pytest.skip("the greedy completion has no text to stop on")
    params = SamplingParams(temperature=0, max_tokens=16, stop=(text[:1],))
    [ref] = await exact_engine.generate(prompts[0], params)
    [got] = joined(await collect(exact_engine.generate_stream(prompts[0], params)), 1)
    assert got == ref
    assert got.finish_reason == "stop" and got.stop_reason == text[:1]


async def test_first_delta_arrives_while_the_request_runs(engine, slow_model, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=0)
    stream = engine.generate_stream(prompts[2], params, request_id="live")
    first = await anext(stream)
    registered_at_first = "live" in engine.scheduler.by_id
    second = await anext(stream)  # from a decode step: the sample holds a batch slot by now
    running_at_second = engine.num_running
    rest = await collect(stream)
    assert first.token_ids and first.finish_reason is None and second.finish_reason is None
    assert registered_at_first and running_at_second == 1
    assert rest and rest[-1].finish_reason is not None
    assert engine.num_running == 0


async def test_aclose_mid_stream_aborts_and_frees_the_slot(engine, slow_model, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=200, n=2, seed=1)
    stream = engine.generate_stream(prompts[1], params)
    seen = [await anext(stream) for _ in range(4)]  # prefill's two deltas, then a decode step's
    assert sorted(d.index for d in seen) == [0, 0, 1, 1]
    assert engine.num_running == 2
    await stream.aclose()
    await wait_idle(engine)
    assert engine.num_running == 0 and engine.num_waiting == 0 and not engine.scheduler.by_id
    [c] = await engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))
    assert c.token_ids and c.finish_reason in ("stop", "length")


async def test_cancelling_the_consumer_aborts(engine, slow_model, prompts):
    got: list[CompletionDelta] = []

    async def consume() -> None:
        async for d in engine.generate_stream(prompts[1], SamplingParams(max_tokens=200, seed=2)):
            got.append(d)

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    assert engine.num_running == 0 and not engine.scheduler.by_id


async def test_max_tokens_gives_length_on_last_delta(engine, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=5, n=2)
    deltas = await collect(engine.generate_stream(prompts[0], params))
    for c in joined(deltas, 2):
        assert len(c.token_ids) <= 3
        assert c.finish_reason == ("length" if len(c.token_ids) == 3 else "stop")
    empty = await collect(engine.generate_stream(prompts[0], SamplingParams(max_tokens=0)))
    assert [(d.token_ids, d.finish_reason) for d in empty] == [([], "length")]


async def test_abort_by_id_ends_the_stream_with_abort(engine, slow_model, prompts):
    stream = engine.generate_stream(
        prompts[1], SamplingParams(max_tokens=200, seed=4), request_id="r1"
    )
    first = await anext(stream)
    assert engine.abort("r1")
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 200


async def wait_idle(engine: TransformersEngine, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    loop = asyncio.get_running_loop()
    while (engine.num_running or engine.scheduler.by_id) and loop.time() < deadline:
        await asyncio.sleep(0.005)
