"""ScreenForm: fill in a form whose instructions and fields are drawn on the screen.

A GUI task for real vision-language models: the screenshot shows a task line ("Enter name:
MAYA, code: 4821"), labelled input fields and a Submit button; the text of the conversation
never says the values. The model clicks a field to focus it (`click(x, y)`), types into it
(`type("MAYA")`), and presses Submit (`click` on the button, or `submit()`). Every action gives
a new screenshot, where typed text shows in its field and the focused field is outlined. The
reward is 1 when the form is submitted with every field right, else 0; the episode also ends
after `max_steps` actions. Reading the screen is the whole task: a policy that cannot see has
no way to know the values (image-blind success ~0).

Splits: an episode is identified by its field values; `eval` holds the values whose hash falls
in one tenth of the space, `train` the rest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message
from environments.screenshot.actions import Click, Submit, Type, parse_action

SPLITS = ("train", "eval")
_NAMES = ("MAYA", "OMAR", "LENA", "IVAN", "ZOE", "KAI", "NORA", "LEO", "ADA", "BEN", "EVA", "TOM")
_WIDTH, _HEIGHT = 224, 160
_ROW0, _ROW_H, _FIELD_X, _FIELD_W = 44, 30, 84, 120

INSTRUCTIONS = (
    "You see a form on a screenshot. Do what its first line says. Actions: click(x, y) to "
    "focus a field or press a button (x, y in pixels from the top-left corner), type(\"text\") "
    "to type into the focused field, submit() to submit. One action per answer."
)


class ScreenFormEnv(ChatEnv):
    """Fill in a drawn form (name, code) from the instructions on the screen, then submit."""

    shows_images = True

    def __init__(self, *, split: str = "train", max_steps: int = 8) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.split, self.max_steps = split, max_steps
        self.image_shape = (_HEIGHT, _WIDTH, 3)
        self.labels = ("name", "code")
        self.values: dict[str, str] = {}
        self.typed: dict[str, str] = {}
        self.focus: str | None = None
        self.steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        while True:
            values = {"name": str(self.np_random.choice(_NAMES)),
                      "code": f"{int(self.np_random.integers(0, 10_000)):04d}"}
            if _split_of(values) == self.split:
                break
        self.values, self.typed = values, dict.fromkeys(self.labels, "")
        self.focus, self.steps = None, 0
        return [self._screen(INSTRUCTIONS)], {"split": self.split}

    def step(self, assistant_text: str) -> StepResult:
        self.steps += 1
        action = parse_action(assistant_text)
        note = ""
        submitted = False
        if action is None:
            note = "That was not an action. Use click(x, y), type(\"text\") or submit()."
        elif isinstance(action, Click):
            hit = self._hit(action.x, action.y)
            if hit == "submit":
                submitted = True
            elif hit is not None:
                self.focus = hit
            else:
                note = "Nothing there."
        elif isinstance(action, Type):
            if self.focus is None:
                note = "No field is focused; click a field first."
            else:
                self.typed[self.focus] = action.text[:12]
        elif isinstance(action, Submit):
            submitted = True
        correct = all(self.typed[k] == self.values[k] for k in self.labels)
        info: dict[str, Any] = {"malformed": action is None, "steps": self.steps}
        if submitted or self.steps >= self.max_steps:
            info["success"] = float(submitted and correct)
            return [], float(submitted and correct), bool(submitted), not submitted, info
        return [self._screen(note or "Next screen.")], 0.0, False, False, info

    # ------------------------------------------------------------------ screen
    def _field_box(self, i: int) -> tuple[int, int, int, int]:
        y = _ROW0 + i * _ROW_H
        return _FIELD_X, y, _FIELD_X + _FIELD_W, y + 20

    def _button_box(self) -> tuple[int, int, int, int]:
        y = _ROW0 + len(self.labels) * _ROW_H + 6
        return _FIELD_X, y, _FIELD_X + 64, y + 22

    def _hit(self, x: int, y: int) -> str | None:
        for i, label in enumerate(self.labels):
            if _inside(x, y, self._field_box(i)):
                return label
        return "submit" if _inside(x, y, self._button_box()) else None

    def _screen(self, text: str) -> Message:
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image", "image": self.render()}]}

    def render(self) -> np.ndarray:
        """The current screenshot, uint8 (160, 224, 3)."""
        from PIL import Image, ImageDraw, ImageFont

        img = Image.new("RGB", (_WIDTH, _HEIGHT), (250, 250, 250))
        d = ImageDraw.Draw(img)
        font = ImageFont.load_default(size=12)
        task = ", ".join(f"{k}: {v}" for k, v in self.values.items())
        d.text((8, 8), f"Enter {task}", fill=(0, 0, 0), font=font)
        for i, label in enumerate(self.labels):
            x0, y0, x1, y1 = self._field_box(i)
            d.text((8, y0 + 3), label.capitalize(), fill=(40, 40, 40), font=font)
            outline = (30, 90, 220) if self.focus == label else (150, 150, 150)
            d.rectangle((x0, y0, x1, y1), fill=(255, 255, 255), outline=outline,
                        width=2 if self.focus == label else 1)
            d.text((x0 + 4, y0 + 3), self.typed[label], fill=(0, 0, 0), font=font)
        x0, y0, x1, y1 = self._button_box()
        d.rectangle((x0, y0, x1, y1), fill=(40, 120, 60))
        d.text((x0 + 10, y0 + 4), "Submit", fill=(255, 255, 255), font=font)
        return np.asarray(img, dtype=np.uint8).copy()

    def oracle_action(self) -> str:
        """The next action of a perfect player: focus, type, next field, ..., submit."""
        for i, label in enumerate(self.labels):
            if self.typed[label] != self.values[label]:
                if self.focus != label:
                    x0, y0, x1, y1 = self._field_box(i)
                    return f"click({(x0 + x1) // 2}, {(y0 + y1) // 2})"
                return f'type("{self.values[label]}")'
        return "submit()"


def _inside(x: int, y: int, box: tuple[int, int, int, int]) -> bool:
    x0, y0, x1, y1 = box
    return x0 <= x <= x1 and y0 <= y <= y1


def _split_of(values: dict[str, str]) -> str:
    h = hashlib.blake2b(repr(sorted(values.items())).encode(), digest_size=2).digest()
    return "eval" if int.from_bytes(h, "little") % 10 == 0 else "train"
