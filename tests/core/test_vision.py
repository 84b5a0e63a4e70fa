"""The processor path of vision-language models (agentrl.models.vision), on the tiny Qwen2-VL
(mRoPE, variable image sizes), LLaVA (fixed-size CLIP tower) and Idefics3 (tiled images framed
by mark tokens) families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.models import load_model, load_tokenizer
from agentrl.models.tiny import TINY_IDEFICS3, TINY_LLAVA, TINY_QWEN2_VL, TINY_VLMS
from agentrl.models.vision import ImageError, check_image, vision_processor


def _img(seed: int, h: int = 56, w: int = 84) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _render(tok, images) -> list[int]:
    parts = [{"type": "text", "text": "look"}] + [{"type": "image", "image": im} for im in images]
    return tok.apply_chat_template([{"role": "user", "content": parts}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("name", TINY_VLMS)
def test_expanded_tokens_are_what_the_model_consumes(name):
    """The expansion gives each image exactly as many tokens as the vision tower yields: the
    model's forward accepts them (it raises on a mismatch), and adjacent images are told apart."""
    tok, model = load_tokenizer(name), load_model(name)
    vision = vision_processor(tok)
    images = [_img(0), _img(1, 112, 112)]
    ids = vision.expand(_render(tok, images), images)
    spans = vision.spans(ids, images)
    expansions = [vision.encode(im).tokens for im in images]
    assert [b - a for a, b in spans] == [len(e) for e in expansions]
    assert [tuple(ids[a:b]) for a, b in spans] == expansions
    assert sum(t == vision.image_token_id for t in ids) == sum(
        e.count(vision.image_token_id) for e in expansions)
    assert vision.collapse(ids, images) == _render(tok, images)
    pos = vision.positions(model, ids, images)
    kwargs = {} if pos is None else {"position_ids": pos[0][:, None]}
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **vision.model_inputs(images), **kwargs)
    a = ids.index(vision.image_token_id)
    with pytest.raises(ImageError, match="image tokens"):
        vision.spans(ids[:a] + ids[a + 1 :], images)


def test_qwen_token_count_follows_the_image_size_and_positions_are_3d():
    tok, model = load_tokenizer(TINY_QWEN2_VL), load_model(TINY_QWEN2_VL)
    vision = vision_processor(tok)
    small, large = _img(0, 28, 56), _img(1, 112, 112)
    assert vision.encode(small).num_tokens < vision.encode(large).num_tokens
    ids = vision.expand(_render(tok, [large]), [large])
    pos, offset = vision.positions(model, ids, [large])
    ((a, b),) = vision.spans(ids, [large])
    # Text positions advance by one per token; an image's rows and columns share positions.
    assert pos.shape == (3, len(ids))
    assert torch.equal(pos[0, :a], torch.arange(a))
    assert len(set(pos[1, a:b].tolist())) < b - a
    assert int(pos[0, -1]) + 1 == len(ids) + offset


def test_llava_has_plain_positions_and_fixed_counts():
    tok = load_tokenizer(TINY_LLAVA)
    vision = vision_processor(tok)
    assert vision.positions(load_model(TINY_LLAVA), [1, 2], []) is None
    assert vision.encode(_img(0, 30, 90)).num_tokens == vision.encode(_img(1, 112, 112)).num_tokens


def test_idefics3_expansion_and_pixels_are_its_processors(tmp_path):
    """Tiles, marks, newlines and pixels exactly as transformers' Idefics3Processor gives them,
    for images split into 2x2, 2x1 and 1x2 tiles, adjacent or not; the same from a saved
    directory (the processor settings vLLM reads are written there)."""
    from transformers import AutoProcessor

    from agentrl.models.vision import save_vlm, vision_processor_for

    tok, model = load_tokenizer(TINY_IDEFICS3), load_model(TINY_IDEFICS3)
    vision = vision_processor(tok)
    images = [_img(0), _img(1, 112, 56), _img(2, 30, 200), _img(3, 20, 20)]
    text = "a <image> b <image><image> c <image> d"
    ids = tok.encode(text, add_special_tokens=False)
    save_vlm(tmp_path, model, tok, vision.image_processor)
    processor = AutoProcessor.from_pretrained(str(tmp_path), backend="pil")
    assert type(processor).__name__ == "Idefics3Processor" and processor.image_seq_len == 4
    ref = processor(text=[text], images=[images], return_tensors="pt")
    for v in (vision, vision_processor_for(str(tmp_path))):
        assert v.expand(ids, images) == ref["input_ids"][0].tolist()
        got = v.model_inputs(images)
        assert set(got) == {"pixel_values", "pixel_attention_mask"}
        assert all(torch.equal(got[k], ref[k]) for k in got)
    assert [vision.encode(im).tokens.count(vision.image_token_id) for im in images] == \
        [4 * 5, 4 * 3, 4 * 3, 4 * 5]  # 4 tokens per tile: 2x2, 2x1, 1x2, 2x2 tiles + the whole
    expanded = vision.expand(ids, images)
    assert vision.collapse(expanded, images) == ids
    broken = list(expanded)
    broken[vision.spans(expanded, images)[1][0]] = tok.convert_tokens_to_ids("<global-img>")
    with pytest.raises(ImageError, match="not the ones its processor expands it to"):
        vision.spans(broken, images)


def test_keys_tell_screenshots_apart():
    tok = load_tokenizer(TINY_QWEN2_VL)
    vision = vision_processor(tok)
    a, b = _img(0), _img(1)
    ids = vision.expand(_render(tok, [a]), [a])
    ka, kb = vision.key_ids(ids, [a]), vision.key_ids(ids, [b])
    ((s, e),) = vision.spans(ids, [a])
    assert ka[:s] == kb[:s] == ids[:s] and ka[e:] == kb[e:]
    assert all(x < 0 for x in ka[s:e]) and ka[s:e] != kb[s:e]
    assert vision.key_ids(ids, [a.copy()]) == ka


def test_text_models_have_no_vision_processor():
    assert vision_processor(load_tokenizer("tiny")) is None


@pytest.mark.parametrize(("pixels", "match"), [
    (np.zeros((8, 8, 3), dtype=np.float32), "uint8"),
    (np.zeros((8, 8), dtype=np.uint8), "shape"),
    (np.zeros((1, 8, 3), dtype=np.uint8), "too small"),
    (np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (10_000, 10_000, 3)), "limit"),
])
def test_bad_images_get_a_clear_error(pixels, match):
    with pytest.raises(ImageError, match=match):
        check_image(pixels)


def test_wrong_number_of_images_for_the_placeholders():
    tok = load_tokenizer(TINY_LLAVA)
    vision = vision_processor(tok)
    with pytest.raises(ImageError, match="1 image placeholders for 2 images"):
        vision.expand(_render(tok, [_img(0)]), [_img(0), _img(1)])


def test_a_saved_vision_model_directory_loads_like_a_user_model(tmp_path):
    """`--actor.model DIR` for a VLM directory: the model class, tokenizer and image processor
    come back from the files (PIL image processing where torchvision is absent)."""
    from agentrl.models.tiny import tiny_vlm_parts

    model, tok = load_model(TINY_QWEN2_VL), load_tokenizer(TINY_QWEN2_VL)
    _, image_processor = tiny_vlm_parts(TINY_QWEN2_VL)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    image_processor.save_pretrained(tmp_path)
    loaded, ltok = load_model(str(tmp_path)), load_tokenizer(str(tmp_path))
    assert type(loaded) is type(model)
    vision = vision_processor(ltok)
    im = _img(3)
    assert vision is not None and vision.encode(im).num_tokens == vision_processor(
        tok).encode(im).num_tokens
    ids = vision.expand(_render(ltok, [im]), [im])
    pos = vision.positions(loaded, ids, [im])
    with torch.no_grad():
        a = loaded(input_ids=torch.tensor([ids]), position_ids=pos[0][:, None],
                   **vision.model_inputs([im])).logits
        b = model(input_ids=torch.tensor([ids]), position_ids=pos[0][:, None],
                  **vision.model_inputs([im])).logits
    torch.testing.assert_close(a, b)
