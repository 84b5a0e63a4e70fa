"""TransformersEngine on the tiny model: greedy parity with HF generate, batching, seeds,
logprobs against a plain forward pass, stops, limits, cancellation, bad input, weight updates."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from agentrl.completion import SamplingParams
from agentrl.engine import PromptTooLongError, create_engine, model_runner
from agentrl.engine.requests import cut_at_stop
from agentrl.engine.token_sampling import filter_top_k_top_p
from agentrl.engine.transformers_engine import TransformersEngine

from ._models import sharp_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def recompute_logprobs(model, prompt, completion, temperature=1.0, top_k=0, top_p=1.0):
    """What a trainer does: one forward over prompt+completion, log_softmax(logits / T)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k or top_p < 1:
        n = logits.shape[0]
        logits = filter_top_k_top_p(logits, torch.full((n,), top_k), torch.full((n,), float(top_p)))
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


async def test_greedy_matches_hf_generate(engine, model, prompts):
    for p in prompts[:3]:
        [c] = await engine.generate(p, GREEDY)
        ref = hf_greedy(model, p, GREEDY.max_tokens)
        assert c.token_ids == ref[: len(c.token_ids)]
        assert c.finish_reason == ("length" if len(c.token_ids) == 16 else "stop")


async def test_concurrent_batching_equals_one_at_a_time(engine, prompts):
    alone = [(await engine.generate(p, GREEDY))[0] for p in prompts]
    many = prompts * 3  # 18 requests, more than max_batch_size=8: slots are reused
    together = await asyncio.gather(*(engine.generate(p, GREEDY) for p in many))
    for i, [c] in enumerate(together):
        assert c.token_ids == alone[i % len(prompts)].token_ids
        torch.testing.assert_close(c.logprobs, alone[i % len(prompts)].logprobs, atol=1e-4, rtol=0)
    assert engine.num_running == 0


async def test_seeded_sampling_is_reproducible(engine, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=3)
    a = await engine.generate(prompts[0], params)
    # Same seed while other requests share the batch: same samples.
    b, _ = await asyncio.gather(
        engine.generate(prompts[0], params),
        engine.generate(prompts[1], dataclasses.replace(params, seed=None)),
    )
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1  # the n samples differ
    c = await engine.generate(prompts[0], dataclasses.replace(params, seed=8))
    assert [x.token_ids for x in c] != [x.token_ids for x in a]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (0.8, 0, 0.9)]
)
async def test_logprobs_match_recomputed_forward(engine, model, prompts, temperature, top_k, top_p):
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, seed=1, n=2
    )
    for c in await engine.generate(prompts[2], params):
        ref = recompute_logprobs(model, prompts[2], c.token_ids, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
        assert all(lp > float("-inf") for lp in c.logprobs)


async def test_raw_logprobs_are_the_model_distribution(engine, model, prompts):
    params = SamplingParams(temperature=0.5, top_k=5, max_tokens=10, seed=3, raw_logprobs=True)
    [c] = await engine.generate(prompts[1], params)
    torch.testing.assert_close(
        torch.tensor(c.logprobs),
        recompute_logprobs(model, prompts[1], c.token_ids),
        atol=1e-4,
        rtol=0,
    )
    processed = recompute_logprobs(model, prompts[1], c.token_ids, 0.5, 5)
    assert not torch.allclose(torch.tensor(c.logprobs), processed, atol=1e-3)


async def test_logit_bias_steers_sampling_and_the_logprobs_are_of_what_was_sampled(
        engine, model, prompts):
    """#17 item 4 (logit_bias): +100 on one token makes it the sample at every position; the
    logprobs are of the biased distribution (~0), raw ones of the model's own."""
    token = 42
    biased = SamplingParams(temperature=1.0, max_tokens=6, seed=1, logit_bias=((token, 100.0),))
    [c] = await engine.generate(prompts[0], biased)
    assert c.token_ids == [token] * 6 and all(abs(lp) < 1e-3 for lp in c.logprobs)
    [raw] = await engine.generate(prompts[0], dataclasses.replace(biased, raw_logprobs=True))
    torch.testing.assert_close(torch.tensor(raw.logprobs),
                               recompute_logprobs(model, prompts[0], raw.token_ids),
                               atol=1e-4, rtol=0)
    [free] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, max_tokens=1))
    [banned] = await engine.generate(prompts[0], dataclasses.replace(
        GREEDY, max_tokens=1, logit_bias=((free.token_ids[0], -100.0),)))
    assert banned.token_ids != free.token_ids  # greedy's own choice, banned
    with pytest.raises(ValueError, match="logit_bias token id 99999 is outside"):
        await engine.generate(prompts[0], dataclasses.replace(
            GREEDY, logit_bias=((99999, 1.0),)))
    with pytest.raises(ValueError, match=r"bias in \[-100, 100\]"):
        SamplingParams(logit_bias=((1, 500.0),))


async def test_top_k_one_is_greedy(engine, prompts):
    [g] = await engine.generate(prompts[0], GREEDY)
    [k] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, temperature=1.0, top_k=1))
    assert k.token_ids == g.token_ids
    assert all(abs(lp) < 1e-6 for lp in k.logprobs)  # a point mass: log 1


async def test_top_logprobs(engine, prompts):
    [c] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, top_logprobs=3))
    assert len(c.top_logprobs) == len(c.token_ids)
    for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6 and len(top) == 3


async def test_stop_strings_and_stop_tokens(engine, tiny_tokenizer, prompts):
    [free] = await engine.generate(prompts[0], GREEDY)
    text = tiny_tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop and stop in text
    [c] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, stop=(stop,)))
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == free.token_ids[: len(c.token_ids)] and len(c.token_ids) < 16
    got = tiny_tokenizer.decode(c.token_ids)
    assert stop in got and stop not in tiny_tokenizer.decode(c.token_ids[:-1])
    assert cut_at_stop(got, c.stop_reason) == text[: text.find(stop)]
    tok = free.token_ids[3]
    [d] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, stop_token_ids=(tok,)))
    assert d.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    assert (d.finish_reason, d.stop_reason) == ("stop", tok)


async def test_max_tokens_gives_length(engine, prompts):
    [c] = await engine.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=5, seed=0))
    assert (len(c.token_ids), c.finish_reason) == (5, "length")
    [z] = await engine.generate(prompts[1], SamplingParams(max_tokens=0))
    assert (z.token_ids, z.finish_reason) == ([], "length")


async def test_cancel_frees_slot_and_abort_returns_abort(engine, prompts):
    long = SamplingParams(temperature=1.0, max_tokens=1000, seed=0)
    task = asyncio.create_task(engine.generate(prompts[0], long))
    while engine.num_running == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0
    task = asyncio.create_task(engine.generate(prompts[0], long, request_id="r1"))
    while engine.num_running == 0:
        await asyncio.sleep(0.01)
    assert engine.abort("r1")
    [c] = await task
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 1000
    assert len(c.logprobs) == len(c.token_ids)
    assert engine.num_running == 0 and not engine.abort("r1")


async def test_prompt_too_long(engine):
    with pytest.raises(PromptTooLongError, match="context is 2048"):
        await engine.generate([5] * 2048, GREEDY)
    [c] = await engine.generate([5] * 2040, GREEDY)  # fits; stops at the context end
    assert (len(c.token_ids), c.finish_reason) == (8, "length")


async def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate([1, 10**6], GREEDY)
    with pytest.raises(TypeError, match="not text"):
        await engine.generate("hello", GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        await engine.generate([1, 2], {"temperature": 0})


async def test_update_weights_changes_outputs_and_version(model, tiny_tokenizer, prompts):
    other = sharp_tiny_model(tiny_tokenizer, seed=2)
    own = sharp_tiny_model(tiny_tokenizer, seed=1)
    with TransformersEngine(own, tiny_tokenizer) as engine:
        [before] = await engine.generate(prompts[0], GREEDY)
        assert before.policy_version == 0
        engine.update_weights(other.state_dict(), version=1)
        [after] = await engine.generate(prompts[0], GREEDY)
        assert after.policy_version == 1 and engine.version == 1
        assert after.token_ids == hf_greedy(other, prompts[0], 16)[: len(after.token_ids)]
        assert after.token_ids != before.token_ids
        engine.update_weights(iter(model.state_dict().items()), version=2)  # an iterator works
        [back] = await engine.generate(prompts[0], GREEDY)
        assert back.token_ids == before.token_ids and back.policy_version == 2
        with pytest.raises(ValueError, match="did you mean 'lm_head.weight'"):
            engine.update_weights({"lm_head.weigth": other.lm_head.weight}, version=3)


async def test_colocated_model_update_is_a_version_bump(tiny_tokenizer, prompts):
    model = sharp_tiny_model(tiny_tokenizer)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with TransformersEngine(model, tiny_tokenizer) as engine:
        [before] = await engine.generate(prompts[0], GREEDY)
        assert model.training  # generation left the trainer's mode alone
        loss = model(
            torch.tensor([prompts[0] + before.token_ids]),
            labels=torch.tensor([prompts[0] + before.token_ids]),
        ).loss
        loss.backward()  # autograd still works on the shared module
        opt.step()
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        engine.update_weights(model.state_dict(), version=1)
        assert ptrs == {n: p.data_ptr() for n, p in model.named_parameters()}
        [after] = await engine.generate(prompts[0], GREEDY)
        assert after.policy_version == 1
        assert after.token_ids == hf_greedy(model, prompts[0], 16)[: len(after.token_ids)]


async def test_multi_turn_prefix_is_reused(engine, model, prompts):
    [first] = await engine.generate(prompts[2], GREEDY)
    reused = engine.counters["reused_tokens"]
    turn2 = prompts[2] + first.token_ids + prompts[1]
    [second] = await engine.generate(turn2, GREEDY)
    assert engine.counters["reused_tokens"] - reused >= len(prompts[2]) + len(first.token_ids) - 1
    assert second.token_ids == hf_greedy(model, turn2, 16)[: len(second.token_ids)]


@pytest.mark.parametrize("window", [0.0, 0.1])
async def test_requests_arriving_together_are_admitted_together(
    model, tiny_tokenizer, prompts, window
):
    # Three requests 25 ms apart: inside a 100 ms admission window they share one prefill
    # pass; without a window each is admitted on arrival, the earlier ones still decoding.
    params = SamplingParams(temperature=0, max_tokens=200)
    with TransformersEngine(model, tiny_tokenizer, admission_window=window) as engine:
        await engine.generate(prompts[4], SamplingParams(max_tokens=2))  # warm-up
        engine.counters.clear()
        tasks = []
        for p in prompts[:3]:
            tasks.append(asyncio.create_task(engine.generate(p, params)))
            await asyncio.sleep(0.025)
        done = await asyncio.gather(*tasks)
        assert engine.counters["admissions"] == (1 if window else 3)
    assert min(len(c.token_ids) for [c] in done) > 40  # still decoding when the others came


async def test_sleep_wake(engine, prompts):
    [a] = await engine.generate(prompts[0], GREEDY)
    engine.sleep()
    assert len(engine.prefix_cache) == 0
    task = asyncio.create_task(engine.generate(prompts[0], GREEDY))
    await asyncio.sleep(0.05)
    assert not task.done()  # waits while asleep
    engine.wake()
    [b] = await task
    assert a.token_ids == b.token_ids


async def test_create_engine(tiny_tokenizer, prompts):
    engine = create_engine("tiny")
    try:
        assert isinstance(engine, TransformersEngine) and engine.max_context == 2048
        # Greedy: an unseeded sample could draw the end-of-sequence token before 3 tokens.
        [c] = await engine.generate(prompts[0], SamplingParams(max_tokens=3, temperature=0))
        assert len(c.token_ids) == 3 and c.finish_reason == "length"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="Did you mean 'vllm'"):
        create_engine("tiny", backend="vlm")


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, agentrl.engine, agentrl.rollout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_samples_done_at_their_first_token_need_no_decode_step(engine, prompts, caplog):
    # max_tokens=1: every sample ends in the prefill's own sampling; a decode step over rows
    # that are all finished once failed (an empty index) and logged an error.
    params = SamplingParams(temperature=1.0, max_tokens=1, n=4, seed=0)
    done = await asyncio.gather(*(engine.generate(p, params) for p in prompts[:2]))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for cs in done for c in cs)
    # The requests resolve inside the engine's step; its lock is free once that step has ended.
    with engine._step_lock:
        pass
    assert engine.counters["decode_steps"] == 0
    assert "generation step failed" not in caplog.text
    [c] = await engine.generate(prompts[2], SamplingParams(temperature=0, max_tokens=3))
    assert len(c.token_ids) == 3  # the engine goes on as usual


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0])
async def test_a_start_shared_by_prompts_is_encoded_once(
    model, tiny_tokenizer, prompts, cache_bytes
):
    # Chat prompts of one step share a system prompt: with a prefix cache it is encoded once,
    # then each prompt's prefill resumes from it. Outputs match prompts encoded one at a time.
    header = (prompts[4] + prompts[2] + prompts[5]) * 4
    assert 2 * len(header) >= model_runner._MIN_SHARED_TOKENS_SAVED  # 3 prompts: 2 encodings saved
    batch = [header + p for p in prompts[:3]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=True)
    with TransformersEngine(model, tiny_tokenizer, prefix_cache_bytes=0) as alone:
        want = [(await alone.generate(p, params))[0] for p in batch]
    with TransformersEngine(
        model, tiny_tokenizer, prefix_cache_bytes=cache_bytes, admission_window=0.1
    ) as engine:
        got = await asyncio.gather(*(engine.generate(p, params) for p in batch))
        assert engine.counters["admissions"] == 1
        shared = engine.counters["shared_prefix_prefills"]
        encoded = engine.counters["prefill_tokens"]
    if cache_bytes:
        assert shared == 1
        assert encoded == len(header) + sum(len(p) for p in prompts[:3])
    else:
        assert shared == 0 and encoded == sum(len(p) for p in batch)
    for [c], w in zip(got, want, strict=True):
        assert c.token_ids == w.token_ids
        torch.testing.assert_close(c.logprobs, w.logprobs, atol=1e-4, rtol=0)


async def test_a_short_shared_start_is_encoded_with_the_prompts(model, tiny_tokenizer, prompts):
    # Two prompts sharing a few tokens: the extra forward pass would cost more than it saves.
    batch = [prompts[4] + p for p in prompts[:2]]
    assert len(prompts[4]) < model_runner._MIN_SHARED_TOKENS_SAVED
    with TransformersEngine(model, tiny_tokenizer, admission_window=0.1) as engine:
        await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=2)) for p in batch))
        assert engine.counters["shared_prefix_prefills"] == 0
        assert engine.counters["prefill_tokens"] == sum(len(p) for p in batch)


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "maximum": 9,
                                                 "minimum": 0}},
         "required": ["color", "n"], "additionalProperties": False}


def masked_logprobs(model, prompt, completion, compiled, masks):
    """Plain-loop reference: at each position, the model's log-softmax over the tokens the
    grammar (`compiled`) allows there (the matcher replayed over the completion)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    out = []
    for pos, tok in enumerate(completion):
        row = logits[pos].float().clone()[None]
        masks.apply(row, [matcher])
        out.append(float(torch.log_softmax(row[0], -1)[tok]))
        assert matcher.accept_token(tok)
    return torch.tensor(out)


async def test_a_grammar_constrains_every_sample_and_logprobs_are_of_the_masked_distribution(
        engine, model, prompts, tiny_tokenizer):
    """#17 item 4: a JSON-schema grammar makes the tiny random model write only valid JSON
    for the schema, ending the completion when it is complete; each token's logprob is of
    the distribution sampled from (the model's, renormalised over what the grammar allows)."""
    import json

    from agentrl.engine.grammar import json_schema_grammar

    grammar = json_schema_grammar(COLOR)
    params = SamplingParams(temperature=1.0, max_tokens=60, n=4, seed=3, grammar=grammar)
    completions = await engine.generate(prompts[0], params)
    free = await engine.generate(prompts[0], dataclasses.replace(params, grammar=None))
    assert not any(_is_json(tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True))
                   for c in free)  # the model alone does not write it
    for c in completions:
        text = tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True)
        value = json.loads(text)
        assert value["color"] in {"red", "green", "blue"} and 0 <= value["n"] <= 9
        assert set(value) == {"color", "n"} and c.finish_reason == "stop"
        assert c.token_ids[-1] in engine.eos_ids
        want = masked_logprobs(model, prompts[0], c.token_ids,
                               await engine.grammars.compile(grammar), engine.grammars)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
        plain = recompute_logprobs(model, prompts[0], c.token_ids)
        assert (want >= plain - 1e-5).all() and (want > plain + 1e-3).any()
    [greedy] = await engine.generate(prompts[0], dataclasses.replace(GREEDY, grammar=grammar,
                                                                    max_tokens=60))
    json.loads(tiny_tokenizer.decode(greedy.token_ids, skip_special_tokens=True))


def _is_json(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def test_a_grammar_that_does_not_compile_is_refused_before_queueing(engine, prompts):
    from agentrl.engine.grammar import GrammarError, json_schema_grammar

    with pytest.raises(GrammarError, match="cannot be compiled"):
        await engine.generate(prompts[0], dataclasses.replace(GREEDY, grammar="root ::= ("))
    with pytest.raises(GrammarError, match='Unsupported type "strang"'):
        json_schema_grammar({"type": "strang"})
    assert engine.num_waiting == 0 and engine.num_running == 0


async def test_compiling_a_grammar_leaves_the_callers_event_loop_free(engine, prompts):
    """A grammar compiles off the loop (on trial in a worker process, then in a thread): a
    slow compile (a large schema) does not stall the loop that serves every other request,
    and cancelling the request stops it (tests/engine/test_grammar.py)."""
    import time

    from agentrl.engine.grammar import json_schema_grammar

    slow = json_schema_grammar({"type": "object", "properties": {
        f"loop{i}": {"type": "string"} for i in range(2000)}, "additionalProperties": False})
    task = asyncio.create_task(engine.generate(
        prompts[0], dataclasses.replace(GREEDY, max_tokens=3, grammar=slow)))
    for _ in range(10):  # the request compiles, and the loop runs on
        start = time.monotonic()
        await asyncio.sleep(0.05)
        assert time.monotonic() - start < 0.5
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [c] = await engine.generate(
        prompts[0], dataclasses.replace(GREEDY, max_tokens=3, grammar='root ::= "yes"'))
    assert engine.tokenizer.decode(c.token_ids, skip_special_tokens=True) == "yes"


async def test_weight_update_mid_request_is_partial_rollout(tiny_tokenizer, prompts):
    """#16 item 5: an update does not wait for running requests: they go on with the new
    weights. Each token keeps the version that sampled it and that version's log-prob (the
    tokens before the switch score as the old model, those after as the new one), through
    `generate` and the streamed deltas alike; a trajectory of such a turn carries both versions,
    and the off-policy weights of the loss come from those per-token behaviour log-probs."""
    from agentrl.algorithms import mismatch_weights
    from agentrl.types import Trajectory, TrajectoryBuilder
    from servers.generation import Accumulator
    from trainers.batch import collate

    old, new = sharp_tiny_model(tiny_tokenizer, seed=1), sharp_tiny_model(tiny_tokenizer, seed=2)
    # No EOS, so both requests run past the update; raw logprobs: the models' own.
    params = SamplingParams(temperature=1.0, max_tokens=160, seed=3, raw_logprobs=True,
                            logit_bias=((tiny_tokenizer.eos_token_id, -100.0),))
    with TransformersEngine(sharp_tiny_model(tiny_tokenizer, seed=1), tiny_tokenizer) as engine:
        whole = asyncio.ensure_future(engine.generate(prompts[0], dataclasses.replace(params, n=2)))
        streamed, acc = 0, Accumulator()
        async for d in engine.generate_stream(prompts[1], params):
            acc.add(d)
            streamed += len(d.token_ids)
            if streamed >= 4 and engine.version == 0:
                engine.update_weights(new.state_dict(), version=1)  # between two decode steps
        results = [(prompts[0], c) for c in await whole] + [(prompts[1], acc.completion())]
        assert engine.counters["reencoded_samples"] == 3
    for prompt, c in results:
        [(switch, version)] = c.version_changes
        assert version == 1 and c.policy_version == 0 and 4 <= switch < len(c.token_ids) == 160
        assert c.token_versions() == [0] * switch + [1] * (160 - switch)
        as_old = recompute_logprobs(old, prompt, c.token_ids)
        as_new = recompute_logprobs(new, prompt, c.token_ids)
        lp = torch.tensor(c.logprobs)
        torch.testing.assert_close(lp[:switch], as_old[:switch], atol=1e-4, rtol=0)
        torch.testing.assert_close(lp[switch:], as_new[switch:], atol=1e-4, rtol=0)
        assert (lp[:switch] - as_new[:switch]).abs().max() > 0.1  # the versions differ

    prompt, c = results[0]
    builder = TrajectoryBuilder(group="g")
    builder.add_observation(prompt)
    builder.add_action(c.token_ids, c.logprobs, policy_version=c.policy_version,
                       version_changes=c.version_changes)
    traj = Trajectory.from_json(builder.build(terminated=True, truncated=False).to_json())
    switch = c.version_changes[0][0]
    assert traj.policy_versions == [0, 1]
    assert traj.token_versions() == [-1] * len(prompt) + c.token_versions()
    # The trainer holds version 1 (its "old" log-probs are the new model's): tokens that
    # version sampled need no correction, those of version 0 are reweighted by new/old.
    batch = collate([traj], pad_id=0)
    trainer_logp = torch.zeros_like(batch.rollout_logp)
    start = len(prompt) - 1
    trainer_logp[0, start:] = recompute_logprobs(new, prompt, c.token_ids)
    weights = mismatch_weights("tis", old_logp_BT=trainer_logp, rollout_logp_BT=batch.rollout_logp,
                               mask_BT=batch.mask)[0, start:]
    ratio = torch.exp(recompute_logprobs(new, prompt, c.token_ids)
                      - recompute_logprobs(old, prompt, c.token_ids))[:switch]
    torch.testing.assert_close(weights[switch:], torch.ones(160 - switch), atol=1e-3, rtol=0)
    torch.testing.assert_close(weights[:switch], ratio.clamp(0.5, 5.0), atol=1e-3, rtol=1e-3)


async def test_unconstrained_sampling_runs_without_xgrammar(engine, prompts, monkeypatch):
    """xgrammar is needed only for a grammar (tools, response_format): a GPU image without it
    sampled nothing until the sampler stopped importing it for batches with no matcher."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises
    [c] = await engine.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    assert c.token_ids and len(c.logprobs) == len(c.token_ids)
