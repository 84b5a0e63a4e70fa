"""Chat-template rendering that never re-tokenizes what the policy sampled.

The bridge renders only what is new: the end of the assistant turn the policy did not write
(e.g. the newline after `<|im_end|>`), the new messages, and the generation prompt. It finds
those pieces by rendering a fixed base conversation with and without the new messages, so
templates that inject default system prompts or reformat history do not leak into the
increment. `check_drift` compares the running token sequence with a full re-render and says
how they differ; it never raises. Where the template rewrote history (a "template"
difference: it drops earlier reasoning), `rerender` gives what the template shows the model
next: the prompt of a new segment (`agentrl.segments`).

Images ride in list-of-parts content (`{"type": "image", "image": uint8 HxWx3}`). The template
renders one placeholder per image; the model's `VisionProcessor` expands each to the image's
tokens, in the increment that carries the image, so a new screenshot appends tokens and never
re-tokenizes earlier turns.

Only the template emits special tokens. Text that arrives in messages (tool output, an
environment's observation, a proxy client's content) is tokenized as plain text even when it
spells one (`<|im_end|>` then `<|im_start|>assistant`, printed by sandboxed code): `PlainContent`
swaps such spellings for private-use markers before rendering and tokenizes them back as text.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.envs import tool_calls
from agentrl.envs.tool_calls import template_renders_tools

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


_MARK = re.compile("\ue000([0-9]+)\ue001")


class Escaper:
    """One rendering's markers: each special-token spelling found in content becomes
    `\\ue000N\\ue001` (N its index here); `PlainContent.encode` turns it back into text."""

    def __init__(self, find: re.Pattern[str]) -> None:
        self._find = find
        self.table: list[str] = []

    def _mark(self, match: re.Match[str]) -> str:
        self.table.append(match.group(0))
        return f"\ue000{len(self.table) - 1}\ue001"

    def restore(self, rendered: str) -> str:
        """`rendered` with this escaper's markers turned back into the text they stand for."""
        if not self.table:
            return rendered
        return _MARK.sub(lambda m: self.table[int(m.group(1))], rendered)

    def text(self, value: str) -> str:
        """`value` with every special-token spelling (and stray marker start) marked."""
        return self._find.sub(self._mark, value)

    def tree(self, value: Any) -> Any:
        """Messages or tool schemas with every string marked (keys too: a template may print
        an argument's name), except the values of `role` and `type`, which the template
        branches on; images and other values are kept as they are."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.tree(k): v if k in ("role", "type") else self.tree(v)
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.tree(v) for v in value]
        return value


class PlainContent:
    """Tokenizes rendered chat text so that only the template's special tokens are special.

    `escaper()` marks content before rendering; `encode(text, escaper)` splits the rendered text
    at the special tokens left (all the template's), tokenizes the marked stretches with
    special-token spellings as plain text, and everything else as usual. Content without any
    such spelling takes the plain `encode` path: the same ids as tokenizing the whole text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
        for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(added, "special", False):
                specials.add(str(added.content))
        spellings = sorted((t for t in specials if t), key=len, reverse=True)
        alternatives = "|".join(re.escape(t) for t in spellings)
        self._find = re.compile(f"{alternatives}|\ue000" if alternatives else "\ue000")
        self._split = re.compile(alternatives) if alternatives else None
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._plain_backend: Any = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return plain_content, (self.tokenizer,)  # Envs are pickled mid-episode.

    def escaper(self) -> Escaper:
        return Escaper(self._find)

    def encode(self, text: str, escaper: Escaper | None = None) -> list[int]:
        """Ids of rendered `text`, its markers (from `escaper`) tokenized as plain text."""
        if escaper is None or not escaper.table:
            return self._encode(text)
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text) if self._split is not None else ():
            ids += self._encode_marked(text[start:match.start()], escaper.table)
            ids.append(int(self.tokenizer.convert_tokens_to_ids(match.group(0))))
            start = match.end()
        return ids + self._encode_marked(text[start:], escaper.table)

    def _encode(self, text: str) -> list[int]:
        # The Rust tokenizer directly where there is one: the Python wrapper costs ~0.2 ms.
        if self._backend is not None:
            return _rust_ids(self._backend, text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_marked(self, text: str, table: list[str]) -> list[int]:
        if not text:
            return []
        if "\ue000" not in text:
            return self._encode(text)
        restored = _MARK.sub(lambda m: table[int(m.group(1))], text)
        if self._backend is None:
            return list(self.tokenizer.encode(restored, add_special_tokens=False,
                                              split_special_tokens=True))
        return _rust_ids(self._plain(), restored)

    def _plain(self) -> Any:
        """A copy of the Rust tokenizer that reads special-token spellings as text (a copy,
        as flipping the shared one's flag would race with other threads' encodes)."""
        with self._lock:
            if self._plain_backend is None:
                from tokenizers import Tokenizer

                plain = Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain_backend = plain
            return self._plain_backend


_GIL_FREE_CHARS = 1 << 14


def _rust_ids(backend: Any, text: str) -> list[int]:
    """Ids from a Rust tokenizer. A long text goes through `encode_batch`, which lets go of
    the GIL while it works (`encode` holds it: 150 ms for 360 KB, during which a server's event
    loop, in another thread, could not run); the ids are the same."""
    if len(text) > _GIL_FREE_CHARS:
        return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
    return list(backend.encode(text, add_special_tokens=False).ids)


_plain_cache: weakref.WeakKeyDictionary[Any, PlainContent] = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()


def plain_content(tokenizer: Any) -> PlainContent:
    """The tokenizer's `PlainContent`, made once per tokenizer object."""
    with _plain_lock:
        try:
            found = _plain_cache.get(tokenizer)
        except TypeError:  # Not weak-referenceable: build one per call.
            return PlainContent(tokenizer)
        if found is None:
            found = _plain_cache[tokenizer] = PlainContent(tokenizer)
        return found


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
        vision: VisionProcessor | None = None, *, fold_tools: bool = True,
    ) -> None:
        """`vision`: the model's image processor path; default: the one the tokenizer's model
        has (`agentrl.models.vision.vision_processor`), looked up at the first image.
        `fold_tools`: where the template ignores `tools`, show them in the system message."""
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                f"template; set tokenizer.chat_template (a Jinja string) before using chat envs"
            )
        self.tools = list(tools) if tools else None
        # A template that ignores `tools` (SmolLM2's) would show the policy none: they go into
        # the conversation's system message instead (agentrl.envs.tool_calls).
        self.folded_tools: list[dict] | None = None
        if self.tools and not template_renders_tools(tokenizer):
            self.folded_tools = self.tools if fold_tools else None
            self.tools = None
        tools = self.tools
        self._base_text = render_text(tokenizer, _BASE, add_generation_prompt=False, tools=tools)
        at = self._base_text.find(_CANARY)
        if at < 0:
            raise TemplateError("the chat template does not render assistant content verbatim")
        self.assistant_suffix = self._base_text[at + len(_CANARY) :]
        self.eos_ids = _end_of_turn_ids(tokenizer)
        self._vision: VisionProcessor | None = vision
        self._plain = plain_content(tokenizer)

    def _ids(self, messages: Sequence[Message], *, add_generation_prompt: bool,
             head: str = "", skip: int = 0) -> list[int]:
        """Render `messages` (their content as plain text), drop the first `skip` characters
        of the rendering, put `head` (template text) before it and tokenize."""
        escaper = self._plain.escaper()
        text = render_text(self.tokenizer, escaper.tree(list(messages)),
                           add_generation_prompt=add_generation_prompt, tools=self.tools)
        if skip and not text.startswith(self._base_text):
            raise TemplateError(
                "rendering new messages changed the earlier conversation; this chat template "
                "cannot be rendered incrementally"
            )
        return self._plain.encode(head + text[skip:], escaper)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The tokens of a conversation's first messages, with the generation prompt."""
        ids = self._ids(self._with_tools(messages), add_generation_prompt=True)
        return self._expand(ids, message_images(messages))

    def _with_tools(self, messages: Sequence[Message]) -> list[Message]:
        """A whole conversation as rendered: with the tool schemas folded into its system
        message where the template ignores `tools`."""
        if self.folded_tools is None:
            return list(messages)
        return tool_calls.fold_tools(messages, self.folded_tools)

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

    def action_ids(self, text: str) -> list[int]:
        """The tokens of an assistant turn saying `text`, as a policy that wrote it samples
        them: the text's canonical tokenization (special-token spellings stay text) and the
        end-of-turn token. What supervised fine-tuning trains on."""
        escaper = self._plain.escaper()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            eos = min(self.eos_ids)
        return self._plain.encode(escaper.text(text), escaper) + [eos]

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
        ids = self._ids([*_BASE, *new_messages], add_generation_prompt=True,
                        head=self._rest_of_assistant_turn(action_ids),
                        skip=len(self._base_text))
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
        return self.rerender(messages, running_ids, turn=turn, open_turn=open_turn)[0]

    def rerender(
        self, messages: Sequence[Message], running_ids: Sequence[int], *, turn: int, open_turn: bool
    ) -> tuple[DriftReport | None, list[int]]:
        """A full re-render of `messages` (with the generation prompt where the turn is open)
        and how the running ids differ from it (None: they do not). A "template" difference is
        where a new segment starts: the ids are what the template shows the model next."""
        escaper = self._plain.escaper()
        text = render_text(
            self.tokenizer, escaper.tree(self._with_tools(messages)),
            add_generation_prompt=open_turn, tools=self.tools,
        )
        if not open_turn and text.endswith(self.assistant_suffix):
            # A finished episode's sequence ends at the policy's last token, not the template's.
            text = text[: len(text) - len(self.assistant_suffix)]
            if running_ids and running_ids[-1] in self.eos_ids:
                text += self.tokenizer.decode([running_ids[-1]], skip_special_tokens=False)
        ids = self._expand(self._plain.encode(text, escaper), message_images(messages))
        if ids == list(running_ids):
            return None, ids
        running_text = self.tokenizer.decode(list(running_ids), skip_special_tokens=False)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)  # images expanded too
        if running_text == text:
            return DriftReport("tokenization", _first_mismatch(ids, running_ids), turn), ids
        return DriftReport("template", _first_mismatch_text(text, running_text), turn), ids


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
