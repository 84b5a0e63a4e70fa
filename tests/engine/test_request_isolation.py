"""A request that fails inside the transformers engine's batch fails alone (#34 item 2): the
requests batched with it, admitted with it or already running, get exactly what they get
alone, and the engine goes on."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agentrl.completion import SamplingParams
from agentrl.engine.base import GenerationError
from agentrl.engine.transformers_engine import TransformersEngine

GOOD = SamplingParams(temperature=1.0, max_tokens=48, seed=3)
"""Seeded: the same tokens whatever shares the batch, so "alone" and "batched" compare."""


def _break(engine: TransformersEngine, how: str, bad_prompt: list[int],
           monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """Make requests for `bad_prompt` fail `how` inside the engine's step; their params."""
    if how == "sampling":
        # Passed every check, yet breaks the batched sampling: top_k past int64, as the proxy
        # once let through (SamplingParams refuses it now; this one slips past its check).
        params = dataclasses.replace(GOOD, seed=None)
        object.__setattr__(params, "top_k", 2**63)
        return params
    if how == "prefill":
        forward = engine.runner.forward

        def failing_forward(**inputs: object) -> object:
            ids = inputs["input_ids"]
            if (ids == bad_prompt[-1]).any():  # type: ignore[operator]
                raise RuntimeError("this prompt cannot be encoded")
            return forward(**inputs)

        monkeypatch.setattr(engine.runner, "forward", failing_forward)
    elif how == "decode":
        check = engine.sampler.check_finished

        def failing_check(s, tok):  # type: ignore[no-untyped-def]
            if s.request.prompt == bad_prompt and len(s.tokens) == 3:
                raise RuntimeError("this sample cannot go on")
            check(s, tok)

        monkeypatch.setattr(engine.sampler, "check_finished", failing_check)
    return GOOD


async def _stream_all(engine: TransformersEngine, prompt: list[int],
                      started: asyncio.Event) -> list[int]:
    tokens: list[int] = []
    async for d in engine.generate_stream(prompt, GOOD):
        tokens += d.token_ids
        started.set()
    return tokens


@pytest.mark.parametrize("when", ["admitted together", "while the other runs"])
@pytest.mark.parametrize("how", ["sampling", "prefill", "decode"])
async def test_a_request_failing_in_the_batch_fails_alone(engine, prompts, monkeypatch, how,
                                                          when):
    good_prompt = prompts[0]
    [alone] = await engine.generate(good_prompt, GOOD)
    bad_prompt = [*prompts[1], engine.vocab_size - 1]
    assert bad_prompt[-1] not in good_prompt + alone.token_ids  # only the bad one is marked
    assert len(alone.token_ids) > 20  # long enough to be running when the bad one comes
    bad_params = _break(engine, how, bad_prompt, monkeypatch)

    started = asyncio.Event()
    good = asyncio.create_task(_stream_all(engine, good_prompt, started))
    if when == "while the other runs":
        await started.wait()
    bad = asyncio.create_task(engine.generate(bad_prompt, bad_params))
    done = await asyncio.gather(good, bad, return_exceptions=True)
    assert done[0] == alone.token_ids, done[0]  # the innocent one, as if alone
    assert isinstance(done[1], GenerationError), done[1]
    assert "generation failed for this request" in str(done[1])
    [again] = await engine.generate(good_prompt, GOOD)  # the engine goes on
    assert again.token_ids == alone.token_ids and engine.num_running == 0


def test_sampling_params_bound_what_engines_hold_in_fixed_width_integers():
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[0, 2147483647\]"):
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError, match=r"seed must be None or an integer in \[-9223372036"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=float("inf"))
    SamplingParams(top_k=2**31 - 1, seed=-(2**63))  # the bounds themselves are fine
