"""`Engine.score`, the prefill-only call a teacher answers: the transformers engine's log-probs
are a plain transformers forward's (text and vision-language models), it samples and caches
nothing, and the fakes and the router answer it too. (The vLLM engine's: test_vllm_real.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from agentrl.completion import SamplingParams
from agentrl.engine import Engine
from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine
from agentrl.engine.router import EngineRouter
from agentrl.engine.transformers_engine import TransformersEngine
from agentrl.models import load_model, load_tokenizer
from agentrl.models.tiny import TINY_LLAVA, TINY_QWEN2_VL
from agentrl.models.vision import vision_processor


def _forward_logprobs(model, ids, start, **inputs) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **inputs).logits[0].float()
    logp = logits.log_softmax(-1)
    return [float(logp[i - 1, ids[i]]) for i in range(start, len(ids))]


def test_score_is_a_transformers_forward_and_samples_nothing(engine, model, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=3)
    [c] = asyncio.run(engine.generate(prompts[2], params))
    ids = prompts[2] + c.token_ids
    cached, generated = engine.prefix_cache.nbytes, engine.counters["generated_tokens"]
    for start in (1, len(prompts[2])):
        got = asyncio.run(engine.score(ids, start=start))
        want = _forward_logprobs(model, ids, start)
        assert len(got) == len(ids) - start
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The sampler's log-probs of the same tokens are the same numbers (temperature 1).
    np.testing.assert_allclose(asyncio.run(engine.score(ids, start=len(prompts[2]))),
                               c.logprobs, atol=1e-5)
    assert engine.prefix_cache.nbytes == cached
    assert engine.counters["generated_tokens"] == generated
    assert engine.counters["scored_tokens"] == 3 * len(ids)


def test_scores_run_concurrently_with_sampling(engine, model, prompts):
    async def both():
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=0, n=2)
        return await asyncio.gather(engine.generate(prompts[0], params),
                                    *(engine.score(p) for p in prompts))

    completions, *scores = asyncio.run(both())
    assert len(completions) == 2
    for p, got in zip(prompts, scores, strict=True):
        np.testing.assert_allclose(got, _forward_logprobs(model, p, 1), atol=1e-5)


@pytest.mark.parametrize(
    ("ids", "start", "error", "says"),
    [
        ([5, 6, 7], 0, ValueError, r"score\(start=0\) must be in \[1, 3\]"),
        ([5, 6, 7], 4, ValueError, r"score\(start=4\) must be in \[1, 3\]"),
        ([5, 10**6], 1, ValueError, "token id 1000000 is outside the vocabulary"),
        ("some text", 1, TypeError, "score\\(\\) takes token ids, not text"),
    ],
)
def test_a_bad_score_call_is_refused(engine, ids, start, error, says):
    with pytest.raises(error, match=says):
        asyncio.run(engine.score(ids, start=start))


def _img(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", [TINY_QWEN2_VL, TINY_LLAVA])
def test_a_vision_language_model_scores_with_its_images(name):
    """mRoPE (Qwen2-VL) and plain positions (LLaVA): the scores are a forward's with the
    images' pixels; other pixels under the same tokens give other scores."""
    tok, model = load_tokenizer(name), load_model(name).eval()
    vision = vision_processor(tok)
    image = _img(0)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is on screen?"},
                                         {"type": "image", "image": image}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = vision.expand(tok.encode(text, add_special_tokens=False), [image])
    ids = prompt + tok.encode("a red square", add_special_tokens=False)
    engine = TransformersEngine(model, tok)
    try:
        got = asyncio.run(engine.score(ids, [image], start=len(prompt)))
        other = asyncio.run(engine.score(ids, [_img(1)], start=len(prompt)))
    finally:
        engine.close()
    pos = vision.positions(model, ids, [image])
    kw = {} if pos is None else {"position_ids": pos[0][:, None]}
    want = _forward_logprobs(model, ids, len(prompt), **vision.model_inputs([image]), **kw)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert max(abs(a - b) for a, b in zip(got, other, strict=True)) > 1e-4


def test_fakes_and_the_router_score(tiny_tokenizer):
    """The fake scores a token as its `generate` reported it; the router passes the call to
    one of its engines."""
    fakes = [FakeEngine(tiny_tokenizer), FakeEngine(tiny_tokenizer)]
    router = EngineRouter(fakes)
    assert isinstance(StreamingFakeEngine(tiny_tokenizer), Engine)  # score is in the protocol
    prompt = tiny_tokenizer.encode("hello")
    [c] = asyncio.run(fakes[0].generate(prompt, SamplingParams(max_tokens=5)))
    ids = prompt + c.token_ids
    assert asyncio.run(fakes[0].score(ids, start=len(prompt))) == c.logprobs
    assert asyncio.run(router.score(ids, start=len(prompt))) == c.logprobs
    assert sum(len(f.scored) for f in fakes) == 2 and router.routed == [1, 0]
