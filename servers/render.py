"""Turn OpenAI chat messages into prompt token ids through the model's own chat template.

Templates differ in what they understand. At start-up the renderer probes the template once:
does it render `tools`, assistant `tool_calls`, list-of-parts content? Whatever it cannot render
is rewritten into what it can, in the Hermes/Qwen convention the tool parser reads back:
tool schemas folded into the system message, tool calls as `<tool_call>{json}</tool_call>`
text, tool results as `<tool_response>` user turns. Images (decoded beforehand by
`servers.images.load_images`) become the template's placeholder, expanded by the model's
`VisionProcessor` exactly as for environments.

Everything a client sends (message text, names, tool-call arguments, tool schemas) is content:
a spelling of a special token in it is tokenized as plain text (`agentrl.envs.template.
PlainContent`), so only the template emits special tokens. A raw `/v1/completions` prompt is
the exception: there the client renders its own template, special tokens included.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.envs.template import ChatTemplateBridge, Escaper, TemplateError, plain_content
from agentrl.envs.tool_calls import fold_tools, template_renders_tools
from agentrl.models.vision import ImageError, VisionProcessor
from agentrl.types import Image
from servers.deps import Tokenizer
from servers.errors import APIError
from servers.openai_schemas import ChatMessage, TextPart, ToolCallIn, ToolDef

if TYPE_CHECKING:
    Message = dict[str, object]

_BRIDGES = 16  # incremental renderers kept, one per tool set

_PROBE = "agentrl_probe_fn"
@dataclass
class Rendered:
    """A prompt ready for the engine."""

    ids: list[int]
    images: list[Image] = field(default_factory=list)


class ChatRenderer:
    """Renders chat requests for one tokenizer (and optional image processor)."""

    def __init__(self, tokenizer: Tokenizer, processor: VisionProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self._plain = plain_content(tokenizer)
        self._bridges: dict[str, ChatTemplateBridge] = {}  # per tool set, for render_after
        self.supports_tools = template_renders_tools(tokenizer)
        self.supports_tool_calls = self._probe(
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": _PROBE, "arguments": {}},
                        }
                    ],
                },
            ]
        )
        self.supports_parts = self._probe(
            [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
        )
        # Qwen3-style templates show an earlier turn without its reasoning: a reply sent back
        # is then not continued from its sampled tokens when the template rewrites it.
        self.rewrites_history = self._drops_reasoning()

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Most UTF-8 bytes one token can stand for (a bound: a text of B bytes takes at least
        B / this many tokens), so a prompt far over the context is refused untokenized."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        # Byte-level BPE spells each byte as one character; otherwise allow 4 bytes a char.
        return longest if type(decoder).__name__ == "ByteLevel" else 4 * longest

    def _probe(self, messages: list[dict]) -> bool:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - any template failure means "not supported"
            return False
        return _PROBE in str(text)

    def _drops_reasoning(self) -> bool:
        """Whether the template renders a conversation's earlier reasoning away (and renders
        it at all: a template that fails here rewrites nothing this could tell)."""
        try:
            text = self.tokenizer.apply_chat_template([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": f"<think>\n{_PROBE}\n</think>\n\nok"},
                {"role": "user", "content": "and?"},
            ], add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render this rewrites nothing
            return False
        return _PROBE not in str(text)

    # -- chat -------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDef] | None,
        *,
        add_generation_prompt: bool = True,
        images: Sequence[np.ndarray] = (),
    ) -> Rendered:
        """`images`: the pixels of the messages' image_url parts, in order."""
        text, escaper = self._text(messages, tools, add_generation_prompt, images)
        return self._encode(text, list(images), escaper)

    def _text(self, messages: Sequence[ChatMessage], tools: Sequence[ToolDef] | None,
              add_generation_prompt: bool, images: Sequence[np.ndarray] = ()
              ) -> tuple[str, Escaper]:
        """The template's text of a request (client strings marked) and its escaper."""
        it = iter(images)
        escaper = self._plain.escaper()
        msgs = [self._message(m, it, escaper) for m in messages]
        tool_dicts = ([escaper.tree(t.model_dump(exclude_none=True)) for t in tools]
                      if tools else None)
        if tool_dicts and not self.supports_tools:
            msgs = fold_tools(msgs, tool_dicts)
            tool_dicts = None
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, tools=tool_dicts, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:
            raise APIError(
                400,
                f"the model's chat template cannot render these messages: {e}",
                param="messages",
            ) from e
        return str(text), escaper

    def rewrites(self, messages: Sequence[ChatMessage], upto: int,
                 tools: Sequence[ToolDef] | None) -> bool:
        """Whether the template renders `messages[:upto]` (a conversation ending with a reply
        this proxy gave) differently once the rest follows: it rewrote history, as Qwen3's
        drops the reasoning of turns before the last question. Then the model is shown the
        whole rendering, a new segment. Two renderings (no tokenization), and only for a
        template the start-up probe saw rewrite (`rewrites_history`)."""
        if not self.rewrites_history:
            return False
        try:
            before, marks = self._text(messages[:upto], tools, False)
            after, later = self._text(messages, tools, True)
        except APIError:  # cannot tell (a template that wants a user turn last): continue
            return False
        return not later.restore(after).startswith(marks.restore(before))

    def render_after(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[Image],
        action_ids: Sequence[int],
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDef] | None,
    ) -> Rendered | None:
        """The prompt that continues an earlier call's prompt and its sampled `action_ids`
        with `messages` (what came after the reply), rendered incrementally as environments
        are, so the sampled tokens are kept exactly. None where that cannot be done (images
        in the new messages, a template that cannot render increments): render it all."""
        if any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
               for m in messages):
            return None
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if tool_dicts and not self.supports_tools:
            tool_dicts = None  # folded into the system message: in the prefix, not the increment
        key = json.dumps(tool_dicts, sort_keys=True)
        try:
            bridge = self._bridges.get(key)
            if bridge is None:
                if len(self._bridges) >= _BRIDGES:
                    self._bridges.pop(next(iter(self._bridges)))
                bridge = self._bridges[key] = ChatTemplateBridge(self.tokenizer, tool_dicts)
            new = [self._message(m, iter(()), None) for m in messages]
            increment = bridge.observation_ids(action_ids, new)
        except TemplateError:
            return None
        return Rendered(ids=[*prompt_ids, *action_ids, *increment], images=list(images))

    def render_text(self, text: str) -> Rendered:
        """A raw prompt, tokenized as given (special-token spellings included)."""
        return Rendered(ids=self._plain.encode(text))

    def _encode(self, text: str, pixels: list[np.ndarray], escaper: Escaper) -> Rendered:
        ids = self._plain.encode(text, escaper)
        if not pixels:
            return Rendered(ids=ids)
        assert self.processor is not None  # load_images refuses images without a processor
        try:
            out = self.processor.expand(ids, pixels)
            spans = self.processor.spans(out, pixels)
        except ImageError as e:
            raise APIError(
                400, f"{e} (the message text may itself contain an image placeholder)",
                param="messages",
            ) from None
        placed = [Image(pixels=px, start=a, end=b)
                  for px, (a, b) in zip(pixels, spans, strict=True)]
        return Rendered(ids=out, images=placed)

    def _message(self, m: ChatMessage, images: Iterator[np.ndarray],
                 escaper: Escaper | None) -> dict:
        """A template-ready message; client strings marked by `escaper` (None: left as they
        are, for `ChatTemplateBridge`, which marks them itself)."""
        mark: Callable[[str], str] = escaper.text if escaper is not None else str
        tree: Callable[[Any], Any] = escaper.tree if escaper is not None else _same
        role = "system" if m.role == "developer" else m.role
        out: dict = {"role": role}
        if m.name is not None:
            out["name"] = mark(m.name)
        content: str | list[dict[str, Any]] | None
        if isinstance(m.content, list):
            parts = m.content
            pixels = [next(images) for p in parts if p.type == "image_url"]
            if self.supports_parts:
                px = iter(pixels)
                content = [
                    {"type": "text", "text": mark(p.text)} if p.type == "text"
                    else {"type": "image", "image": next(px)}
                    for p in parts
                ]
            else:
                image_text = (
                    self.processor.placeholder_text(self.tokenizer) if self.processor else ""
                )
                content = "".join(mark(p.text) if p.type == "text" else image_text
                                  for p in parts)
        else:
            content = m.content if m.content is None else mark(m.content)
        calls = [tree(_call_dict(c)) for c in m.tool_calls or ()]
        if calls and not self.supports_tool_calls:
            text = content if isinstance(content, str) else ""
            content = text + "".join(_hermes_call_text(c) for c in calls)
            calls = []
        if calls:
            out["tool_calls"] = calls
        if m.tool_call_id is not None:
            out["tool_call_id"] = mark(m.tool_call_id)
        if content is None and not self.supports_tool_calls:
            content = ""
        out["content"] = content
        return out


def _same(value: Any) -> Any:
    return value


def message_chars(messages: Sequence[ChatMessage], tools: Sequence[ToolDef] | None) -> int:
    """Characters of content in a request (text, names, tool calls, tool schemas): with
    `ChatRenderer.max_token_bytes`, a lower bound on its tokens that costs no tokenization."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text) for p in m.content if isinstance(p, TextPart))
        for call in m.tool_calls or ():
            args = call.function.arguments
            total += len(call.function.name) + len(args if isinstance(args, str) else
                                                   json.dumps(args))
    for t in tools or ():
        total += len(t.function.description or "") + len(json.dumps(t.function.parameters or {}))
    return total


def _call_dict(call: ToolCallIn) -> dict:
    fn = call.function
    args: object = fn.arguments
    if isinstance(args, str):
        # As vLLM does: templates (Qwen2.5, Hermes) expect a mapping and `tojson` it. The
        # request model has checked that the text is a JSON object (or empty).
        args = json.loads(args) if args.strip() else {}
    return {
        "id": call.id or "call_0",
        "type": "function",
        "function": {"name": fn.name, "arguments": args},
    }


def _hermes_call_text(call: dict) -> str:
    fn = call["function"]
    args = fn["arguments"]
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return (
        f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": {args_text}}}\n</tool_call>'
    )
