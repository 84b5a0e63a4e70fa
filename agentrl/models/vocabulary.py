"""Whether two models read token ids alike: the same vocabulary (every token string and its id,
added and special tokens included), told from their tokenizers without loading either model.

A model that scores another's tokens (an on-policy distillation teacher) reads the ids that
model sampled; under another vocabulary the same id is another token, and every score would be
wrong without any error.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def vocabulary(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Token string -> id, added tokens included."""
    return dict(tokenizer.get_vocab())


def vocabulary_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of the vocabulary (sorted by id): equal digests, equal vocabularies."""
    items = sorted(vocabulary(tokenizer).items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_shared_vocabulary(
    model: str, other: str, *, model_flag: str, other_flag: str
) -> None:
    """ValueError, in one line naming both models, unless models `model` and `other` (names or
    directories, see `agentrl.models`) have the same vocabulary. Loads their tokenizers only."""
    from agentrl.models import resolve_tokenizer

    ours, theirs = resolve_tokenizer(model), resolve_tokenizer(other)
    if vocabulary_digest(ours) == vocabulary_digest(theirs):
        return
    a, b = vocabulary(ours), vocabulary(theirs)
    by_id = {i: t for t, i in b.items()}
    first = min((i for t, i in a.items() if by_id.get(i) != t), default=None)
    example = ""
    if first is not None:
        mine = next(t for t, i in a.items() if i == first)
        example = f", e.g. id {first} is {mine!r} for one and {by_id.get(first)!r} for the other"
    raise ValueError(
        f"{other_flag} {other} does not share the tokenizer of {model_flag} {model} "
        f"({len(b)} vs {len(a)} tokens{example}): it would read the token ids {model} samples "
        f"as other tokens; use a model with {model}'s tokenizer (the same base model, or one "
        f"trained from it)"
    )
