"""ScreenClick: click the target on each screenshot. What to click is visible only in the image.

The screen is a grid of cells (default 4 x 4 cells of 28 px: a 112 x 112 screenshot). Each
screen shows one red target square and a few grey distractors; the text only says "click the
red square". The model answers `click(x, y)`; a click inside the target's cell scores
1 / targets and the next screen puts the next target elsewhere. An episode has `targets`
screens (default 3), so its return is the fraction of targets hit.

Image-blind ceiling: targets are placed uniformly over the cells, so a policy that cannot see
scores 1 / cells per screen at best: an expected return of 1/16 = 0.0625 with the defaults
(`blind_ceiling`), and it solves an episode (`info["correct"]`: every target hit, what pass@1
counts) with probability (1/16)^3 < 0.001.

Splits: an episode is identified by its sequence of target cells; `eval` holds the sequences
whose hash falls in one tenth of the space and `train` the rest, so held-out episodes are never
trained on.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message
from environments.screenshot.actions import Click, parse_action

SPLITS = ("train", "eval")
_BACKGROUND = (245, 245, 240)
_GRID = (220, 220, 215)
_TARGET = (220, 30, 30)
_DISTRACTOR = (120, 120, 120)

INSTRUCTIONS = (
    "You see a screenshot. Click the red square by answering click(x, y), where x and y are "
    "pixels from the top-left corner of the screen."
)


class ScreenClickEnv(ChatEnv):
    """Click the red square on each of several screenshots (image-only task)."""

    shows_images = True

    def __init__(
        self, *, split: str = "train", grid: int = 4, cell: int = 28, targets: int = 3,
        distractors: int = 2,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if grid < 2 or cell < 8 or targets < 1 or not 0 <= distractors < grid * grid - 1:
            raise ValueError(
                f"need grid >= 2, cell >= 8, targets >= 1 and 0 <= distractors < grid^2 - 1; "
                f"got grid={grid}, cell={cell}, targets={targets}, distractors={distractors}"
            )
        self.split, self.grid, self.cell = split, grid, cell
        self.image_shape = (grid * cell, grid * cell, 3)
        self.targets, self.distractors = targets, distractors
        self.sequence: list[int] = []
        self.turn = 0
        self.hits = 0
        self._distractor_cells: list[int] = []

    @property
    def blind_ceiling(self) -> float:
        """Best expected return of a policy that does not see the screen."""
        return 1.0 / (self.grid * self.grid)

    @property
    def size(self) -> int:
        return self.grid * self.cell

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        cells = self.grid * self.grid
        while True:  # rejection-sample an episode of this split
            seq = [int(c) for c in self.np_random.integers(0, cells, self.targets)]
            if _split_of(seq) == self.split:
                break
        self.sequence, self.turn, self.hits = seq, 0, 0
        return [self._screen(INSTRUCTIONS)], {"split": self.split, "targets": list(seq)}

    def step(self, assistant_text: str) -> StepResult:
        action = parse_action(assistant_text)
        target = self.sequence[self.turn]
        hit = isinstance(action, Click) and self._cell_at(action.x, action.y) == target
        self.turn += 1
        self.hits += hit
        info: dict[str, Any] = {"hits": self.hits, "malformed": not isinstance(action, Click)}
        done = self.turn >= self.targets
        reward = 1.0 / self.targets if hit else 0.0
        if done:
            info["success"] = self.hits / self.targets
            info["correct"] = self.hits == self.targets  # solved: every target hit
            return [], reward, True, False, info
        if not isinstance(action, Click):
            note = "That was not an action. Answer with click(x, y)."
        else:
            note = "Hit." if hit else "Missed."
        return [self._screen(f"{note} Next screen: click the red square.")], reward, False, \
            False, info

    def _cell_at(self, x: int, y: int) -> int | None:
        if not (0 <= x < self.size and 0 <= y < self.size):
            return None
        return (y // self.cell) * self.grid + x // self.cell

    def _screen(self, text: str) -> Message:
        target = self.sequence[self.turn]
        others = [c for c in range(self.grid * self.grid) if c != target]
        self._distractor_cells = [
            int(c) for c in self.np_random.choice(others, self.distractors, replace=False)
        ]
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image", "image": self.render()}]}

    def render(self) -> np.ndarray:
        """The current screenshot, uint8 (size, size, 3)."""
        img = np.empty((self.size, self.size, 3), dtype=np.uint8)
        img[:] = _BACKGROUND
        img[:: self.cell, :] = _GRID
        img[:, :: self.cell] = _GRID
        pad = max(2, self.cell // 6)
        for c, colour in [(self.sequence[self.turn], _TARGET),
                          *((d, _DISTRACTOR) for d in self._distractor_cells)]:
            r, q = divmod(c, self.grid)
            y0, x0 = r * self.cell + pad, q * self.cell + pad
            img[y0 : y0 + self.cell - 2 * pad, x0 : x0 + self.cell - 2 * pad] = colour
        return img

    def oracle_action(self) -> str:
        """The answer that hits the current target (its cell's centre): for supervised warm-up
        data and tests."""
        r, q = divmod(self.sequence[self.turn], self.grid)
        return f"click({q * self.cell + self.cell // 2}, {r * self.cell + self.cell // 2})"


def _split_of(sequence: list[int]) -> str:
    h = hashlib.blake2b(str(sequence).encode(), digest_size=2).digest()
    return "eval" if int.from_bytes(h, "little") % 10 == 0 else "train"
