"""Constrained decoding: grammars a completion must match, and the token masks that enforce them.

A constraint travels as `SamplingParams.grammar`, a grammar in xgrammar's EBNF dialect
(https://xgrammar.mlc.ai), so every engine takes the same thing: vLLM compiles it with its own
xgrammar backend (`StructuredOutputsParams(grammar=...)`), the transformers engine with
`GrammarMasks` below. The builders here turn what users write (a JSON schema, "any JSON object",
tool-call formats) into that text, and raise `GrammarError` with the reason where the grammar
library cannot compile it.

Tokens the grammar forbids get probability 0 before anything else touches the logits, so the
logprobs an engine reports, raw or processed, are of the masked distribution: the one sampled
from (vLLM applies its bitmask at the same point, before its sampler).

What a grammar costs is bounded (#34 item 4: an enum of 10^5 strings took ~42 s and went on
after its client had gone). A schema is refused (`GrammarTooComplexError`) past the limits
below, which bound turning it into a grammar; compiling that grammar for a tokenizer still
costs what no limit predicts (2000 optional properties: 12 s with a 384-token vocabulary;
5000: 72 s with 49K tokens), so `GrammarMasks` tries it in a worker process first, killed when
the compile runs past its timeout or when nobody waits for it any more. Both steps are cached by
a hash of what they were given, within a memory bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentrl.engine.grammar_worker import (
    LIBRARY_ERRORS,
    TrialFailed,
    TrialTimedOut,
    TrialWorkers,
    trial_workers,
)

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

MAX_WHITESPACE = 2
"""Longest run of whitespace allowed between JSON tokens: small models, once inside a JSON
value, can otherwise emit newlines until max_tokens."""


MAX_SCHEMA_BYTES = 256 * 1024
"""Largest schema (as JSON) turned into a grammar; 1.5 MB took 0.6 s."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a schema's JSON: turning 100 nested arrays into a grammar took 3 s and
1000 (a 25 KB schema) 150 s, a 27 MB grammar."""
MAX_ENUM_VALUES = 1000
"""Most `enum` and `const` values in a schema (OpenAI's limit): compiling 1000 takes 0.1 s;
10^4, 5 s with a 384-token vocabulary; 3x10^4, 81 s with 49K tokens."""
COMPILE_TIMEOUT_S = 20.0
"""Longest a grammar may take to compile for a tokenizer, on trial (a schema with a string
length bound takes ~5 s with a 49K-token vocabulary on 2 cores)."""


class GrammarError(ValueError):
    """A schema or grammar the grammar library cannot compile."""


class GrammarTooComplexError(GrammarError):
    """A schema past a limit above, or a grammar that did not compile within its timeout."""


def _library_error(what: str, e: Exception) -> GrammarError:
    return GrammarError(f"{what} cannot be compiled into a grammar: "
                        f"{_reason(str(e) or type(e).__name__)}")


def _reason(message: str) -> str:
    # xgrammar prefixes messages with a timestamp and the C++ source line; keep the reason.
    reason = message.strip().splitlines()[0] if message.strip() else message
    if "] " in reason and reason.startswith("["):
        reason = reason.split(": ", 1)[-1] if ": " in reason else reason
    return reason


def check_schema(value: object, what: str) -> str:
    """`value` as JSON, or a GrammarTooComplexError naming `what` and the limit where the
    schema is past one of those above. Walked with a stack: a deep schema cannot exhaust the
    recursion limit (json.dumps would, at about 1000 levels)."""
    values, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarTooComplexError(
                f"{what}: nested deeper than {MAX_SCHEMA_DEPTH} levels (objects and arrays "
                f"inside each other), the limit for a schema that constrains sampling; "
                f"flatten it")
        if isinstance(node, dict):
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    text = json.dumps(value)
    if len(text) > MAX_SCHEMA_BYTES:
        raise GrammarTooComplexError(
            f"{what}: {len(text)} bytes of JSON, over the limit of {MAX_SCHEMA_BYTES} for a "
            f"schema that constrains sampling; send a smaller schema")
    if values > MAX_ENUM_VALUES:
        raise GrammarTooComplexError(
            f"{what}: {values} enum and const values, over the limit of {MAX_ENUM_VALUES} "
            f"(the grammar's compile time grows with them: 3x10^4 took over a minute); use "
            f"fewer, or a plain string checked after sampling")
    return text


def json_schema_grammar(schema: dict[str, Any] | bool, *, what: str = "the JSON schema") -> str:
    """A grammar for JSON text valid under `schema` (additional properties only where the schema
    allows them explicitly, as OpenAI's strict mode). GrammarTooComplexError past the limits."""
    import xgrammar as xgr

    def build(text: str) -> str:
        return str(xgr.Grammar.from_json_schema(
            text, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE))

    return _converted("json_schema", schema, build, what)


def json_object_grammar() -> str:
    """A grammar for any JSON object (OpenAI's `response_format: json_object`)."""
    return json_schema_grammar({"type": "object"})


def structural_tag_grammar(fmt: dict[str, Any], *, what: str = "the tool schemas") -> str:
    """A grammar from an xgrammar structural-tag format (tags, triggers, separators), whose
    schemas count against the limits together."""
    import xgrammar as xgr

    def build(text: str) -> str:
        return str(xgr.Grammar.from_structural_tag(
            f'{{"type": "structural_tag", "format": {text}}}'))

    return _converted("structural_tag", fmt, build, what)


def union_grammar(*grammars: str) -> str:
    """A grammar matching what any of `grammars` matches."""
    import xgrammar as xgr

    key = _digest("union", *grammars)
    if (hit := _CONVERTED.get(key)) is not None:
        return hit
    grammar = str(xgr.Grammar.union(*(xgr.Grammar.from_ebnf(g) for g in grammars)))
    _CONVERTED.put(key, grammar, len(grammar))
    return grammar


def _converted(kind: str, value: object, build: Callable[[str], str], what: str) -> str:
    """`build(value as JSON)`, from the cache when this very JSON was built before."""
    text = check_schema(value, what)
    key = _digest(kind, text)
    if (hit := _CONVERTED.get(key)) is not None:
        return hit
    try:
        grammar = build(text)
    except LIBRARY_ERRORS as e:
        raise _library_error(what, e) from None
    _CONVERTED.put(key, grammar, len(grammar))
    return grammar


def _digest(*parts: str) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.digest()


class _BoundedCache:
    """Least recently used values, up to `max_bytes` of them in all (by the size given with
    each); one bigger than that is not kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: bytes, value: object, size: int) -> None:
        with self._lock:
            if key in self._items or size > self.max_bytes:
                return
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


_CONVERTED = _BoundedCache(64 * 2**20)
"""Grammars built from schemas and formats (their text), by a hash of what they were built
from."""


def check_grammar(ebnf: str) -> None:
    """Raise GrammarError unless `ebnf` parses as an xgrammar grammar."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_ebnf(ebnf)
    except LIBRARY_ERRORS as e:
        raise _library_error("the grammar", e) from None


class GrammarMasks:
    """Compiles grammars for one tokenizer and masks logits.

    `vocab_size` is the width of the model's logits (often more than the tokenizer's ids);
    `stop_ids` are the tokens that end a completion, the only ones a finished grammar allows.
    `compile` tries a grammar in one of the tokenizer's worker processes first (up to
    `num_workers`, shared by every engine of the tokenizer), killed past `compile_timeout_s` or
    when nobody waits any more (`agentrl.engine.grammar_worker`); compiled grammars are kept
    (by a hash of their text) up to `cache_bytes`. Matchers and masks are used by the engine's
    worker thread.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 stop_ids: Collection[int], *, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 num_workers: int = 2, cache_bytes: int = 256 * 2**20) -> None:
        if not compile_timeout_s > 0 or num_workers < 1:
            raise ValueError(f"compile_timeout_s must be > 0 and num_workers >= 1, got "
                             f"{compile_timeout_s} and {num_workers}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self.compile_timeout_s = compile_timeout_s
        self._num_workers = num_workers
        self._compiler: tuple[xgr.GrammarCompiler, TrialWorkers] | None = None
        self._lock = threading.Lock()
        self._compiled = _BoundedCache(cache_bytes)
        self._pending: dict[bytes, _Pending] = {}

    async def compile(self, ebnf: str) -> xgr.CompiledGrammar:
        """`ebnf` compiled for the tokenizer: GrammarError where it cannot be, and
        GrammarTooComplexError where it takes longer than `compile_timeout_s`. Requests for
        the same grammar share one compile, stopped when every one of them is cancelled."""
        key = _digest(ebnf)
        if (hit := self._compiled.get(key)) is not None:
            return hit
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is None or pending.task.get_loop() is not loop:
            pending = _Pending(loop.create_task(self._compile(key, ebnf)))
            self._pending[key] = pending
            pending.task.add_done_callback(lambda _: self._forget(key, pending))
        pending.waiting += 1
        try:
            return await asyncio.shield(pending.task)
        finally:
            pending.waiting -= 1
            if pending.waiting == 0 and not pending.task.done():
                self._forget(key, pending)
                pending.task.cancel()  # its clients are gone: stop compiling

    def _forget(self, key: bytes, pending: _Pending) -> None:
        if self._pending.get(key) is pending:
            del self._pending[key]

    async def _compile(self, key: bytes, ebnf: str) -> xgr.CompiledGrammar:
        """On trial in a worker first, then here (uncancellable, but shown to be bounded)."""
        timeout = self.compile_timeout_s
        compiler, workers = await asyncio.to_thread(self._grammar_compiler)
        try:
            await workers.trial(ebnf, timeout)
        except TrialFailed as e:
            raise GrammarError(f"the grammar cannot be compiled: {_reason(str(e))}") from None
        except TrialTimedOut:
            raise GrammarTooComplexError(
                f"the grammar did not compile within {timeout:g} s, this server's limit: "
                f"simplify the schema behind it (fewer optional properties, enum values, "
                f"string length bounds or alternatives)") from None
        try:
            compiled = await asyncio.to_thread(compiler.compile_grammar, ebnf)
        except LIBRARY_ERRORS as e:
            raise _library_error("the grammar", e) from None
        self._compiled.put(key, compiled, compiled.memory_size_bytes)
        return compiled

    def _grammar_compiler(self) -> tuple[xgr.GrammarCompiler, TrialWorkers]:
        """A compiler for the tokenizer, and the trial workers of the tokenizer (blocking:
        made once, it scans the vocabulary, 0.3-0.7 s for 49K tokens)."""
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
                self._compiler = (xgr.GrammarCompiler(info, cache_enabled=False),
                                  trial_workers(info.serialize_json(), self._num_workers))
            return self._compiler

    @property
    def trials_running(self) -> int:
        """Grammars on trial now in this tokenizer's workers (shared by its engines)."""
        return self._compiler[1].running if self._compiler is not None else 0

    @property
    def killed(self) -> int:
        """Trials stopped by killing their worker (timed out, or nobody waited), in this
        tokenizer's workers (shared by its engines)."""
        return self._compiler[1].killed if self._compiler is not None else 0

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def apply(self, logits_B_V: torch.Tensor,
              matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Set, in place, the logits of tokens each row's matcher forbids to -inf. Without a
        matcher in the batch this is a no-op that never imports xgrammar (unconstrained sampling
        runs where xgrammar is not installed)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matcher = matchers[i]
            assert matcher is not None
            matcher.fill_next_token_bitmask(bitmask, i)
        width = logits_B_V.shape[-1]
        xgr.apply_token_bitmask_inplace(
            logits_B_V, bitmask.to(logits_B_V.device, non_blocking=True),
            vocab_size=min(width, self.vocab_size), indices=rows)



@dataclass
class _Pending:
    """A compile in flight and how many requests wait for it."""

    task: asyncio.Task[Any]
    waiting: int = 0
