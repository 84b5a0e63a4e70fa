"""Chat-template rendering that never re-tokenizes what the policy sampled.

The bridge renders only what is new: the end of the assistant turn the policy did not write
(e.g. the newline after `<|im_end|>`), the new messages, and the generation prompt. It finds
those pieces by rendering a fixed base conversation with and without the new messages, so
templates that inject default system prompts or reformat history do not leak into the
increment. `check_drift` compares the running token sequence with a full re-render and says
how they differ; it never raises.

Images ride in list-of-parts content (`{"type": "image", "image": uint8 HxWx3}`). The template
renders one placeholder per image; the model's `VisionProcessor` expands each to the image's
tokens, in the increment that carries the image, so a new screenshot appends tokens and never
re-tokenizes earlier turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from agentrl.models.vision import VisionProcessor

Message = dict[str, Any]

_CANARY = "\u2063agentrl-canary\u2063"
_BASE: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _CANARY},
]


class TemplateError(ValueError):
    """The chat template cannot be rendered incrementally."""


def render_text(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    tools: Sequence[dict] | None = None,
) -> str:
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Tokenize text that already contains every special token it needs."""
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class DriftReport:
    """How the running token sequence differs from a full re-render of the conversation.

    kind: "template" when the texts differ (the template rewrites history, e.g. drops
    reasoning); "tokenization" when the text is the same but the ids differ (the policy
    sampled a non-canonical tokenization, which we keep: it is what it sampled).
    """

    kind: str
    position: int
    turn: int

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, "turn": self.turn}


class ChatTemplateBridge:
    """Turns message lists into token increments for one tokenizer (and optional tools)."""

    def __init__(
        self, tokenizer: Any, tools: Sequence[dict] | None = None,
        vision: VisionProcessor | None = None,
    ) -> None:
        """`vision`: the model's image processor path; default: the one the tokenizer's model
        has (`agentrl.models.vision.vision_processor`), looked up at the first image."""
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                f"template; set tokenizer.chat_template (a Jinja string) before using chat envs"
            )
        self._base_text = render_text(tokenizer, _BASE, add_generation_prompt=False, tools=tools)
        at = self._base_text.find(_CANARY)
        if at < 0:
            raise TemplateError("the chat template does not render assistant content verbatim")
        self.assistant_suffix = self._base_text[at + len(_CANARY) :]
        self.eos_ids = _end_of_turn_ids(tokenizer)
        self._vision: VisionProcessor | None = vision

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        text = render_text(self.tokenizer, messages, add_generation_prompt=True, tools=self.tools)
        return self._expand(encode(self.tokenizer, text), message_images(messages))

    def _expand(self, ids: list[int], images: Sequence[np.ndarray]) -> list[int]:
        """Replace each image placeholder with its image's tokens (text-only: `ids`)."""
        if not images:
            return ids
        if self._vision is None:
            from agentrl.models.vision import ImageError, vision_processor

            self._vision = vision_processor(self.tokenizer)
            if self._vision is None:
                name = getattr(self.tokenizer, "name_or_path", "")
                raise ImageError(
                    f"the conversation has images but {name!r} is a text-only model; use a "
                    f"vision-language model (e.g. a Qwen2-VL directory)"
                )
        return self._vision.expand(ids, images)

    def split_action(self, action_ids: Sequence[int]) -> tuple[str, bool]:
        """Decode the policy's action to message text; say whether it closed its turn itself."""
        ids = list(action_ids)
        closed = bool(ids) and ids[-1] in self.eos_ids
        body = ids[:-1] if closed else ids
        return self.tokenizer.decode(body, skip_special_tokens=False), closed

    def observation_ids(
        self, action_ids: Sequence[int], new_messages: Sequence[Message]
    ) -> list[int]:
        """Tokens to append after the policy's action: the rest of its turn's closing text,
        the new messages, and the generation prompt for the next action."""
        text = self._rest_of_assistant_turn(action_ids)
        full = render_text(
            self.tokenizer, [*_BASE, *new_messages], add_generation_prompt=True, tools=self.tools
        )
        if not full.startswith(self._base_text):
            raise TemplateError(
                "rendering new messages changed the earlier conversation; this chat template "
                "cannot be rendered incrementally"
            )
        ids = encode(self.tokenizer, text + full[len(self._base_text) :])
        return self._expand(ids, message_images(new_messages))

    def _rest_of_assistant_turn(self, action_ids: Sequence[int]) -> str:
        if action_ids and action_ids[-1] in self.eos_ids:
            eos_text = self.tokenizer.decode([action_ids[-1]], skip_special_tokens=False)
            if self.assistant_suffix.startswith(eos_text):
                return self.assistant_suffix[len(eos_text) :]
        # The policy stopped without closing its turn (length limit): close it for it. These
        # are observation tokens, so they carry no loss.
        return self.assistant_suffix

    def check_drift(
        self, messages: Sequence[Message], running_ids: Sequence[int], *, turn: int, open_turn: bool
    ) -> DriftReport | None:
        """Compare the running ids with a full re-render of `messages`."""
        text = render_text(
            self.tokenizer, messages, add_generation_prompt=open_turn, tools=self.tools
        )
        if not open_turn and text.endswith(self.assistant_suffix):
            # A finished episode's sequence ends at the policy's last token, not the template's.
            text = text[: len(text) - len(self.assistant_suffix)]
            if running_ids and running_ids[-1] in self.eos_ids:
                text += self.tokenizer.decode([running_ids[-1]], skip_special_tokens=False)
        ids = self._expand(encode(self.tokenizer, text), message_images(messages))
        if ids == list(running_ids):
            return None
        running_text = self.tokenizer.decode(list(running_ids), skip_special_tokens=False)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)  # images expanded too
        if running_text == text:
            return DriftReport("tokenization", _first_mismatch(ids, running_ids), turn)
        return DriftReport("template", _first_mismatch_text(text, running_text), turn)


def message_images(messages: Sequence[Message]) -> tuple[np.ndarray, ...]:
    """Images carried in list-of-parts content: {"type": "image", "image": uint8 HxWx3}."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image" and "image" in part:
                    out.append(np.asarray(part["image"], dtype=np.uint8))
    return tuple(out)


def _end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    ids = set()
    for name in ("eos_token_id",):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return frozenset(ids)


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _first_mismatch_text(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
