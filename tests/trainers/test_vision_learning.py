"""A vision-language policy learns from its images: on a task whose answer is only in the
screenshot, a tiny VLM's reward rises above what a policy can get without looking, and the same
run with blanked screenshots stays at that ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import agentrl
from agentrl import ChatEnv

COLOURS = ((230, 30, 30), (30, 200, 30), (30, 30, 230), (230, 230, 30))
BLIND_CEILING = 1 / len(COLOURS)


class ColourDigitEnv(ChatEnv):
    """The screen is filled with one of four colours c; the reward is the fraction of the
    answer's characters whose code point is c modulo 4. Every character counts for exactly one
    colour, so a policy that cannot see the screen gets 1/4 in expectation whatever it writes
    (and a random one gets about that from the start: GRPO has a signal at once)."""

    image_shape = (28, 28, 3)

    def __init__(self, blank: bool = False) -> None:
        self.blank, self.colour = blank, 0

    def reset(self, *, seed=None, options=None):
        self.colour = int(self.np_random.integers(len(COLOURS)))
        pixels = np.empty(self.image_shape, dtype=np.uint8)
        pixels[:] = (128, 128, 128) if self.blank else COLOURS[self.colour]
        return [{"role": "user", "content": [
            {"type": "text", "text": "Which colour?"}, {"type": "image", "image": pixels}]}]

    def step(self, text):
        t = text.strip()
        reward = sum(ord(c) % 4 == self.colour for c in t) / len(t) if t else 0.0
        return [], reward, True, False, {}


agentrl.register("test/ColourDigit-v0", ColourDigitEnv)


def _rewards(run_dir: str) -> list[float]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in rows if "reward" in r]


@pytest.mark.slow
def test_a_tiny_vlm_learns_from_the_screen_and_not_without_it(make_cfg):
    from trainers.controller import Trainer

    def run(blank: bool) -> list[float]:
        cfg = make_cfg(env="test/ColourDigit-v0", env_kwargs={"blank": blank},
                       actor={"model": "tiny-llava", "lr": 5e-3},
                       rollout={"max_new_tokens": 4}, steps=120,
                       run_dir=str(Path(make_cfg().run_dir).parent / f"run-{blank}"))
        Trainer(cfg).run()
        return _rewards(cfg.run_dir)

    seen, blank = run(False), run(True)
    # The best 10-step stretch of each run: the tiny model may fall back after it learned, so
    # the last steps alone are noise; the blanked run must stay at the ceiling throughout. At
    # lr 1e-2 and 80 steps a fresh-clone CI run peaked at 0.35 and collapsed; at lr 5e-3 and
    # 120 steps three seeds gave best stretches 0.57-0.74 with images, 0.27-0.30 blanked.
    best_seen, best_blank = (max(np.convolve(r, np.ones(10) / 10, "valid")) for r in (seen, blank))
    assert best_seen > BLIND_CEILING + 0.15, f"with images: {seen}"
    assert best_blank < BLIND_CEILING + 0.08, f"blanked: {blank}"
