"""From sampled token ids to response text, incrementally: one code path for stream and not.

`ChoiceText` turns one choice's tokens into content deltas and tool calls: incremental
detokenization (the prefix/read-offset window vLLM uses, so a multi-byte character split across
tokens is held until complete), stop strings (text that may start a stop string is held back;
the stop string itself is never sent), then the tool parser. Non-streaming responses push all
tokens at once through the same object, so greedy stream and non-stream give the same text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from servers.deps import Tokenizer
from servers.tools import ParseEvent, ToolCall, ToolStreamParser


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Iterable[int]) -> str:
        self.ids.extend(t for t in token_ids if t not in self.skip_ids)
        if len(self.ids) == self._read:
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = decode(self.ids[self._prefix :], skip_special_tokens=True)
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


class ChoiceText:
    """Content and tool calls of one choice, fed token by token."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_ids: frozenset[int],
        stops: Sequence[str] = (),
        parser: ToolStreamParser | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_ids)
        self.stops = tuple(stops)
        self.parser = parser
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.finished = False
        self.calls: list[ToolCall] = []
        self.content = ""

    def push(self, token_ids: Sequence[int]) -> list[ParseEvent]:
        if self.stopped or self.finished:
            return []
        return self._route(self._filter_stops(self.detok.push(token_ids), final=False))

    def finish(self) -> list[ParseEvent]:
        if self.finished:
            return []
        events = []
        if not self.stopped:
            events = self._route(self._filter_stops(self.detok.flush(), final=True))
        self.finished = True
        if self.parser is not None:
            events.extend(self._collect(self.parser.finish()))
        return events

    def _filter_stops(self, delta: str, *, final: bool) -> str:
        self.text += delta
        if not self.stops:
            out, self._sent = self.text[self._sent :], len(self.text)
            return out
        longest = max(map(len, self.stops))
        start = max(0, self._sent - longest + 1)
        hits = [p for p in (self.text.find(s, start) for s in self.stops) if p >= 0]
        if hits:
            cut = min(hits)
            out = self.text[self._sent : cut]
            self._sent = cut
            self.stopped = True
            return out
        hold = 0 if final else max(_partial(self.text, s) for s in self.stops)
        end = len(self.text) - hold
        out, self._sent = self.text[self._sent : end], max(self._sent, end)
        return out

    def _route(self, text: str) -> list[ParseEvent]:
        if not text:
            return []
        if self.parser is None:
            self.content += text
            return [ParseEvent(content=text)]
        return self._collect(self.parser.feed(text))

    def _collect(self, events: list[ParseEvent]) -> list[ParseEvent]:
        for e in events:
            if e.call is not None:
                self.calls.append(e.call)
            else:
                self.content += e.content
        return events


def _partial(text: str, stop: str) -> int:
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def token_logprob_entries(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float] | None,
    top: Sequence[Sequence[tuple[int, float]]] | None,
    skip_ids: frozenset[int],
) -> list[dict]:
    """OpenAI `logprobs.content` entries for the (non-special) sampled tokens."""
    out = []
    for j, tid in enumerate(token_ids):
        if tid in skip_ids:
            continue
        text = tokenizer.decode([tid], skip_special_tokens=False)
        lp = min(0.0, float(logprobs[j])) if logprobs is not None else 0.0
        alts = []
        if top is not None and j < len(top):
            for alt_id, alt_lp in top[j]:
                alt_text = tokenizer.decode([alt_id], skip_special_tokens=False)
                alts.append(
                    {"token": alt_text, "logprob": min(0.0, float(alt_lp)),
                     "bytes": list(alt_text.encode())}
                )
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": alts})
    return out


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
