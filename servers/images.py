"""`image_url` content parts -> pixels, before a request is rendered.

Base64 `data:` URLs are always accepted. `http(s)` URLs are fetched only when the server was
started with `--allow-image-urls` (`ProxyConfig.allow_image_urls`), with a byte cap and a
timeout, by an async client: a slow image server never blocks the event loop, nor does decoding
(it runs in a worker thread). Every failure is an OpenAI-shaped 400 naming what to fix, raised
before anything is generated or recorded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from collections.abc import Sequence

import httpx
import numpy as np

from agentrl.http_client import async_http_client
from agentrl.models.vision import MAX_IMAGE_PIXELS, ImageError, check_image
from servers.config import ProxyConfig
from servers.errors import APIError
from servers.openai_schemas import ChatMessage


def image_urls(messages: Sequence[ChatMessage]) -> list[str]:
    """The `image_url` URLs of the messages, in order."""
    return [
        p.image_url.url
        for m in messages if isinstance(m.content, list)
        for p in m.content if p.type == "image_url"
    ]


async def load_images(
    messages: Sequence[ChatMessage], config: ProxyConfig, *, vision: bool
) -> list[np.ndarray]:
    """Decode (and, if allowed, fetch) every image of the request, in order."""
    urls = image_urls(messages)
    if not urls:
        return []
    if not vision:
        raise _bad("this model has no image processor, so it cannot take image_url parts; send "
                   "text only or serve a vision-language model")
    if len(urls) > config.max_images_per_request:
        raise _bad(f"{len(urls)} images in one request; this server takes at most "
                   f"{config.max_images_per_request} (--max-images-per-request)")
    data = await asyncio.gather(*(_bytes(url, config) for url in urls))
    return list(await asyncio.gather(*(asyncio.to_thread(_decode, d) for d in data)))


async def _bytes(url: str, config: ProxyConfig) -> bytes:
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not (head.startswith("data:image/") and sep and head.endswith(";base64")):
            raise _bad("image_url data URLs must be base64 images: data:image/png;base64,...")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(f"image_url base64 data is invalid or truncated: {e}") from None
    if not url.startswith(("http://", "https://")):
        raise _bad("image_url must be a data: URL (or http(s) when the server allows it)")
    if not config.allow_image_urls:
        raise _bad("this server does not fetch image URLs; send the image as a base64 data: "
                   "URL, or start the server with --allow-image-urls")
    cap = config.image_url_max_bytes
    try:
        async with async_http_client(timeout_s=config.image_url_timeout_s, retries=2,
                                     follow_redirects=True) as client, \
                client.stream("GET", url) as r:
            if r.status_code != 200:
                raise _bad(f"fetching image {url!r} answered HTTP {r.status_code}")
            out = bytearray()
            async for chunk in r.aiter_bytes():
                out += chunk
                if len(out) > cap:
                    raise _bad(f"image at {url!r} is larger than {cap} bytes "
                               f"(--image-url-max-bytes)")
            return bytes(out)
    except httpx.TimeoutException:
        raise _bad(f"fetching image {url!r} took longer than {config.image_url_timeout_s} s"
                   ) from None
    except httpx.HTTPError as e:
        raise _bad(f"fetching image {url!r} failed: {e}") from None


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image as PILImage

    try:
        with warnings.catch_warnings():  # we refuse large images ourselves, below
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data))
        w, h = img.size  # from the header: a huge image is refused before it is decoded
        if w * h > MAX_IMAGE_PIXELS:
            raise _bad(f"image of {w}x{h} pixels is over the {MAX_IMAGE_PIXELS:,}-pixel limit; "
                       f"resize it before sending")
        pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except APIError:
        raise
    except (OSError, ValueError, PILImage.DecompressionBombError) as e:
        raise _bad(f"image_url data could not be decoded as an image: {e}") from None
    try:
        return check_image(pixels)
    except ImageError as e:
        raise _bad(str(e)) from None


def _bad(message: str) -> APIError:
    return APIError(400, message, param="messages")
