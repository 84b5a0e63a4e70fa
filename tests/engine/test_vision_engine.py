"""The transformers engine with images: vision-language models sample with their images, the
sampled log-probs are the model's, and the next turn of an episode resumes from the cache of
the previous one only where the screenshots are the same."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from agentrl.completion import SamplingParams
from agentrl.engine.transformers_engine import TransformersEngine
from agentrl.models import load_model, load_tokenizer
from agentrl.models.tiny import TINY_QWEN2_VL, TINY_VLMS
from agentrl.models.vision import ImageError, vision_processor


def _img(seed: int, h: int = 56, w: int = 84) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _turn(tok, vision, image, *, first: bool) -> list[int]:
    """Tokens of a user turn showing `image` (the first opens the chat; later ones close the
    assistant's turn first), with the image placeholder expanded."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is on screen?"},
                                         {"type": "image", "image": image}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if not first:
        text = "\n" + text
    return vision.expand(tok.encode(text, add_special_tokens=False), [image])


def _scored(model, vision, ids, images, start, tokens) -> list[float]:
    """The model's log-probs of `tokens` at `start` of `ids`, from one full forward."""
    pos = vision.positions(model, ids, images)
    kw = {} if pos is None else {"position_ids": pos[0][:, None]}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **vision.model_inputs(images), **kw).logits
    logp = logits[0].float().log_softmax(-1)
    return [float(logp[start - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(params=TINY_VLMS)
def vlm(request):
    tok, model = load_tokenizer(request.param), load_model(request.param)
    engine = TransformersEngine(model, tok, max_batch_size=8, seed=0)
    yield tok, model, vision_processor(tok), engine
    engine.close()


def test_two_screenshot_turns_sample_the_models_logprobs_and_reuse_the_cache(vlm):
    tok, model, vision, engine = vlm
    a, b = _img(0), _img(1, 112, 112)
    prompt = _turn(tok, vision, a, first=True)
    # A random tiny model may sample its image placeholder, which no second turn can hold (the
    # trainer discards such episodes): the first seed whose answer has none.
    for seed in range(1, 20):
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=seed)
        [c1] = asyncio.run(engine.generate(prompt, params, [a]))
        if vision.image_token_id not in c1.token_ids:
            break
    prompt2 = prompt + c1.token_ids + _turn(tok, vision, b, first=False)
    before = dict(engine.counters)
    [c2] = asyncio.run(engine.generate(prompt2, params, [a, b]))
    # Turn 2 resumed from turn 1's prompt and answer, and encoded only the new screenshot.
    assert engine.counters["reused_tokens"] - before["reused_tokens"] >= len(prompt)
    assert engine.counters["prefill_images"] - before["prefill_images"] == 1
    full = prompt2 + c2.token_ids
    ref1 = _scored(model, vision, full, [a, b], len(prompt), c1.token_ids)
    ref2 = _scored(model, vision, full, [a, b], len(prompt2), c2.token_ids)
    np.testing.assert_allclose(c1.logprobs, ref1, atol=1e-5)
    np.testing.assert_allclose(c2.logprobs, ref2, atol=1e-5)


def test_other_screenshots_with_the_same_tokens_do_not_share_the_cache(vlm):
    tok, model, vision, engine = vlm
    a, other = _img(0), _img(7)
    prompt = _turn(tok, vision, a, first=True)
    assert prompt == _turn(tok, vision, other, first=True)  # same ids, different pixels
    params = SamplingParams(temperature=0.0, max_tokens=4)
    asyncio.run(engine.generate(prompt, params, [a]))
    before = engine.counters["reused_tokens"]
    [c] = asyncio.run(engine.generate(prompt, params, [other]))
    ((start, _),) = vision.spans(prompt, [other])
    assert engine.counters["reused_tokens"] - before <= start
    np.testing.assert_allclose(
        c.logprobs, _scored(model, vision, prompt + c.token_ids, [other], len(prompt),
                            c.token_ids), atol=1e-5)


def test_one_admission_with_different_images_and_samples(vlm):
    """Requests admitted together, each with its own screenshots and n samples: every sample's
    log-probs are those of its own images."""
    tok, model, vision, engine = vlm
    images = [_img(10), _img(11, 28, 112)]

    async def both():
        params = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=3)
        return await asyncio.gather(*(
            engine.generate(_turn(tok, vision, im, first=True), params, [im]) for im in images))

    for im, completions in zip(images, asyncio.run(both()), strict=True):
        prompt = _turn(tok, vision, im, first=True)
        for c in completions:
            np.testing.assert_allclose(
                c.logprobs, _scored(model, vision, prompt + c.token_ids, [im], len(prompt),
                                    c.token_ids), atol=1e-5)


def test_bad_image_requests_fail_before_anything_is_queued():
    tok, model = load_tokenizer(TINY_QWEN2_VL), load_model(TINY_QWEN2_VL)
    vision = vision_processor(tok)
    with TransformersEngine(model, tok, max_batch_size=2) as engine:
        prompt = _turn(tok, vision, _img(0), first=True)
        params = SamplingParams(max_tokens=2)
        with pytest.raises(ImageError, match="image tokens"):
            asyncio.run(engine.generate(prompt, params, [_img(0), _img(1)]))
        with pytest.raises(ImageError, match="uint8"):
            asyncio.run(engine.generate(prompt, params, [_img(0).astype(np.float32)]))
        assert engine.num_waiting == 0 and engine.num_running == 0
        [c] = asyncio.run(engine.generate(prompt, params, [_img(0)]))  # still serving
        assert len(c.token_ids) == 2


def test_a_text_model_refuses_images(tiny_tokenizer):
    from agentrl.models.tiny import tiny_model

    with TransformersEngine(tiny_model(tiny_tokenizer), tiny_tokenizer) as engine, \
            pytest.raises(ValueError, match="text-only"):
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2), [_img(0)]))
