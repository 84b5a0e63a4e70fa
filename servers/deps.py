"""The tokenizer protocol the proxy depends on, so tests build the real app from fakes.

The engine is `agentrl.engine.Engine` (fakes in `agentrl.engine.fakes`); the session store is
`servers.sessions.SessionStore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the proxy uses."""

    eos_token_id: int | None

    @property
    def all_special_ids(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def apply_chat_template(self, conversation: list, **kwargs: object) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def get_vocab(self) -> dict[str, int]: ...
