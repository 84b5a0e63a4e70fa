"""Images through the proxy: `image_url` parts reach a vision-language model expanded by its
processor and are recorded in the session; bad images get OpenAI-shaped 400s before anything is
generated or recorded; remote URLs only when allowed, fetched without blocking the server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import openai
import pytest

from agentrl.models import load_tokenizer
from agentrl.models.vision import vision_processor


@pytest.fixture(scope="module")
def vlm_tok():
    return load_tokenizer("tiny-llava")


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _img(seed: int, h: int = 20, w: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _user(*urls: str, text: str = "look") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]
            + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


def test_images_are_expanded_by_the_models_processor_and_recorded(make_proxy, vlm_tok):
    p = make_proxy(tokenizer=vlm_tok)
    c = p.client("vlm")
    a, b = _img(0), _img(1, 40, 10)
    msgs = [_user(_data_url(_png(a)))]
    r = c.chat.completions.create(model="agentrl", messages=msgs)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             _user(_data_url(_png(b)), text="and this?")]
    c.chat.completions.create(model="agentrl", messages=msgs)
    assert p.engine.requests[-1][2] == 2  # the engine got both images
    (traj,) = p.store.get("vlm").trajectories()
    vision = vision_processor(vlm_tok)
    assert [im.end - im.start for im in traj.images] == [16, 16]  # LLaVA: 4x4 patches each
    for im, want in zip(traj.images, [a, b], strict=True):
        assert np.array_equal(im.pixels, want)  # PNG round trip is lossless
        assert set(traj.token_ids[im.start : im.end]) == {vision.image_token_id}


def test_qwen_images_take_tokens_by_size(make_proxy):
    tok = load_tokenizer("tiny-qwen2-vl")
    p = make_proxy(tokenizer=tok)
    small, large = _img(0, 28, 28), _img(1, 112, 112)
    p.client("q").chat.completions.create(
        model="agentrl", messages=[_user(_data_url(_png(small)), _data_url(_png(large)))])
    (traj,) = p.store.get("q").trajectories()
    vision = vision_processor(tok)
    assert [im.end - im.start for im in traj.images] == [
        vision.encode(small).num_tokens, vision.encode(large).num_tokens]
    assert traj.images[0].end - traj.images[0].start < traj.images[1].end - traj.images[1].start


def _huge_png_header(w: int, h: int) -> bytes:
    """A PNG whose header says w x h (its data is a small image's): enough to be refused."""
    png = bytearray(_png(_img(0, 2, 2)))
    ihdr = struct.pack(">II", w, h) + png[24:29]
    png[16:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(png)


@pytest.mark.parametrize(("url", "match"), [
    ("data:image/png;base64," + base64.b64encode(_png(_img(0))).decode()[:-3],
     "invalid or truncated"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "could not be decoded"),
    ("data:text/plain;base64,aGk=", "base64 images"),
    ("http://127.0.0.1:1/x.png", "--allow-image-urls"),
    ("ftp://example.com/x.png", "data: URL"),
])
def test_bad_image_urls_are_400s_and_nothing_is_recorded(make_proxy, vlm_tok, url, match):
    p = make_proxy(tokenizer=vlm_tok)
    with pytest.raises(openai.BadRequestError, match=match) as err:
        p.client("s").chat.completions.create(model="agentrl", messages=[_user(url)])
    assert err.value.body["param"] == "messages"  # type: ignore[index]
    assert p.engine.requests == []
    assert not p.store.get("s") or p.store.get("s").trajectories() == []
    r = p.client("s").chat.completions.create(model="agentrl", messages=[_user()])
    assert r.choices[0].message.content  # the server lives on


def test_a_100_megapixel_image_is_refused_from_its_header(make_proxy, vlm_tok):
    p = make_proxy(tokenizer=vlm_tok)
    url = _data_url(_huge_png_header(10_000, 10_000))
    with pytest.raises(openai.BadRequestError, match="10000x10000 pixels is over"):
        p.client().chat.completions.create(model="agentrl", messages=[_user(url)])


def test_more_images_than_allowed(make_proxy, vlm_tok):
    p = make_proxy(tokenizer=vlm_tok, max_images_per_request=2)
    url = _data_url(_png(_img(0)))
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        p.client().chat.completions.create(model="agentrl", messages=[_user(url, url, url)])


def test_images_to_a_text_model_are_refused(proxy):
    with pytest.raises(openai.BadRequestError, match="no image processor"):
        proxy.client().chat.completions.create(
            model="agentrl", messages=[_user(_data_url(_png(_img(0))))])


def test_an_image_placeholder_typed_in_the_text_stays_text(make_proxy, vlm_tok):
    """Client text is content: `<image>` typed in it is tokenized as text (#19 item 5), so it
    neither expands into image tokens nor throws the image count off (it was a 400 before)."""
    p = make_proxy(tokenizer=vlm_tok)
    p.client("typed").chat.completions.create(
        model="agentrl", messages=[_user(_data_url(_png(_img(0))), text="see <image>")])
    (traj,) = p.store.get("typed").trajectories()
    vision = vision_processor(vlm_tok)
    assert [im.end - im.start for im in traj.images] == [16]
    assert traj.token_ids.count(vision.image_token_id) == 16
    assert "see <image>" in vlm_tok.decode(traj.token_ids)


class _ImageServer(BaseHTTPRequestHandler):
    png = b""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(3)
        body = self.png if self.path != "/big.png" else self.png * 400
        if self.path == "/missing.png":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    _ImageServer.png = _png(_img(5))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_image_urls_when_allowed(make_proxy, vlm_tok, image_server):
    p = make_proxy(tokenizer=vlm_tok, allow_image_urls=True, image_url_max_bytes=100_000,
                   image_url_timeout_s=1.0)
    c = p.client("r")
    c.chat.completions.create(model="agentrl", messages=[_user(f"{image_server}/ok.png")])
    (traj,) = p.store.get("r").trajectories()
    assert np.array_equal(traj.images[0].pixels, _img(5))
    for path, match in [("/big.png", "larger than 100000 bytes"), ("/missing.png", "HTTP 404"),
                        ("/slow.png", "longer than 1.0 s")]:
        with pytest.raises(openai.BadRequestError, match=match):
            c.chat.completions.create(model="agentrl", messages=[_user(image_server + path)])


def test_a_slow_image_url_does_not_block_other_requests(make_proxy, vlm_tok, image_server):
    p = make_proxy(tokenizer=vlm_tok, allow_image_urls=True, image_url_timeout_s=5.0)

    async def main() -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=p.url, timeout=30) as client:
            slow = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": "agentrl", "messages": [_user(f"{image_server}/slow.png")]}))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={
                "model": "agentrl", "messages": [{"role": "user", "content": "hi"}]})
            took = time.perf_counter() - t0
            assert (await slow).status_code == 200
            return took, r.status_code

    took, status = asyncio.run(main())
    assert status == 200 and took < 1.5  # answered while the slow image was still loading
