"""`TokenEnv`: the token-level Gymnasium environment every producer and trainer speaks.

Observation: {"tokens": int64[N] new context tokens, "images": tuple of uint8 HxWx3 arrays}.
Action: int64[M], exactly the tokens the policy sampled this turn. Rewards are per step;
`terminated` means the task ended, `truncated` that a token or turn budget ran out.

Observations extend the context, except one that comes with `info["new_segment"] = True`: it
is a whole new context (a chat template rewrote the earlier conversation, see
`agentrl.segments`), and the episode goes on in a new segment, recorded as a trajectory of its
own with the episode's outcome.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces

Obs = dict[str, Any]

DEFAULT_IMAGE_SHAPE = (224, 224, 3)


def token_space(vocab_size: int) -> spaces.Sequence:
    return spaces.Sequence(spaces.Discrete(vocab_size), stack=True)


def make_observation_space(
    vocab_size: int, image_shape: tuple[int, int, int] = DEFAULT_IMAGE_SHAPE
) -> spaces.Dict:
    return spaces.Dict(
        {
            "tokens": token_space(vocab_size),
            "images": spaces.Sequence(spaces.Box(0, 255, image_shape, np.uint8)),
        }
    )


def make_obs(tokens: Any, images: tuple[np.ndarray, ...] = ()) -> Obs:
    return {"tokens": np.asarray(tokens, dtype=np.int64).reshape(-1), "images": tuple(images)}


def validate_action(action: Any, vocab_size: int) -> np.ndarray:
    """Return the action as int64[M], or raise ValueError saying what was expected."""
    arr = np.asarray(action)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(
            f"action must be a 1-D sequence of token ids (int64[M]); got an array of shape "
            f"{arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"action must hold integer token ids (dtype int64); got dtype {arr.dtype}. Pass the "
            f"sampled ids, e.g. np.asarray(ids, dtype=np.int64), not logits or text"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"action token id {bad} is outside the vocabulary [0, {vocab_size}); the action must "
            f"be ids from this env's tokenizer"
        )
    return arr.astype(np.int64, copy=False)


class TokenEnv(gym.Env):
    """Base class for token-level environments.

    Subclasses set `vocab_size` (and optionally `image_shape`) before calling
    `super().__init__()` ... or call `_init_spaces(vocab_size)`, and implement
    `reset` / `step` with the observation layout above.
    """

    # gym.Env's own declaration; a ClassVar would conflict with its instance annotation.
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012

    def _init_spaces(
        self, vocab_size: int, image_shape: tuple[int, int, int] = DEFAULT_IMAGE_SHAPE
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.observation_space = make_observation_space(self.vocab_size, image_shape)
        self.action_space = token_space(self.vocab_size)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Obs, dict[str, Any]]:
        super().reset(seed=seed)
        raise NotImplementedError

    def step(self, action: Any) -> tuple[Obs, SupportsFloat, bool, bool, dict[str, Any]]:
        raise NotImplementedError
