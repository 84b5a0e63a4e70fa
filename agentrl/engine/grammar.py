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
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

MAX_WHITESPACE = 2
"""Longest run of whitespace allowed between JSON tokens: small models, once inside a JSON
value, can otherwise emit newlines until max_tokens."""


class GrammarError(ValueError):
    """A schema or grammar the grammar library cannot compile."""


_LIBRARY_ERRORS = (RuntimeError, ValueError, TypeError)
"""What xgrammar raises for bad input (its C++ errors arrive as RuntimeError)."""


def _library_error(what: str, e: Exception) -> GrammarError:
    # xgrammar prefixes messages with a timestamp and the C++ source line; keep the reason.
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in reason and reason.startswith("["):
        reason = reason.split(": ", 1)[-1] if ": " in reason else reason
    return GrammarError(f"{what} cannot be compiled into a grammar: {reason}")


def json_schema_grammar(schema: dict[str, Any] | bool, *, what: str = "the JSON schema") -> str:
    """A grammar for JSON text valid under `schema` (additional properties only where the schema
    allows them explicitly, as OpenAI's strict mode)."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
    except _LIBRARY_ERRORS as e:
        raise _library_error(what, e) from None
    return str(grammar)


def json_object_grammar() -> str:
    """A grammar for any JSON object (OpenAI's `response_format: json_object`)."""
    return json_schema_grammar({"type": "object"})


def structural_tag_grammar(fmt: dict[str, Any], *, what: str = "the tool schemas") -> str:
    """A grammar from an xgrammar structural-tag format (tags, triggers, separators)."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt}))
    except _LIBRARY_ERRORS as e:
        raise _library_error(what, e) from None
    return str(grammar)


def union_grammar(*grammars: str) -> str:
    """A grammar matching what any of `grammars` matches."""
    import xgrammar as xgr

    return str(xgr.Grammar.union(*(xgr.Grammar.from_ebnf(g) for g in grammars)))


def check_grammar(ebnf: str) -> None:
    """Raise GrammarError unless `ebnf` parses as an xgrammar grammar."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_ebnf(ebnf)
    except _LIBRARY_ERRORS as e:
        raise _library_error("the grammar", e) from None


class GrammarMasks:
    """Compiles grammars for one tokenizer (each distinct grammar once) and masks logits.

    `vocab_size` is the width of the model's logits (often more than the tokenizer's ids);
    `stop_ids` are the tokens that end a completion, the only ones a finished grammar allows.
    Thread-safe: a request's grammar is compiled by the thread that submits it, and masks are
    applied by the engine's worker thread.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 stop_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, ebnf: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            compiler = self._compiler
        try:
            return compiler.compile_grammar(ebnf)
        except _LIBRARY_ERRORS as e:
            raise _library_error("the grammar", e) from None

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def apply(self, logits_B_V: torch.Tensor,
              matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Set, in place, the logits of tokens each row's matcher forbids to -inf."""
        import xgrammar as xgr

        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matcher = matchers[i]
            assert matcher is not None
            matcher.fill_next_token_bitmask(bitmask, i)
        width = logits_B_V.shape[-1]
        xgr.apply_token_bitmask_inplace(
            logits_B_V, bitmask.to(logits_B_V.device, non_blocking=True),
            vocab_size=min(width, self.vocab_size), indices=rows)
